# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The server-loop mode (megatron_ext.bench.mla_engine_server) drives the engine's own loop: stub
engines record which entry points were called."""

import asyncio
from types import SimpleNamespace

import pytest

from megatron_ext.bench import mla_engine_server as server


class _Record:
    def __init__(self, request_id, tokens):
        self.request_id, self.tokens = request_id, tokens

    def merge(self):
        return SimpleNamespace(request_id=self.request_id, generated_tokens=self.tokens)


class LoopEngine:
    """megatron-core's engine as far as the mode sees it: add_request returns a future of the
    engine's event loop, run_engine steps until cancelled and resolves the futures."""

    def __init__(self, generate):
        self._loop = asyncio.new_event_loop()
        self.generate_count, self.calls, self.pending = generate, [], {}

    def add_request(self, request_id, prompt, params):
        self.calls.append("add_request")
        future = self._loop.create_future()
        self.pending[request_id] = (future, prompt)
        return future

    async def run_engine(self, *, loop=None):
        self.calls.append("run_engine")
        assert loop is self._loop
        try:
            while True:
                await asyncio.sleep(0)
                self.calls.append("async_step")
                for request_id, (future, prompt) in list(self.pending.items()):
                    tokens = [len(prompt)] * self.generate_count
                    future.set_result(_Record(request_id, tokens))
                    del self.pending[request_id]
        except asyncio.CancelledError:
            self.calls.append("cancelled")
            raise

    def step_modern(self):
        raise AssertionError("the server loop must not be stepped by the benchmark")


class GenerateEngine:
    def __init__(self):
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append(("generate", len(prompts), params))
        return [_Record(i, [0] * 3) for i in range(len(prompts))]


def test_the_mode_runs_the_engines_asyncio_loop_to_completion():
    engine = LoopEngine(generate=4)
    prompts = [[1, 2], [3, 4, 5], [6]]
    result = server.run_server_loop(engine, prompts, "params", first_id=10)
    assert result == {"entry": "run_engine", "tokens": 12, "requests": 3}
    assert engine.calls[:4] == ["add_request"] * 3 + ["run_engine"]
    assert "async_step" in engine.calls and engine.calls[-1] == "cancelled"
    assert not engine.pending
    engine._loop.close()


def test_an_engine_without_run_engine_serves_through_generate():
    engine = GenerateEngine()
    assert server.server_loop_entry(engine) == "generate"
    result = server.run_server_loop(engine, [[1], [2]], "params", first_id=0)
    assert result == {"entry": "generate", "tokens": 6, "requests": 2}
    assert engine.calls == [("generate", 2, "params")]


def test_the_timed_loop_reports_tokens_per_second_and_the_host_share():
    engine = LoopEngine(generate=2)
    syncs, profiled = [], []

    def profile(run):
        profiled.append(run())
        return 0.0  # no GPU work: all host

    result = server.time_server_loop(engine, [[1], [2]], "p", 0, lambda: syncs.append(1), profile)
    assert result["tokens"] == 4 and result["tokens_per_s"] == pytest.approx(4 / result["seconds"])
    assert result["host_share"] == pytest.approx(1.0) and result["gpu_s"] == 0.0
    assert profiled[0]["requests"] == 2 and engine.calls.count("run_engine") == 2
    assert len(syncs) == 4  # before and after each loop, never between steps
    plain = server.time_server_loop(engine, [[1]], "p", 4, lambda: None)
    assert plain["host_share"] is None
    engine._loop.close()
