# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Static-batching MLA generation, flag off (megatron-core's unfused RoPE) against on.

A section of ``python -m megatron_ext.bench inference``: a small MLA GPT
(:mod:`megatron_ext.testing.small_mla_gpt`) generates greedily through megatron-core's
``StaticInferenceContext``, both modes interleaved round by round on the same prompts. Reported
per batch size: prefill time and per-token decode time (wall time of each synchronised forward,
eager, as a user's generation loop sees it). Token agreement is the functional case's concern
(``gpt/mla_rope_contiguous_load_static_inference``): this untrained bf16 model's greedy choices
come within rounding of ties, so whether they agreed is kept in the JSON only.
"""

import statistics
from typing import Any, Dict, List, Sequence

import torch

__all__ = ["SIZES", "run_static_mla", "static_mla_table"]

# Four DeepSeek-V3-headed MLA layers (128 + 64 RoPE query/key head dims, 16 heads).
SIZES: Dict[str, Any] = dict(
    num_layers=4,
    hidden_size=1024,
    num_attention_heads=16,
    vocab_size=4096,
    max_sequence_length=1024,
    seed=1234,
)


def run_static_mla(
    batches: Sequence[int], prompt: int, new_tokens: int, rounds: int
) -> List[Dict[str, Any]]:
    """Time generation off and on, interleaved, per batch size.

    Args:
        batches: rows per generation.
        prompt: prompt tokens per row.
        new_tokens: generated tokens per row.
        rounds: interleaved off/on rounds (after one discarded warm-up generation per mode).

    Returns:
        list: one row per batch size and mode, with median prefill and decode times in ms.
    """
    from megatron_ext import undo_megatron_ext
    from megatron_ext.testing.small_mla_gpt import build_small_mla_gpt, greedy_generate, prompts_for
    from megatron_ext.testing.synthetic import ensure_model_parallel

    # The engine rows set this up when they run first; --static-mla-batches alone must too.
    ensure_model_parallel()

    # Built off, then on: the flag's patch stays applied, which the off model (fusion off, stock
    # MLA class) never reaches.
    try:
        models = {
            mode: build_small_mla_gpt(mode, dtype=torch.bfloat16, device="cuda", **SIZES)
            for mode in ("off", "on")
        }
        rows = []
        for batch in batches:
            prompts = prompts_for(batch, prompt, SIZES["vocab_size"], batch, "cuda")
            timings: Dict[str, Dict[str, List[float]]] = {
                mode: {"prefill": [], "decode": []} for mode in models
            }
            tokens = {}
            for round_ in range(rounds + 1):
                for mode, model in models.items():
                    generation = greedy_generate(model, prompts, new_tokens)
                    tokens[mode] = generation.tokens
                    if round_:
                        timings[mode]["prefill"].append(generation.prefill_seconds * 1e3)
                        timings[mode]["decode"].append(
                            statistics.median(generation.decode_seconds) * 1e3
                        )
            same = bool(torch.equal(tokens["off"], tokens["on"]))
            for mode in models:
                rows.append(
                    {
                        "batch": batch,
                        "prompt": prompt,
                        "new_tokens": new_tokens,
                        "mode": mode,
                        "prefill_ms": statistics.median(timings[mode]["prefill"]),
                        "decode_ms_per_token": statistics.median(timings[mode]["decode"]),
                        "decode_ms_rounds": timings[mode]["decode"],
                        "tokens_equal_off_on": same,
                    }
                )
    finally:
        undo_megatron_ext()
    return rows


def static_mla_table(rows: List[Dict[str, Any]]) -> str:
    """A markdown table of :func:`run_static_mla`'s rows, off and on side by side.

    Args:
        rows: the rows.

    Returns:
        str: the table.
    """
    lines = [
        "| batch | prompt + new | prefill ms off / on | prefill speedup | decode ms per token "
        "off / on | decode speedup |",
        "|---|---|---|---|---|---|",
    ]
    by_key = {(r["batch"], r["mode"]): r for r in rows}
    for batch in sorted({r["batch"] for r in rows}):
        off, on = by_key[(batch, "off")], by_key[(batch, "on")]
        lines.append(
            f"| {batch} | {off['prompt']} + {off['new_tokens']} | {off['prefill_ms']:.2f} / "
            f"{on['prefill_ms']:.2f} | {off['prefill_ms'] / on['prefill_ms']:.2f}x | "
            f"{off['decode_ms_per_token']:.3f} / {on['decode_ms_per_token']:.3f} | "
            f"{off['decode_ms_per_token'] / on['decode_ms_per_token']:.2f}x |"
        )
    return "\n".join(lines)
