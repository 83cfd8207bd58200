#!/usr/bin/env python
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Functional case: an MLA GPT served by megatron-core's DynamicInferenceEngine.

A small MLA GPT with DeepSeek-V3's widths (512-wide latent, 64-wide RoPE, 128 + 64 query/key
heads, yarn RoPE) generates greedily for a few dozen requests of mixed prompt and output lengths
through megatron-core's real ``DynamicInferenceEngine`` and ``GPTInferenceWrapper``, with
``--mla-rope-contiguous-load`` and ``--inference-static-active-slices`` applied (the one
documented way; ``cache_mla_latents`` in the model config). The latent cache is small, so
requests pause, resume and get evicted; prompts longer than the step budget are prefilled in
chunks. Layers use megatron-core's local spec with megatron_ext's SDPA core attention: no
Transformer Engine, FlashMLA or flash-attn.

There is no "off" run: megatron-core's own MLA cannot run a dynamic-batching step on either
release (``tests/unit_tests/transformer/test_mla_dynamic_inference.py`` shows what it raises).
Instead each dtype's run is checked against a float64 copy of the model run teacher-forced over
each request's final tokens through megatron-core's training path: every generated log-prob
within twice the logit bound of the static-batching case (2^-10 of the largest float64 logit in
float32, 2^-4 in bfloat16), and every greedy token the float64 argmax (float32: all of them;
bfloat16: wherever the float64 top-2 margin exceeds twice that bound). The runner compares the
tokens and log-probs with the golden values bit for bit.

Standalone::

    python tests/functional_tests/test_cases/gpt/mla_dynamic_inference/run_case.py --out DIR

Through the functional-test runner (model_config.yaml in this directory), which passes
``--output-json PATH``. ``--device cpu --quick`` runs a small smoke version without a GPU
(Triton interpreter, small widths, float32 only).

Tensor parallelism (``--tensor-model-parallel-size N``, case ``gpt/mla_dynamic_inference_tp2``):
launched with ``torchrun --nproc-per-node=N`` (NCCL on GPUs, gloo with ``--device cpu``), the
same model, weights and requests are served at tensor-parallel size N, each rank's kernels taking
its ``heads / N`` query heads. megatron-core initialises every weight on the CPU as the full
matrix from the seeded generator and keeps each rank's slice, so every rank building the model
with the same seed holds slices of exactly the TP=1 model's weights; the run checks this bit for
bit against a TP=1 build. The TP=N run's tokens and log-probs are then checked (a) against the
float64 teacher-forced forward of the TP=1 model's (unsharded) weights, as above, and (b) against
the TP=1 engine run of the same weights and requests, which is not bitwise: the row-parallel
projections sum their ranks' partial outputs, each rounded to the dtype, in another order. Each
request's tokens must agree up to a first difference, allowed only in bfloat16 where the float64
top-2 margin is within the near-tie bound of the float64 check (float32: none); the log-probs of
the agreeing prefix must differ by at most twice the logit bound (what each run may be off
float64, not the four times the triangle inequality would allow, so that (b) is not implied by
(a)). Rank 0 writes the results; every rank's TP=N tokens must be equal.
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

if not torch.cuda.is_available():
    # Triton decides at import time whether its kernels run in the CPU interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Logit bounds relative to the largest float64 logit (those of the static-batching MLA case).
LOGIT_BOUND = {"float32": 2.0**-10, "bfloat16": 2.0**-4}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Command line; defaults are the case's configuration."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="directory for metrics.json")
    p.add_argument("--output-json", type=Path, default=None, help="result file (runner format)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="a few requests, small widths (smoke)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=list(DTYPES))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--prompt-length", type=int, nargs=2, default=[4, 160], metavar=("MIN", "MAX"))
    p.add_argument("--generate-length", type=int, nargs=2, default=[1, 48], metavar=("MIN", "MAX"))
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--qk-head-dim", type=int, default=128)
    p.add_argument("--qk-pos-emb-head-dim", type=int, default=64)
    p.add_argument("--v-head-dim", type=int, default=128)
    p.add_argument("--max-sequence-length", type=int, default=256)
    p.add_argument("--max-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128, help="step token budget (chunking)")
    p.add_argument("--block-size-tokens", type=int, default=16)
    p.add_argument("--kv-blocks", type=int, default=48, help="latent-cache blocks (small: pauses)")
    p.add_argument("--paused-kv-blocks", type=int, default=8)
    p.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="tensor-parallel size (> 1: launch with torchrun, one process per rank)",
    )
    args = p.parse_args(argv)
    if args.out is None and args.output_json is None:
        p.error("give --out DIR or --output-json PATH")
    if args.tensor_model_parallel_size < 1:
        p.error("--tensor-model-parallel-size must be positive")
    if args.quick:
        args.num_requests = min(args.num_requests, 6)
        args.generate_length = [1, 8]
        args.prompt_length = [4, 80]
        args.max_tokens = 64
        args.num_layers, args.hidden_size, args.vocab_size = 1, 64, 128
        args.kv_lora_rank, args.qk_head_dim, args.qk_pos_emb_head_dim, args.v_head_dim = (
            32,
            32,
            16,
            32,
        )
        args.kv_blocks, args.paused_kv_blocks, args.block_size_tokens = 32, 4, 8
    return args


def model_sizes(args: argparse.Namespace) -> Dict[str, Any]:
    """``build_small_mla_gpt``'s keywords for the case."""
    return dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_sequence_length,
        kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_head_dim,
        qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
        v_head_dim=args.v_head_dim,
        device=args.device,
        seed=args.seed,
    )


def make_requests(args: argparse.Namespace) -> List[Tuple[List[int], Any]]:
    """Mixed prompt and output lengths, greedy, with log-probs; no termination token."""
    from megatron.core.inference.sampling_params import SamplingParams

    rng = random.Random(args.seed)
    requests = []
    for _ in range(args.num_requests):
        prompt = [rng.randrange(args.vocab_size) for _ in range(rng.randint(*args.prompt_length))]
        params = SamplingParams(
            num_tokens_to_generate=rng.randint(*args.generate_length),
            termination_id=-1,
            top_k=1,
            return_log_probs=True,
            skip_prompt_log_probs=True,
        )
        requests.append((prompt, params))
    return requests


@torch.no_grad()
def tolerance_problems(
    dtype_name: str,
    worst: float,
    bound: float,
    differing: List[Tuple[int, int, float]],
    reference: str,
) -> List[str]:
    """The case's rule against a reference run: log-probs within twice the logit bound, and
    greedy tokens equal except, in bf16, at near-ties (float64 top-2 margin within four times it).

    Args:
        dtype_name: the run's dtype name.
        worst: the largest log-prob difference from the reference.
        bound: the logit bound (``LOGIT_BOUND`` times the largest logit).
        differing: (request, position, float64 top-2 margin) of each token unlike the reference's.
        reference: the reference's name, possessive ("float64's").

    Returns:
        List[str]: the problems, empty when within the rule.
    """
    problems = []
    if worst > 2 * bound:
        problems.append(
            f"{dtype_name}: log-probs {worst:.4g} off {reference} (> {2 * bound:.4g}, twice the "
            "logit bound)"
        )
    wide = [d for d in differing if dtype_name == "float32" or d[2] > 4 * bound]
    if wide:
        problems.append(
            f"{dtype_name}: greedy tokens differ from {reference} beyond a near-tie at (request, "
            f"position, top-2 margin) {wide[:5]}"
        )
    return problems


def float64_check(
    model: Any,
    args: argparse.Namespace,
    dtype_name: str,
    requests,
    outputs,
    margins_out: Optional[Dict[int, List[float]]] = None,
) -> Tuple[Dict[str, Any], List[str]]:
    """Every generated token and log-prob against the float64 teacher-forced forward.

    Args:
        model: the unsharded model whose weights the float64 copy takes.
        args: the case's arguments.
        dtype_name: the run's dtype.
        requests: prompts and sampling parameters, by request id.
        outputs: the run's generated tokens and log-probs, by request id.
        margins_out: if given, filled with each request's float64 top-2 margin at every
            generated position.

    Returns:
        Tuple[Dict[str, Any], List[str]]: the summary and the problems found.
    """
    from megatron_ext.testing import small_mla_gpt

    reference = small_mla_gpt.float64_copy(model, **model_sizes(args))
    device = next(reference.parameters()).device
    worst_lp, largest, mismatches = 0.0, 0.0, []
    margins = []
    for request_id in sorted(outputs):
        prompt = requests[request_id][0]
        generated = outputs[request_id]["generated_tokens"]
        tokens = torch.tensor(prompt + generated, device=device).unsqueeze(0)
        length = tokens.shape[1]
        positions = torch.arange(length, device=device).unsqueeze(0)
        causal = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
        logits = reference(tokens, positions, causal[None, None], runtime_gather_output=True)[0]
        rows = logits[len(prompt) - 1 : length - 1]
        largest = max(largest, float(rows.abs().max()))
        log_probs = torch.log_softmax(rows, dim=-1)
        chosen = torch.tensor(generated, device=device)
        expected = log_probs.gather(1, chosen[:, None])[:, 0]
        got = torch.tensor(outputs[request_id]["generated_log_probs"], dtype=torch.float64)
        worst_lp = max(worst_lp, float((got.to(device) - expected).abs().max()))
        top2 = rows.topk(2, dim=-1)
        margin = top2.values[:, 0] - top2.values[:, 1]
        margins.append(float(margin.min()))
        if margins_out is not None:
            margins_out[request_id] = margin.tolist()
        for i in torch.nonzero(top2.indices[:, 0] != chosen).flatten().tolist():
            mismatches.append((request_id, len(prompt) + i, float(margin[i])))
    bound = LOGIT_BOUND[dtype_name] * largest
    problems = tolerance_problems(dtype_name, worst_lp, bound, mismatches, "float64's")
    summary = dict(
        max_abs_log_prob_error=worst_lp,
        largest_abs_logit=largest,
        logit_bound=bound,
        min_top2_margin=min(margins),
        argmax_mismatches=len(mismatches),
    )
    return summary, problems


def run_dtype(
    dtype_name: str, args: argparse.Namespace, requests, tensor_parallel: int = 1
) -> Tuple[Dict[str, Any], Any]:
    """Generate every request with the model in ``dtype_name``.

    Args:
        dtype_name: the parameter dtype.
        args: the case's arguments.
        requests: prompts and sampling parameters, by request id.
        tensor_parallel: the tensor-parallel size megatron-core's model-parallel state is
            initialised with (the model config must say the same).

    Returns:
        Tuple[Dict[str, Any], Any]: the run's series and counters, and (model, outputs).
    """
    from megatron_ext import apply_megatron_ext, undo_megatron_ext
    from megatron_ext.inference.contexts.dynamic_context import StaticSlicesInferenceContext
    from megatron_ext.testing import small_mla_gpt
    from megatron_ext.testing.mla_dynamic_engine import build_mla_dynamic_engine
    from megatron_ext.testing.synthetic import run_engine

    # TP=1 leaves the config as the single-GPU cases (and their golden values) have it.
    overrides = dict(tensor_model_parallel_size=tensor_parallel) if tensor_parallel > 1 else None
    model = small_mla_gpt.build_small_mla_gpt(
        "on",
        dtype=DTYPES[dtype_name],
        cache_mla_latents=True,
        config_overrides=overrides,
        **model_sizes(args),
    )
    apply_megatron_ext(
        mla_rope_contiguous_load=True, inference_static_active_slices=True, config=model.config
    )
    try:
        engine, context, _ = build_mla_dynamic_engine(
            model,
            max_requests=args.max_requests,
            max_tokens=args.max_tokens,
            max_sequence_length=args.max_sequence_length,
            block_size_tokens=args.block_size_tokens,
            kv_blocks=args.kv_blocks,
            paused_kv_blocks=args.paused_kv_blocks,
            seed=args.seed,
            megatron_wrapper=True,
        )
        if not isinstance(context, StaticSlicesInferenceContext):
            raise RuntimeError(f"the flags built {type(context).__name__}")
        start = time.perf_counter()
        outputs, stats = run_engine(engine, requests)
        if args.device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    finally:
        undo_megatron_ext()
    run: Dict[str, Any] = {"mode": dtype_name}
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
        block_size_tokens=context.block_size_tokens,
    )
    return run, (model, outputs)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the case; 0 when every check passed, else 1."""
    args = parse_args(argv)
    if args.tensor_model_parallel_size > 1:
        return main_tensor_parallel(args)
    from megatron_ext.testing.synthetic import cpu_torch_compat, ensure_model_parallel

    if not device_ready(args):
        return 1
    runs, problems = [], []
    requests = None
    with cpu_torch_compat():
        ensure_model_parallel()
        requests = make_requests(args)
        for dtype_name in args.dtypes:
            run, (model, outputs) = run_dtype(dtype_name, args, requests)
            summary, found = float64_check(model, args, dtype_name, requests, outputs)
            run["float64"] = summary
            problems += found
            runs.append(run)
    problems += run_problems(args, runs, requests)
    write_results(args, runs, requests, problems)
    return report(runs, problems)


def device_ready(args: argparse.Namespace) -> bool:
    """Whether ``--device`` can run; on the CPU, drops bfloat16 from ``args.dtypes``.

    Args:
        args: the case's arguments (``dtypes`` may be changed).

    Returns:
        bool: False (after saying why) when ``--device cuda`` has no GPU.
    """
    if args.device == "cuda" and not torch.cuda.is_available():
        print("run_case: --device cuda but no CUDA GPU is visible", file=sys.stderr)
        return False
    if args.device == "cpu" and "bfloat16" in args.dtypes:
        # The Triton interpreter does not compute in bfloat16.
        args.dtypes = [d for d in args.dtypes if d != "bfloat16"] or ["float32"]
    return True


def run_problems(args: argparse.Namespace, runs: List[Dict[str, Any]], requests) -> List[str]:
    """What the runs must have exercised: every request finished, eviction (full size), and
    chunked prefill.

    Args:
        args: the case's arguments.
        runs: the runs.
        requests: prompts and sampling parameters, by request id.

    Returns:
        List[str]: the problems found.
    """
    problems = []
    for run in runs:
        if run["finished_requests"] != len(requests):
            problems.append(f"{run['mode']}: {run['finished_requests']}/{len(requests)} finished")
        if not args.quick and run["evicted"] == 0:
            problems.append(f"{run['mode']}: no request was evicted: the latent cache is too large")
    if not any(len(p) > args.max_tokens for p, _ in requests):
        problems.append("no prompt exceeds the step budget: no chunked prefill")
    return problems


def write_results(
    args: argparse.Namespace, runs: List[Dict[str, Any]], requests, problems: List[str]
) -> None:
    """Write the result file(s) the runner and ``--out`` ask for.

    Args:
        args: the case's arguments.
        runs: the runs.
        requests: prompts and sampling parameters, by request id.
        problems: the problems found.
    """
    from megatron_ext.testing.environment import run_environment

    result = {
        "runs": runs,
        "environment": run_environment(),
        "requests": len(requests),
        "problems": problems,
    }
    for path in filter(None, [args.output_json, args.out and args.out / "metrics.json"]):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")


def report(runs: List[Dict[str, Any]], problems: List[str]) -> int:
    """Print each run's summary and the problems.

    Args:
        runs: the runs.
        problems: the problems found.

    Returns:
        int: 0 when there are none, else 1.
    """
    for run in runs:
        check = run["float64"]
        print(
            f"[{run['mode']}] {run['context_class']} (block size {run['block_size_tokens']}): "
            f"{run['finished_requests']} requests, {len(run['generated tokens'])} tokens, "
            f"{run['engine_steps']} steps, max paused {run['max_paused']}, evicted "
            f"{run['evicted']}, {run['seconds']:.1f} s; float64: log-prob error "
            f"{check['max_abs_log_prob_error']:.3g} (bound {2 * check['logit_bound']:.3g}), "
            f"{check['argmax_mismatches']} argmax differences, smallest top-2 margin "
            f"{check['min_top2_margin']:.3g}"
        )
        tp1 = run.get("tensor_parallel_1")
        if tp1:
            print(
                f"[{run['mode']}] vs TP=1: {tp1['tokens_compared']}/{tp1['tokens']} tokens "
                f"agree before any difference, {len(tp1['diverged'])} requests diverge, "
                f"log-prob difference {tp1['max_abs_log_prob_difference']:.3g} (bound "
                f"{tp1['log_prob_bound']:.3g}); TP=1 float64 log-prob error "
                f"{tp1['float64']['max_abs_log_prob_error']:.3g}"
            )
    for problem in problems:
        print("PROBLEM: " + problem)
    print("PASSED" if not problems else "FAILED")
    return 0 if not problems else 1


# ----------------------------------------------------------------------------------------------
# Tensor parallelism (--tensor-model-parallel-size > 1, one process per rank under torchrun)


def init_distributed(args: argparse.Namespace) -> Tuple[int, int]:
    """``torch.distributed`` from torchrun's environment, one tensor-parallel rank per process.

    Args:
        args: the case's arguments.

    Returns:
        Tuple[int, int]: this process's rank and the world size.

    Raises:
        RuntimeError: unless the world is exactly one tensor-parallel group.
    """
    size = args.tensor_model_parallel_size
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != size:
        raise RuntimeError(
            f"--tensor-model-parallel-size {size} runs as {size} processes (torchrun "
            f"--nproc-per-node={size}); WORLD_SIZE is {world}"
        )
    rank = int(os.environ["RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    # NCCL for GPU tensors; gloo where megatron-core's collectives see CPU tensors.
    torch.distributed.init_process_group("nccl" if args.device == "cuda" else "gloo")
    return rank, world


def set_tensor_parallel(size: int) -> None:
    """(Re)initialise megatron-core's model-parallel state at tensor-parallel size ``size``, the
    rest of the world data-parallel. Collective: every rank calls it.

    Args:
        size: the tensor-parallel size.
    """
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=size)


def parameter_shards(model: Any) -> Dict[str, Tuple[torch.Tensor, int, int]]:
    """Each parameter of a tensor-parallel model as this rank holds it.

    Args:
        model: the model.

    Returns:
        Dict[str, Tuple[torch.Tensor, int, int]]: name -> (a CPU copy, the dimension
        megatron-core split it along or -1 where every rank holds it whole, the split's stride).
    """
    shards = {}
    for name, param in model.named_parameters():
        split = bool(getattr(param, "tensor_model_parallel", False))
        shards[name] = (
            param.detach().cpu().clone(),
            int(param.partition_dim) if split else -1,
            int(getattr(param, "partition_stride", 1)),
        )
    return shards


def shard_problems(
    shards: Dict[str, Tuple[torch.Tensor, int, int]], full_model: Any, rank: int, size: int
) -> List[str]:
    """Whether each shard is bit for bit this rank's slice of the TP=1 model's parameter.

    Args:
        shards: from :func:`parameter_shards` of the tensor-parallel model.
        full_model: the same model built at tensor-parallel size 1.
        rank: this process's tensor-parallel rank.
        size: the tensor-parallel size.

    Returns:
        List[str]: the parameters that are not.
    """
    full = {name: p.detach().cpu() for name, p in full_model.named_parameters()}
    problems = []
    if set(shards) != set(full):
        problems.append(
            f"rank {rank}: parameters differ by name from the TP=1 model's: "
            f"{sorted(set(shards) ^ set(full))[:5]}"
        )
    for name, (shard, dim, stride) in shards.items():
        if name not in full:
            continue
        expected = full[name]
        if dim >= 0:
            # megatron-core's CPU initialisation: split into size * stride pieces, every size-th
            # from this rank's on.
            pieces = torch.split(expected, expected.shape[dim] // (size * stride), dim=dim)
            expected = torch.cat(pieces[rank::size], dim=dim)
        if shard.shape != expected.shape or not torch.equal(shard, expected):
            problems.append(f"rank {rank}: {name} is not its slice of the TP=1 weights")
    return problems


def tensor_parallel_check(
    dtype_name: str,
    requests,
    outputs: Dict[int, Dict[str, Any]],
    reference_outputs: Dict[int, Dict[str, Any]],
    margins: Dict[int, List[float]],
    bound: float,
) -> Tuple[Dict[str, Any], List[str]]:
    """The tensor-parallel run against the TP=1 run of the same weights and requests.

    Bitwise equality is not expected (the row-parallel projections sum rounded partial outputs
    in another order), so per request the tokens must agree up to a first difference, which
    is allowed only in bfloat16 at a float64 near-tie (top-2 margin at most twice the run's
    log-prob bound, as in :func:`float64_check`); after it the two runs continue from different
    tokens and are not compared. The log-probs of the agreeing tokens must differ by at most
    twice the logit bound.

    Args:
        dtype_name: the runs' dtype.
        requests: prompts and sampling parameters, by request id.
        outputs: the tensor-parallel run's, by request id.
        reference_outputs: the TP=1 run's, by request id.
        margins: the float64 top-2 margin at each generated position of ``outputs`` (at a first
            difference both runs share the context, so it is both runs' margin).
        bound: the logit bound (relative bound times the largest float64 logit).

    Returns:
        Tuple[Dict[str, Any], List[str]]: the summary and the problems found.
    """
    worst, compared, total, diverged = 0.0, 0, 0, []
    for request_id in sorted(reference_outputs):
        if request_id not in outputs:
            continue  # reported as unfinished
        tokens = outputs[request_id]["generated_tokens"]
        reference = reference_outputs[request_id]["generated_tokens"]
        total += len(reference)
        agree = next(
            (i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b),
            min(len(tokens), len(reference)),
        )
        if agree:
            got = torch.tensor(outputs[request_id]["generated_log_probs"][:agree])
            want = torch.tensor(reference_outputs[request_id]["generated_log_probs"][:agree])
            worst = max(worst, float((got.double() - want.double()).abs().max()))
        compared += agree
        if agree < max(len(tokens), len(reference)):
            margin = margins[request_id][agree] if agree < len(margins[request_id]) else 0.0
            diverged.append((request_id, len(requests[request_id][0]) + agree, margin))
    problems = tolerance_problems(dtype_name, worst, bound, diverged, "the TP=1 run's")
    summary = dict(
        tokens=total,
        tokens_compared=compared,
        diverged=diverged,
        max_abs_log_prob_difference=worst,
        log_prob_bound=2 * bound,
    )
    return summary, problems


def main_tensor_parallel(args: argparse.Namespace) -> int:
    """Run the case at ``--tensor-model-parallel-size`` on every rank, then the same weights
    and requests at TP=1 (each rank alone) as the reference; rank 0 writes the results.

    Args:
        args: the case's arguments.

    Returns:
        int: 0 when every check passed on every rank, else 1 (the same on every rank).
    """
    from megatron_ext.testing.synthetic import cpu_torch_compat

    if not device_ready(args):
        return 1
    size = args.tensor_model_parallel_size
    rank, world = init_distributed(args)
    runs, problems = [], []
    with cpu_torch_compat():
        requests = make_requests(args)
        for dtype_name in args.dtypes:
            set_tensor_parallel(size)
            run, (model, outputs) = run_dtype(dtype_name, args, requests, tensor_parallel=size)
            shards = parameter_shards(model)
            del model
            # The reference: the TP=1 case's model and run (the same seed gives the same
            # weights, checked below), with the float64 copy built from its unsharded weights.
            set_tensor_parallel(1)
            reference_run, (reference, reference_outputs) = run_dtype(dtype_name, args, requests)
            problems += shard_problems(shards, reference, rank, size)
            margins: Dict[int, List[float]] = {}
            summary, found = float64_check(reference, args, dtype_name, requests, outputs, margins)
            run["float64"] = summary
            problems += found
            reference_summary, found = float64_check(
                reference, args, dtype_name, requests, reference_outputs
            )
            problems += [f"TP=1 {p}" for p in found]
            comparison, found = tensor_parallel_check(
                dtype_name, requests, outputs, reference_outputs, margins, summary["logit_bound"]
            )
            problems += found
            comparison.update(float64=reference_summary, seconds=reference_run["seconds"])
            run.update(
                mode=f"{dtype_name} tp{size}",
                tensor_model_parallel_size=size,
                sharded_parameters=sum(dim >= 0 for _, dim, _ in shards.values()),
                tensor_parallel_1=comparison,
            )
            runs.append(run)
        problems += run_problems(args, runs, requests)
        # Every rank samples from the same gathered logits: their tokens must be equal.
        everyone: List[Any] = [None] * world
        torch.distributed.all_gather_object(
            everyone, ([r["generated tokens"] for r in runs], problems)
        )
    # The same list on every rank, so that every rank exits with the same status.
    problems = []
    for other, (tokens, found) in enumerate(everyone):
        problems += [p for p in found if p not in problems]
        if tokens != everyone[0][0]:
            problems.append(f"rank {other}'s tokens differ from rank 0's")
    if rank == 0:
        write_results(args, runs, requests, problems)
        status = report(runs, problems)
    else:
        status = 0 if not problems else 1
    torch.distributed.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
