#!/usr/bin/env python
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Functional case: dynamic inference with static active slices off and on.

A small GPT (megatron-core's local layer spec, no Transformer Engine) generates greedily for a few
hundred requests of mixed prompt and output lengths through megatron-core's real
``DynamicInferenceEngine``, once with megatron_ext's static active slices off and once on (via
``megatron_ext.inference.enable_static_active_slices``; the engine set-up is otherwise identical
and builds megatron-core's class names). The KV buffer is small, so requests pause, resume and
get evicted. Both runs must produce bit-identical tokens and log-probs.

megatron-core's dynamic-batching attention needs flash-attn, which this environment may not
have. The model therefore uses ``TorchPagedSelfAttention`` (megatron_ext.testing.
torch_paged_attention): megatron-core's ``SelfAttention`` with ``flash_decode_and_prefill``
overridden by a plain-torch paged-KV attention (fixed shapes, graph-capturable). Both runs use
it, so the comparison isolates the extension.

Standalone::

    python tests/functional_tests/test_cases/gpt/inference_static_active_slices/run_case.py \\
        --out DIR                  # writes DIR/metrics.json; exit status 1 on any mismatch

Through the functional-test runner (model_config.yaml in this directory), which passes
``--output-json PATH``. ``--device cpu`` runs a small smoke version without a GPU.
"""

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

# Deterministic cuBLAS workspaces; must be set before CUDA initialises.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

REPO_ROOT = Path(__file__).resolve().parents[5]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Command line; defaults are the case's configuration."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="directory for metrics.json")
    p.add_argument("--output-json", type=Path, default=None, help="result file (runner format)")
    p.add_argument("--modes", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="a few requests (smoke run)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--num-requests", type=int, default=320)
    p.add_argument("--prompt-length", type=int, nargs=2, default=[4, 200], metavar=("MIN", "MAX"))
    p.add_argument("--generate-length", type=int, nargs=2, default=[1, 64], metavar=("MIN", "MAX"))
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--num-query-groups", type=int, default=4)
    p.add_argument("--ffn-hidden-size", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--max-sequence-length", type=int, default=512)
    p.add_argument("--max-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--block-size-tokens", type=int, default=16)
    p.add_argument("--kv-blocks", type=int, default=240, help="KV blocks (small: forces pausing)")
    p.add_argument("--paused-kv-blocks", type=int, default=48)
    p.add_argument(
        "--megatron-training-parser",
        action="store_true",
        help="take the model sizes and --inference-static-active-slices from megatron.training's "
        "parser extended with add_megatron_ext_args, and apply them with apply_megatron_ext, as a "
        "Megatron-LM inference script does",
    )
    args = p.parse_args(argv)
    if args.out is None and args.output_json is None:
        p.error("give --out DIR or --output-json PATH")
    if args.quick:
        args.num_requests = min(args.num_requests, 24)
        args.generate_length = [1, 16]
    return args


def make_requests(args: argparse.Namespace, vocab_size: int) -> List[Tuple[List[int], Any]]:
    """Mixed prompt and output lengths, greedy, with log-probs; end of document = vocab - 1."""
    from megatron.core.inference.sampling_params import SamplingParams

    rng = random.Random(args.seed)
    requests = []
    for _ in range(args.num_requests):
        prompt = [rng.randrange(vocab_size - 1) for _ in range(rng.randint(*args.prompt_length))]
        params = SamplingParams(
            num_tokens_to_generate=rng.randint(*args.generate_length),
            termination_id=vocab_size - 1,
            top_k=1,
            return_log_probs=True,
            skip_prompt_log_probs=True,
        )
        requests.append((prompt, params))
    return requests


def megatron_training_args(args: argparse.Namespace, mode: str) -> argparse.Namespace:
    """The case's model sizes and the flag (``mode`` "on"), parsed by megatron.training's parser
    extended with ``add_megatron_ext_args``."""
    from megatron.training.arguments import parse_args as parse_megatron_args

    from megatron_ext.arguments import add_megatron_ext_args

    argv = [
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.num_attention_heads), "--group-query-attention",
        "--num-query-groups", str(args.num_query_groups), "--ffn-hidden-size",
        str(args.ffn_hidden_size), "--vocab-size", str(args.vocab_size),
        "--max-position-embeddings", str(args.max_sequence_length), "--seq-length",
        str(args.max_sequence_length), "--seed", str(args.seed), "--tokenizer-type",
        "NullTokenizer", "--bf16",
    ]  # fmt: skip
    if mode == "on":
        argv.append("--inference-static-active-slices")
    saved, sys.argv = sys.argv, [sys.argv[0], *argv]
    try:
        parsed = parse_megatron_args(extra_args_provider=add_megatron_ext_args)
    finally:
        sys.argv = saved
    sizes = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "vocab_size")
    for name in sizes:
        if getattr(parsed, name) != getattr(args, name):
            raise RuntimeError(f"megatron.training parsed {name}={getattr(parsed, name)!r}")
    return parsed


def run_mode(mode: str, model, args: argparse.Namespace, dtype: torch.dtype, requests):
    """Generate every request with the extension ``mode`` ("off"/"on")."""
    import megatron_ext.inference as ext_inference
    from megatron_ext import apply_megatron_ext, undo_megatron_ext
    from megatron_ext.inference.contexts.dynamic_context import StaticSlicesInferenceContext
    from megatron_ext.inference.text_generation_controllers.text_generation_controller import (
        StaticSlicesTextGenerationController,
    )
    from megatron_ext.testing.small_gpt import build_small_gpt_engine
    from megatron_ext.testing.synthetic import run_engine
    from megatron_ext.testing.torch_paged_attention import (
        allow_dynamic_inference_without_flash_attn,
    )

    if args.megatron_training_parser:
        apply_megatron_ext(megatron_training_args(args, mode))
    elif mode == "on":
        ext_inference.enable_static_active_slices()
    try:
        engine, context, controller = build_small_gpt_engine(model, args, dtype)
    finally:
        undo_megatron_ext()
    extended = isinstance(context, StaticSlicesInferenceContext) and isinstance(
        controller, StaticSlicesTextGenerationController
    )
    if extended != (mode == "on"):
        raise RuntimeError(
            f"mode {mode!r} built {type(context).__name__} and " f"{type(controller).__name__}"
        )
    start = time.perf_counter()
    with allow_dynamic_inference_without_flash_attn():
        outputs, stats = run_engine(engine, requests)
    if args.device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    run: Dict[str, Any] = {"mode": mode}
    run["generated tokens"] = [t for i in sorted(outputs) for t in outputs[i]["generated_tokens"]]
    run["generated log probs"] = [
        float(lp) for i in sorted(outputs) for lp in outputs[i]["generated_log_probs"]
    ]
    run["generated lengths"] = [len(outputs[i]["generated_tokens"]) for i in sorted(outputs)]
    run.update(
        finished_requests=len(outputs),
        engine_steps=stats["steps"],
        max_paused=stats["max_paused"],
        evicted=stats["evicted"],
        seconds=elapsed,
        context_class=type(context).__name__,
        controller_class=type(controller).__name__,
    )
    if extended:
        run["sampling_cuda_graphs"] = len(controller._graphs)
    return run


def main(argv: Optional[List[str]] = None) -> int:
    """Run the case; 0 when every mode generated the same output, else 1."""
    args = parse_args(argv)
    from megatron_ext.testing.small_gpt import build_small_gpt
    from megatron_ext.testing.synthetic import cpu_torch_compat, ensure_model_parallel

    if args.device == "cuda" and not torch.cuda.is_available():
        print("run_case: --device cuda but no CUDA GPU is visible", file=sys.stderr)
        return 1
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with cpu_torch_compat():
        if args.device == "cpu":
            # The context's fused KV append is a Triton GPU kernel; megatron-core falls back to
            # indexing when it is absent.
            from megatron.core.inference.contexts import dynamic_context as mcore_context

            mcore_context.triton_append_key_value_cache = None
        ensure_model_parallel()
        from megatron_ext.testing.environment import run_environment

        model, _ = build_small_gpt(args, dtype)
        requests = make_requests(args, args.vocab_size)
        runs = [run_mode(mode, model, args, dtype, requests) for mode in args.modes]

    problems: List[str] = []
    for run in runs[1:]:
        for key in ("generated tokens", "generated log probs", "generated lengths"):
            if run[key] != runs[0][key]:
                first = next(
                    (i for i, (a, b) in enumerate(zip(run[key], runs[0][key])) if a != b),
                    min(len(run[key]), len(runs[0][key])),
                )
                problems.append(
                    f"{key!r} differ between {runs[0]['mode']!r} and "
                    f"{run['mode']!r}, first at index {first}"
                )
    for run in runs:
        if run["finished_requests"] != len(requests):
            problems.append(f"{run['mode']}: {run['finished_requests']}/{len(requests)} finished")
    if not args.quick and not any(run["max_paused"] > 0 for run in runs):
        problems.append("no request was ever paused: the KV buffer is too large for this case")

    result = {
        "runs": runs,
        "environment": run_environment(),
        "requests": len(requests),
        "identical": not problems,
        "problems": problems,
    }
    for path in filter(None, [args.output_json, args.out and args.out / "metrics.json"]):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
    for run in runs:
        print(
            f"[{run['mode']}] {run['context_class']}/{run['controller_class']}: "
            f"{run['finished_requests']} requests, {len(run['generated tokens'])} tokens, "
            f"{run['engine_steps']} steps, max paused {run['max_paused']}, evicted "
            f"{run['evicted']}, {run['seconds']:.1f} s"
            + (
                f", {run['sampling_cuda_graphs']} sampling graphs"
                if "sampling_cuda_graphs" in run
                else ""
            )
        )
    for problem in problems:
        print("MISMATCH: " + problem)
    print("PASSED: identical tokens and log-probs" if not problems else "FAILED")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
