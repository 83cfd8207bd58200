# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The MLA engine benchmark's server-loop mode (``--server-loop``): what a server sees. Every
request is added at once and megatron-core's engine runs its own loop to completion, never
stepped nor synchronised by the benchmark between steps:

* ``run_engine`` (megatron-core 0.16 and 0.19): the asyncio loop a server runs
  (``DynamicInferenceEngine.run_engine``, its ``async_step`` while requests are active); the
  requests' futures (``add_request``'s) are awaited, then the loop task is cancelled, as a
  server shutting down does;
* ``generate`` (an engine without ``run_engine``): ``DynamicInferenceEngine.generate``, the
  engine's own add-all-then-step loop.

The figure is generated tokens over the loop's wall time (synchronised before and after), the
prefill included: there is no step boundary to separate it at. Host share: one more loop under
``torch.profiler`` (CUDA activity), ``1 - GPU time / wall time``, as the timed rows'.
"""

import asyncio
import contextlib
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

__all__ = ["run_server_loop", "server_loop_entry", "time_server_loop"]


def server_loop_entry(engine: Any) -> str:
    """The engine's own loop the mode drives: ``"run_engine"`` where it has one, else
    ``"generate"``."""
    return "run_engine" if callable(getattr(engine, "run_engine", None)) else "generate"


async def _serve(engine: Any, requests: List[Any], loop: Any) -> List[Any]:
    futures = [
        engine.add_request(request_id, prompt, params) for request_id, prompt, params in requests
    ]
    task = loop.create_task(engine.run_engine(loop=loop))
    try:
        return list(await asyncio.gather(*futures))
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def run_server_loop(
    engine: Any, prompts: Sequence[Sequence[int]], params: Any, first_id: int
) -> Dict[str, Any]:
    """Add one request per prompt and run the engine's own loop until every one has finished.

    Args:
        engine: a ``DynamicInferenceEngine`` (idle: no unfinished request).
        prompts: token ids per request.
        params: the requests' ``SamplingParams``.
        first_id: the first request id (ids must not repeat across the engine's life).

    Returns:
        Dict[str, Any]: ``entry`` (the loop driven), ``tokens`` (generated tokens of every
        request) and ``requests``.
    """
    entry = server_loop_entry(engine)
    requests = [(first_id + i, list(prompt), params) for i, prompt in enumerate(prompts)]
    if entry == "run_engine":
        # The requests' futures belong to the engine's event loop, so the loop runs there.
        loop = engine._loop
        records = loop.run_until_complete(_serve(engine, requests, loop))
    else:
        records = engine.generate([prompt for _, prompt, _ in requests], params)
    merged = [record.merge() if hasattr(record, "merge") else record for record in records]
    return {
        "entry": entry,
        "tokens": sum(len(request.generated_tokens) for request in merged),
        "requests": len(merged),
    }


def time_server_loop(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    params: Any,
    first_id: int,
    sync: Callable[[], None],
    profile: Optional[Callable[[Callable[[], Any]], float]] = None,
) -> Dict[str, Any]:
    """One timed loop (and, with ``profile``, one more under the profiler).

    Args:
        engine: as :func:`run_server_loop`'s.
        prompts: as :func:`run_server_loop`'s.
        params: as :func:`run_server_loop`'s.
        first_id: as :func:`run_server_loop`'s (the profiled loop takes the ids after them).
        sync: waits for the device.
        profile: runs a callable under the profiler and returns the GPU time it saw, in seconds.

    Returns:
        Dict[str, Any]: :func:`run_server_loop`'s, with ``seconds``, ``tokens_per_s``,
        ``gpu_s`` and ``host_share`` (None without ``profile``).
    """
    sync()
    began = time.perf_counter()
    result = run_server_loop(engine, prompts, params, first_id)
    sync()
    seconds = time.perf_counter() - began
    result.update(seconds=seconds, tokens_per_s=result["tokens"] / seconds)
    result.update(gpu_s=None, host_share=None)
    if profile is not None:
        second = first_id + len(prompts)
        sync()
        began = time.perf_counter()
        gpu = profile(lambda: run_server_loop(engine, prompts, params, second))
        sync()
        wall = time.perf_counter() - began
        result.update(gpu_s=gpu, host_share=max(0.0, 1.0 - gpu / wall))
    return result
