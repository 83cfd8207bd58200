#!/usr/bin/env python
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Functional case: an MLA GPT behind megatron-core's OpenAI-compatible server, with a real client.

megatron-core 0.19's high-level API serves a model over HTTP: ``MegatronAsyncLLM`` builds the
``DynamicInferenceEngine`` (context, ``GPTInferenceWrapper``, controller) from the model and an
``InferenceConfig``, spawns the data-parallel coordinator (ZMQ + msgpack) and runs the engine
loop on a background thread; ``serve(ServeConfig(...))`` forks the Quart + Hypercorn frontend
processes, each with its own ``InferenceClient``, answering ``/v1/completions`` and
``/v1/chat/completions``. Here a small MLA GPT (``cache_mla_latents``) with
``--mla-rope-contiguous-load`` and ``--inference-static-active-slices`` applied is served on
127.0.0.1, and the ``openai`` package's ``AsyncOpenAI`` client sends a bounded number of greedy
requests over a bounded number of concurrent connections (every ``--chat-every``-th through
``chat.completions``, the rest through ``completions`` with token-id prompts); then the server
is shut down (frontends, engine, coordinator) and the case checks that nothing is left.

Checks: every request finishes; the tokens the server returned equal, request by request, the
tokens megatron-core's engine generates for the same prompts and sampling parameters run
directly (``MegatronLLM`` without a coordinator, same model, same ``InferenceConfig``); after the
load, bad completions requests (a token id equal to the model's vocabulary size, an empty
token-id prompt, a temperature of -1) are each answered with an error response (4xx) naming what
is wrong, and a good request sent after them is served with the engine's tokens; the shutdown
leaves no frontend or coordinator process and the port closed. Float32 by default:
the served run batches the requests differently from the direct one (they arrive over HTTP),
and float32 keeps the greedy choices away from ties that a different batch could round the
other way.

Reported: generated tokens/s over the whole load, the client's request latency (p50/p99) and,
from the engine's per-token timestamps (``track_generated_token_events``), time to first token
and inter-token latency (p50/p99). megatron-core 0.19.2's endpoints do not stream (there is no
``stream`` option; a response is sent when its request has finished), so a client sees its
first token when it sees the last one: the client's time to first token is its request
latency, and TTFT/ITL are the engine's.

megatron-core 0.16.1 has no ``MegatronAsyncLLM`` and no ``start_text_gen_server`` (its
``dynamic_text_gen_server`` is a Flask app started by ``run_flask_server``); the case does not
apply there, and says so (exit status 2, no result file), as it does where the ``server``
extra's packages (quart, hypercorn, openai, pyzmq, msgpack) are missing.

Standalone::

    python tests/functional_tests/test_cases/gpt/mla_dynamic_server/run_case.py --out DIR

Through the functional-test runner (model_config.yaml in this directory), which passes
``--output-json PATH``. ``--device cpu --quick`` runs the tiny model without a GPU (Triton
interpreter).
"""

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

# Deterministic cuBLAS workspaces; must be set before CUDA initialises.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

REPO_ROOT = Path(__file__).resolve().parents[5]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton decides at import time whether its kernels run in the CPU interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
HOST = "127.0.0.1"
# Modules the served path needs: megatron-core 0.19's high-level API and server, and the
# `server` extra's packages (megatron-core imports them lazily and fails only when serving).
REQUIRED_MODULES = (
    ("megatron.core.inference.apis", "megatron-core's MegatronAsyncLLM (0.19 and later)"),
    (
        "megatron.core.inference.text_generation_server.dynamic_text_gen_server."
        "text_generation_server",
        "megatron-core's start_text_gen_server (0.19 and later)",
    ),
    ("quart", "the server extra: quart"),
    ("hypercorn", "the server extra: hypercorn"),
    ("openai", "the server extra: openai"),
    ("zmq", "the server extra: pyzmq"),
    ("msgpack", "the server extra: msgpack"),
)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Command line; defaults are the case's GPU configuration.

    Args:
        argv: arguments; ``sys.argv[1:]`` when None.

    Returns:
        argparse.Namespace: the arguments (``--quick`` applied).
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="directory for metrics.json")
    p.add_argument("--output-json", type=Path, default=None, help="result file (runner format)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="tiny model, few requests (CPU smoke)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--num-requests", type=int, default=64, help="requests sent, in all")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    p.add_argument("--chat-every", type=int, default=4, help="every N-th request is a chat one")
    p.add_argument("--prompt-length", type=int, nargs=2, default=[4, 160], metavar=("MIN", "MAX"))
    p.add_argument("--generate-length", type=int, nargs=2, default=[8, 48], metavar=("MIN", "MAX"))
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--qk-head-dim", type=int, default=128)
    p.add_argument("--qk-pos-emb-head-dim", type=int, default=64)
    p.add_argument("--v-head-dim", type=int, default=128)
    p.add_argument("--init-method-std", type=float, default=0.02)
    p.add_argument("--max-sequence-length", type=int, default=256)
    p.add_argument("--max-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128, help="step token budget (chunking)")
    p.add_argument("--block-size-tokens", type=int, default=16)
    p.add_argument("--kv-blocks", type=int, default=64, help="latent-cache blocks")
    p.add_argument("--paused-kv-blocks", type=int, default=8)
    p.add_argument("--frontend-replicas", type=int, default=2, help="HTTP frontend processes")
    p.add_argument("--port", type=int, default=0, help="HTTP port (0: a free one)")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds for /health")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    args = p.parse_args(argv)
    if args.out is None and args.output_json is None:
        p.error("give --out DIR or --output-json PATH")
    if args.quick:
        from megatron_ext.testing.mla_dynamic_engine import TINY_MLA_SIZES

        for name, value in TINY_MLA_SIZES.items():
            setattr(args, name, value)
        args.num_requests = min(args.num_requests, 12)
        args.concurrency = min(args.concurrency, 6)
        args.prompt_length = [4, 40]
        args.generate_length = [2, 8]
        args.max_requests, args.max_tokens = 8, 64
        args.kv_blocks, args.paused_kv_blocks, args.block_size_tokens = 40, 4, 8
    if args.concurrency < 1 or args.num_requests < 1 or args.chat_every < 1:
        p.error("--num-requests, --concurrency and --chat-every must be >= 1")
    return args


def missing_requirements() -> List[str]:
    """What this environment lacks for the served path (empty when it can run).

    Returns:
        List[str]: one description per missing module.
    """
    import importlib.util

    missing = []
    for module, what in REQUIRED_MODULES:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # a parent package is missing
            found = False
        if not found:
            missing.append(f"{what} ({module})")
    return missing


def model_sizes(args: argparse.Namespace) -> Dict[str, Any]:
    """``build_small_mla_gpt``'s size keywords for the case."""
    names = (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "vocab_size",
        "max_sequence_length",
        "init_method_std",
        "kv_lora_rank",
        "qk_head_dim",
        "qk_pos_emb_head_dim",
        "v_head_dim",
    )
    return {name: getattr(args, name) for name in names}


def inference_config(model: Any, args: argparse.Namespace) -> Any:
    """The ``InferenceConfig`` both the direct and the served engine are built with.

    The latent-cache sizes are given in blocks (the context takes gigabytes): ``kv_blocks``
    blocks of ``block_size_tokens`` latent rows for every layer.

    Args:
        model: the MLA GPT (``cache_mla_latents``).
        args: the case's arguments.

    Returns:
        InferenceConfig: megatron-core's configuration.
    """
    from megatron.core.inference.config import InferenceConfig

    config = model.config
    dtype = next(model.parameters()).dtype
    row = config.kv_lora_rank + config.qk_pos_emb_head_dim
    block_gb = dtype.itemsize * config.num_layers * args.block_size_tokens * row / 1024**3
    return InferenceConfig(
        max_sequence_length=args.max_sequence_length,
        # Half a block of slack so that the context's floor division gives exactly the count.
        buffer_size_gb=(args.kv_blocks + 0.5) * block_gb,
        paused_buffer_size_gb=(args.paused_kv_blocks + 0.5) * block_gb,
        max_requests=args.max_requests,
        max_tokens=args.max_tokens,
        block_size_tokens=args.block_size_tokens,
        enable_chunked_prefill=True,
        materialize_only_last_token_logits=True,
        # Per-token timestamps: the engine-side time to first token and inter-token latency.
        track_generated_token_events=True,
    )


def null_tokenizer(vocab_size: int) -> Any:
    """megatron-core's own null tokenizer: text is space-separated token ids, end of document
    ``vocab_size - 1``. It needs no files, and the coordinator (a spawned process) can unpickle
    it because it is megatron-core's class."""
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(
        metadata_path={"library": "null-text"}, vocab_size=vocab_size
    )


def make_requests(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Prompts (token ids) and output lengths, mixed; which endpoint each goes to."""
    rng = random.Random(args.seed)
    requests = []
    for index in range(args.num_requests):
        # Token ids below the null tokenizer's end-of-document id (vocab_size - 1).
        prompt = [
            rng.randrange(args.vocab_size - 1) for _ in range(rng.randint(*args.prompt_length))
        ]
        requests.append(
            dict(
                prompt=prompt,
                max_tokens=rng.randint(*args.generate_length),
                endpoint="chat" if (index + 1) % args.chat_every == 0 else "completions",
            )
        )
    return requests


def engine_sampling_params(max_tokens: int) -> Any:
    """The ``SamplingParams`` the server's endpoints build for ``temperature=0``,
    ``logprobs``, ``ignore_eos`` and ``max_tokens`` (greedy, no termination token)."""
    from megatron.core.inference.sampling_params import SamplingParams

    return SamplingParams(
        temperature=0.0,
        top_k=1,
        top_p=0.0,
        return_log_probs=True,
        skip_prompt_log_probs=True,
        num_tokens_to_generate=max_tokens,
        termination_id=-1,
    )


def direct_outputs(
    model: Any, args: argparse.Namespace, requests: List[Dict[str, Any]]
) -> Dict[int, Dict[str, Any]]:
    """The engine's own tokens for the requests: megatron-core's ``MegatronLLM`` in direct mode
    (no coordinator, no server) around the same model and ``InferenceConfig``."""
    from megatron.core.inference.apis import MegatronLLM

    from megatron_ext.testing.synthetic import run_engine

    llm = MegatronLLM(
        model=model,
        tokenizer=null_tokenizer(args.vocab_size),
        inference_config=inference_config(model, args),
        use_coordinator=False,
    )
    work = [(r["prompt"], engine_sampling_params(r["max_tokens"])) for r in requests]
    outputs, _ = run_engine(llm.engine, work)
    return outputs


class FinishedRecords:
    """Keeps the engine's finished requests (with their event timestamps) as it reports them.

    Wraps this one engine's ``post_process_requests`` (an instance attribute; the class and
    every other engine are untouched) and returns what it returns: the server sends the records
    on to its frontends, whose responses leave the timestamps out.
    """

    def __init__(self, engine: Any) -> None:
        self.records: List[Any] = []
        inner = engine.post_process_requests

        def post_process_requests(*args: Any, **kwargs: Any) -> Any:
            active, finished = inner(*args, **kwargs)
            self.records.extend(finished)
            return active, finished

        engine.post_process_requests = post_process_requests

    def latencies(self) -> Tuple[List[float], List[float]]:
        """Time to first token (added to the engine -> first token) and every inter-token gap,
        in seconds, over the finished requests."""
        from megatron.core.inference.inference_request import DynamicInferenceEventType

        ttft, itl = [], []
        for record in self.records:
            request = record.merge() if hasattr(record, "merge") else record
            if request.ttft is not None:
                ttft.append(float(request.ttft))
            stamps = [
                e.timestamp
                for e in request.events
                if e.type == DynamicInferenceEventType.GENERATED_TOKEN
            ]
            itl.extend(b - a for a, b in zip(stamps, stamps[1:]))
        return ttft, itl


def percentile(values: List[float], q: float) -> Optional[float]:
    """Nearest-rank percentile ``q`` (0-100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def wait_until_healthy(port: int, timeout: float) -> float:
    """Poll the server's ``/health`` until it answers 200 (the frontends bind lazily).

    Returns:
        float: seconds waited.

    Raises:
        TimeoutError: when it has not answered within ``timeout`` seconds.
    """
    start = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=5) as reply:
                if reply.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"the server on port {port} did not answer /health in {timeout} s")
        time.sleep(0.25)


def openai_client(port: int, args: argparse.Namespace) -> Any:
    """The ``openai`` package's ``AsyncOpenAI`` client of the server on ``HOST:port``."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(
        base_url=f"http://{HOST}:{port}/v1",
        api_key="unused",
        max_retries=0,
        timeout=args.request_timeout,
    )


async def drive(
    port: int, args: argparse.Namespace, requests: List[Dict[str, Any]]
) -> Tuple[Dict[int, Dict[str, Any]], float]:
    """Send every request with the ``openai`` client, at most ``--concurrency`` at once.

    Returns:
        Tuple[Dict[int, Dict[str, Any]], float]: per request its ``generated_tokens``,
        ``generated_log_probs``, ``latency`` (seconds) and ``endpoint``; and the wall time of
        the whole load.
    """
    client = openai_client(port, args)
    gate = asyncio.Semaphore(args.concurrency)
    # megatron-core's extensions to the OpenAI request: no end-of-document stop.
    extra_body = {"ignore_eos": True}

    async def one(index: int, request: Dict[str, Any]) -> Tuple[int, Dict[str, Any]]:
        async with gate:
            start = time.perf_counter()
            if request["endpoint"] == "chat":
                reply = await client.chat.completions.create(
                    model="megatron",
                    # The null tokenizer reads a message's text as space-separated token ids.
                    messages=[{"role": "user", "content": " ".join(map(str, request["prompt"]))}],
                    max_tokens=request["max_tokens"],
                    temperature=0.0,
                    logprobs=True,
                    extra_body=extra_body,
                )
                message = reply.choices[0].message
                tokens = message.generation_token_ids
                log_probs = message.generation_log_probs
            else:
                reply = await client.completions.create(
                    model="megatron",
                    prompt=request["prompt"],
                    max_tokens=request["max_tokens"],
                    temperature=0.0,
                    logprobs=0,
                    extra_body=extra_body,
                )
                choice = reply.choices[0]
                tokens = choice.generation_token_ids
                log_probs = choice.generation_log_probs
            latency = time.perf_counter() - start
        return index, dict(
            generated_tokens=[int(t) for t in tokens],
            generated_log_probs=[float(x) for x in log_probs or []],
            latency=latency,
            endpoint=request["endpoint"],
        )

    start = time.perf_counter()
    try:
        done = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    finally:
        await client.close()
    return dict(done), time.perf_counter() - start


def bad_completions(vocab_size: int) -> Dict[str, Tuple[Any, float, str]]:
    """Completions requests the engine must refuse where they enter: name -> (prompt,
    temperature, what the error response must say). Before megatron_ext checked requests, the
    first made the engine's steps raise (a device-side assert on a GPU: the whole server dies),
    the second wedged the scheduler, the third was sampled from the least likely tokens."""
    return {
        "token id = vocabulary size": (
            [1, 2, vocab_size],
            0.0,
            f"prompt_tokens[2] is {vocab_size}",
        ),
        "empty token-id prompt": ([[]], 0.0, "prompt_tokens is empty"),
        "temperature -1": ([1, 2, 3], -1.0, "temperature must be finite and >= 0"),
    }


async def drive_bad_then_good(
    port: int, args: argparse.Namespace, vocab_size: int, good: Dict[str, Any]
) -> Tuple[Dict[str, Dict[str, Any]], List[int]]:
    """Send each of :func:`bad_completions` in turn, then the good request ``good``.

    Returns:
        Tuple[Dict[str, Dict[str, Any]], List[int]]: per bad request the HTTP ``status`` and the
        response's ``message`` (and what it must say, ``expect``); the good request's tokens.
    """
    from openai import APIStatusError

    client = openai_client(port, args)
    extra_body = {"ignore_eos": True}
    refusals: Dict[str, Dict[str, Any]] = {}
    try:
        for name, (prompt, temperature, expect) in bad_completions(vocab_size).items():
            try:
                reply = await client.completions.create(
                    model="megatron",
                    prompt=prompt,
                    max_tokens=4,
                    temperature=temperature,
                    extra_body=extra_body,
                )
            except APIStatusError as error:
                # The endpoint answers in plain text, which the client keeps as the response.
                message = error.response.text
                refusals[name] = dict(status=error.status_code, message=message, expect=expect)
            else:
                served = reply.choices[0].generation_token_ids
                refusals[name] = dict(status=200, message=f"served {served}", expect=expect)
        reply = await client.completions.create(
            model="megatron",
            prompt=good["prompt"],
            max_tokens=good["max_tokens"],
            temperature=0.0,
            logprobs=0,
            extra_body=extra_body,
        )
    finally:
        await client.close()
    return refusals, [int(t) for t in reply.choices[0].generation_token_ids]


def refusal_problems(
    served: Dict[str, Any], requests: List[Dict[str, Any]], direct: Dict[int, Dict[str, Any]]
) -> List[str]:
    """What is wrong with the bad requests' answers and the good request served after them."""
    problems = []
    for name, answer in served["refusals"].items():
        if not 400 <= answer["status"] < 500 or answer["expect"] not in answer["message"]:
            problems.append(
                f"bad request {name!r}: expected an error response saying {answer['expect']!r}, "
                f"got {answer['status']}: {answer['message'][:300]}"
            )
    first = next((i for i, r in enumerate(requests) if r["endpoint"] == "completions"), None)
    if first is not None and served["after_refusals"] != direct[first]["generated_tokens"]:
        problems.append(
            f"request {first} served after the refused ones: {served['after_refusals'][:8]}... "
            f"vs the engine's {direct[first]['generated_tokens'][:8]}..."
        )
    return problems


def port_is_closed(port: int) -> bool:
    """Whether nothing accepts connections on ``HOST:port`` any more."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        return sock.connect_ex((HOST, port)) != 0


async def serve_and_drive(
    model: Any, args: argparse.Namespace, requests: List[Dict[str, Any]]
) -> Dict[str, Any]:
    """Serve ``model`` with megatron-core's server, drive it, shut it down.

    Returns:
        Dict[str, Any]: ``outputs`` (per request), ``seconds`` (the load), ``ttft`` and ``itl``
        (engine-side, seconds), ``startup_seconds``, ``shutdown`` (what was left),
        ``context_class``, ``flag_context`` (the flag's context class) and ``port``.
    """
    from megatron.core.inference.apis import MegatronAsyncLLM, ServeConfig
    from megatron.core.inference.engines.dynamic_engine import EngineState
    from megatron.core.inference.text_generation_server.dynamic_text_gen_server import (
        text_generation_server as frontends,
    )

    from megatron_ext.inference.contexts.dynamic_context import StaticSlicesInferenceContext
    from megatron_ext.inference.engines.dynamic_engine import model_vocab_size
    from megatron_ext.testing.network import free_port

    port = args.port or free_port()
    start = time.monotonic()
    # Coordinator and engine sockets on the loopback interface (megatron-core would take the
    # host name's address).
    llm = MegatronAsyncLLM(
        model=model,
        tokenizer=null_tokenizer(args.vocab_size),
        inference_config=inference_config(model, args),
        coordinator_host=HOST,
    )
    records = FinishedRecords(llm.engine)
    frontend_processes: List[Any] = []
    try:
        await llm.serve(
            ServeConfig(host=HOST, port=port, frontend_replicas=args.frontend_replicas),
            blocking=False,
        )
        # megatron-core keeps its frontend processes in a module list; kept here to check after
        # shutdown that none is left.
        frontend_processes = list(frontends._SERVER_PROCESSES)
        startup = time.monotonic() - start
        startup += wait_until_healthy(port, args.startup_timeout)
        outputs, seconds = await drive(port, args, requests)
        # Bad requests through the same server, then a good one: each bad one is answered with
        # an error, and the server keeps serving.
        good = next((r for r in requests if r["endpoint"] == "completions"), requests[0])
        vocab_size = model_vocab_size(llm.engine.controller)
        refusals, after_refusals = await drive_bad_then_good(port, args, vocab_size, good)
    finally:
        coordinator = getattr(llm.engine, "inference_coordinator_process", None)
        await llm.shutdown()
        if coordinator is not None:
            # shutdown() tells the coordinator to exit; wait for it (bounded) to check it did.
            coordinator.join(timeout=30)
        shutdown = dict(
            engine_state=str(llm.engine.state.name),
            engine_stopped=llm.engine.state == EngineState.STOPPED,
            frontends_alive=sum(p.is_alive() for p in frontend_processes),
            coordinator_alive=bool(coordinator is not None and coordinator.is_alive()),
            port_closed=port_is_closed(port),
        )
    ttft, itl = records.latencies()
    return dict(
        outputs=outputs,
        refusals=refusals,
        after_refusals=after_refusals,
        seconds=seconds,
        ttft=ttft,
        itl=itl,
        startup_seconds=startup,
        shutdown=shutdown,
        context_class=type(llm.context).__name__,
        flag_context=isinstance(llm.context, StaticSlicesInferenceContext),
        port=port,
    )


def figures(served: Dict[str, Any], generated: int) -> Dict[str, Optional[float]]:
    """Throughput and latency figures of the served run (seconds, tokens/s)."""
    latency = [o["latency"] for o in served["outputs"].values()]
    return {
        "tokens_per_second": generated / served["seconds"] if served["seconds"] > 0 else None,
        "request_latency_p50_s": percentile(latency, 50),
        "request_latency_p99_s": percentile(latency, 99),
        "engine_ttft_p50_s": percentile(served["ttft"], 50),
        "engine_ttft_p99_s": percentile(served["ttft"], 99),
        "engine_itl_p50_s": percentile(served["itl"], 50),
        "engine_itl_p99_s": percentile(served["itl"], 99),
    }


def compare(
    requests: List[Dict[str, Any]],
    served: Dict[int, Dict[str, Any]],
    direct: Dict[int, Dict[str, Any]],
) -> Tuple[List[str], float]:
    """Served tokens against the direct engine's, request by request.

    Returns:
        Tuple[List[str], float]: problems, and the largest log-prob difference (reported only:
        the two runs batch the requests differently).
    """
    problems, worst = [], 0.0
    for index, request in enumerate(requests):
        if index not in served or index not in direct:
            problems.append(f"request {index}: no output (served {index in served})")
            continue
        got, want = served[index]["generated_tokens"], direct[index]["generated_tokens"]
        if len(got) != request["max_tokens"]:
            problems.append(f"request {index}: {len(got)} tokens, asked {request['max_tokens']}")
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            problems.append(
                f"request {index} ({request['endpoint']}): served tokens differ from the "
                f"engine's (first at {first}): {got[:8]}... vs {want[:8]}..."
            )
        pairs = zip(served[index]["generated_log_probs"], direct[index]["generated_log_probs"])
        worst = max([worst] + [abs(float(a) - float(b)) for a, b in pairs])
    return problems, worst


def main(argv: Optional[List[str]] = None) -> int:
    """Run the case.

    Args:
        argv: arguments; ``sys.argv[1:]`` when None.

    Returns:
        int: 0 when every check passed, 1 when one failed, 2 when the case does not apply to
        this environment (megatron-core before 0.19, or the ``server`` extra missing).
    """
    args = parse_args(argv)
    missing = missing_requirements()
    if missing:
        from megatron.core import package_info

        print(
            f"NOT APPLICABLE (megatron-core {package_info.__version__}): this environment lacks "
            f"{'; '.join(missing)}. The case needs megatron-core 0.19 or later (0.16 has no "
            "MegatronAsyncLLM and no start_text_gen_server) and the server extra "
            '(pip install -e ".[server]"); not run, no result written.'
        )
        return 2
    from megatron_ext import undo_megatron_ext
    from megatron_ext.testing.environment import run_environment
    from megatron_ext.testing.mla_dynamic_engine import build_dynamic_mla_model
    from megatron_ext.testing.synthetic import cpu_torch_compat, ensure_model_parallel

    if args.device == "cuda" and not torch.cuda.is_available():
        print("run_case: --device cuda but no CUDA GPU is visible", file=sys.stderr)
        return 1
    if args.device == "cpu" and args.dtype == "bfloat16":
        print("run_case: the Triton interpreter does not compute in bfloat16", file=sys.stderr)
        return 1
    requests = make_requests(args)
    problems: List[str] = []
    with cpu_torch_compat():
        ensure_model_parallel()
        torch.manual_seed(args.seed)
        model = build_dynamic_mla_model(model_sizes(args), DTYPES[args.dtype], args.device)
        try:
            direct_start = time.perf_counter()
            direct = direct_outputs(model, args, requests)
            direct_seconds = time.perf_counter() - direct_start
            served = asyncio.run(serve_and_drive(model, args, requests))
        finally:
            undo_megatron_ext()
    found, worst_log_prob = compare(requests, served["outputs"], direct)
    problems += found
    problems += refusal_problems(served, requests, direct)
    if not served["flag_context"]:
        problems.append(f"the server's engine ran {served['context_class']}, not the flag's")
    shutdown = served["shutdown"]
    left = shutdown["frontends_alive"] or shutdown["coordinator_alive"]
    if not shutdown["engine_stopped"] or left:
        problems.append(f"unclean shutdown: {shutdown}")
    if not shutdown["port_closed"]:
        problems.append(f"port {served['port']} still accepts connections after shutdown")

    outputs = served["outputs"]
    order = sorted(outputs)
    generated = sum(len(outputs[i]["generated_tokens"]) for i in order)
    stats = figures(served, generated)
    run: Dict[str, Any] = {"mode": f"server-{args.dtype}"}
    run["generated tokens"] = [t for i in order for t in outputs[i]["generated_tokens"]]
    run["generated lengths"] = [len(outputs[i]["generated_tokens"]) for i in order]
    run.update(
        finished_requests=len(outputs),
        chat_requests=sum(outputs[i]["endpoint"] == "chat" for i in order),
        concurrency=args.concurrency,
        frontend_replicas=args.frontend_replicas,
        tokens_equal_engine=not found,
        refused_requests={name: a["status"] for name, a in served["refusals"].items()},
        max_abs_log_prob_difference=worst_log_prob,
        seconds=served["seconds"],
        direct_seconds=direct_seconds,
        startup_seconds=served["startup_seconds"],
        shutdown=shutdown,
        context_class=served["context_class"],
        **stats,
    )
    result = {
        "runs": [run],
        "environment": run_environment(),
        "requests": len(requests),
        "problems": problems,
    }
    for path in filter(None, [args.output_json, args.out and args.out / "metrics.json"]):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")

    def ms(value: Optional[float]) -> str:
        return "n/a" if value is None else f"{1000 * value:.1f} ms"

    print(
        f"[{run['mode']}] {served['context_class']}: {len(outputs)}/{len(requests)} requests "
        f"({run['chat_requests']} chat) over {args.concurrency} connections, {generated} tokens "
        f"in {served['seconds']:.2f} s = {stats['tokens_per_second']:.1f} tokens/s; tokens equal "
        f"the engine's: {not found} (log-prob difference {worst_log_prob:.3g}); request latency "
        f"p50 {ms(stats['request_latency_p50_s'])}, p99 {ms(stats['request_latency_p99_s'])}; "
        f"engine TTFT p50 {ms(stats['engine_ttft_p50_s'])}, p99 {ms(stats['engine_ttft_p99_s'])}; "
        f"ITL p50 {ms(stats['engine_itl_p50_s'])}, p99 {ms(stats['engine_itl_p99_s'])}; start-up "
        f"{served['startup_seconds']:.1f} s; shutdown {shutdown}"
    )
    for problem in problems:
        print("PROBLEM: " + problem)
    print("PASSED" if not problems else "FAILED")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
