#!/usr/bin/env python
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Functional case: greedy MLA generation under static batching, RoPE flag off and on.

A small MLA GPT (megatron-core's local spec, yarn RoPE, megatron_ext's SDPA core attention)
generates greedily for a fixed prompt set through megatron-core's ``StaticInferenceContext``:
once with ``apply_rope_fusion=False`` (megatron-core refuses fused MLA RoPE under an inference
context, so that is what its users generate with) and once with ``--mla-rope-contiguous-load``
(fused RoPE, megatron_ext's kernels, positions from the context's sequence offset). Each mode's
logits are compared with a float64 copy of the model teacher-forced on that mode's own tokens.

* float32 parameters: the tokens of the two modes must be identical (they are the golden values),
  and every logit within 2^-10 of the largest logit magnitude of the float64 reference.
* bfloat16 parameters (GPU): every logit within 2^-4 of that magnitude, and the flag's error at
  most 1.25x megatron-core's unfused path's plus 2^-8 of it. The tokens are compared and reported,
  not required equal: an untrained model's greedy choices come within bf16 rounding of a tie (the
  report gives the smallest top-2 margin of the reference against the largest error).

A wrong position (a decode step rotated as position 0, say) moves the logits by whole units.

Standalone::

    python tests/functional_tests/test_cases/gpt/mla_rope_contiguous_load_static_inference/\\
        run_case.py --out DIR        # writes DIR/metrics.json; exit status 1 on any failure

``--device cpu`` runs a small float32 version under the Triton interpreter.
"""

import argparse
import json
import os
import sys
from pathlib import Path
from typing import List, Optional

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
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-length", type=int, default=48)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--max-sequence-length", type=int, default=128)
    p.add_argument(
        "--init-method-std",
        type=float,
        default=0.1,
        help="weight init std; larger than training's 0.02 so that an untrained model's logits "
        "are not all near-ties",
    )
    return p.parse_args(argv)


def run_dtype(args: argparse.Namespace, dtype: torch.dtype, sizes: dict) -> dict:
    """Generate in both modes with ``dtype`` parameters and compare with float64 references."""
    from megatron_ext.testing import small_mla_gpt

    prompts = small_mla_gpt.prompts_for(
        args.batch, args.prompt_length, args.vocab_size, args.seed, args.device
    )
    generations, references = {}, {}
    for mode in small_mla_gpt.MODES:
        model = small_mla_gpt.build_small_mla_gpt(mode, dtype=dtype, **sizes)
        generations[mode] = small_mla_gpt.greedy_generate(model, prompts, args.new_tokens)
        reference = small_mla_gpt.float64_copy(model, **sizes)
        references[mode] = small_mla_gpt.float64_step_logits(
            reference, generations[mode].tokens, args.prompt_length
        )
    summary = small_mla_gpt.summarise(generations, references)
    summary["tokens"] = {
        mode: g.tokens[:, args.prompt_length :].flatten().tolist()
        for mode, g in generations.items()
    }
    return summary


def main(argv: Optional[List[str]] = None) -> int:
    """Run the case; 0 when every check passed, else 1."""
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("run_case: --device cuda but no CUDA GPU is visible", file=sys.stderr)
        return 1
    from megatron_ext.testing.environment import run_environment
    from megatron_ext.testing.synthetic import cpu_torch_compat, ensure_model_parallel

    sizes = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_sequence_length,
        init_method_std=args.init_method_std,
        seed=args.seed,
        device=args.device,
    )
    dtypes = {"fp32": torch.float32}
    if args.device == "cuda":
        dtypes["bf16"] = torch.bfloat16
    with cpu_torch_compat():
        ensure_model_parallel()
        results = {name: run_dtype(args, dtype, sizes) for name, dtype in dtypes.items()}

    problems = []
    for name, summary in results.items():
        scale, errors = summary["largest_abs_logit"], summary["max_abs_logit_error"]
        bound = scale / (1024 if name == "fp32" else 16)
        for mode, error in errors.items():
            if error > bound:
                problems.append(f"{name} {mode}: logits {error:.4g} off float64 (> {bound:.4g})")
        if name == "fp32" and not summary["tokens_equal"]:
            problems.append("fp32: generated tokens differ between off and on")
        if name == "bf16" and errors["on"] > 1.25 * errors["off"] + scale / 256:
            problems.append(
                f"bf16: the flag's logit error {errors['on']:.4g} exceeds 1.25x the unfused "
                f"path's {errors['off']:.4g} + {scale / 256:.4g}"
            )
    runs = [
        {"mode": mode, "generated tokens": tokens}
        for mode, tokens in results["fp32"].pop("tokens").items()
    ]
    result = {
        "runs": runs,
        "environment": run_environment(),
        "checks": results,
        "problems": problems,
    }
    for path in filter(None, [args.output_json, args.out and args.out / "metrics.json"]):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
    for name, summary in results.items():
        errors = summary["max_abs_logit_error"]
        print(
            f"static MLA generation, {name}, {args.batch} x ({args.prompt_length} + "
            f"{args.new_tokens}) tokens: tokens off/on "
            f"{'identical' if summary['tokens_equal'] else 'differ'}; max |logit - float64| off "
            f"{errors['off']:.3g}, on {errors['on']:.3g} (largest |logit| "
            f"{summary['largest_abs_logit']:.3g}, smallest top-2 margin "
            f"{summary['min_top2_margin']:.3g})"
        )
    for problem in problems:
        print(f"FAIL: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
