# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The roofline of one decode step of the MLA engine benchmark's models
(:mod:`megatron_ext.bench.mla_engine`): the bytes the step must move and the FLOPs it must do,
and the time the device's measured copy bandwidth and matmul rate bound it to.

The model (a lower bound: the least a step served from megatron_ext's latent cache moves and
computes), for ``B`` requests attending to ``L_b`` cache rows each (the new token's included),
``H`` heads, hidden ``h``, query and latent ranks ``q`` and ``c``, head widths ``d`` (qk),
``r`` (RoPE) and ``v``, MLP width ``f`` (4 h) and vocabulary ``V``, per layer:

* GEMMs (``in x out``, 2 in out FLOPs per token): ``q_down h x q``, ``q_up q x H(d + r)``,
  ``kv_down h x (c + r)``, the absorbed key up-projection ``H d x H c`` (per head ``d x c``),
  the absorbed value up-projection (per head ``c x v``), ``proj H v x h``, ``fc1 h x f``,
  ``fc2 f x h``; once per step the output layer ``h x V``.
* Weights: every weight element read once per step (the GEMMs', the absorbed projections being
  ``kv_up``'s ``c x H(d + v)`` read once, the norms' ``h``, ``q`` and ``c``), the final norm, the
  output layer, and ``B`` embedding rows.
* Cache: each request's ``L_b`` latent rows of ``c + r`` elements read once per head-tile pass,
  ``ceil(H / tile)`` passes (:func:`megatron_ext.fusions.mla_latent.tile_rules.head_tile`:
  each program of the attention kernel reads the rows for its tile of heads), and the new row
  written.
* Activations: each GEMM's input read and output written once per token, the attention's
  ``H (c + r)`` query read and ``H c`` output written; the logits written. Norms, RoPE, residual
  adds and the copies between layouts (a fused step does without them) are left out.
* Attention FLOPs: ``sum_b L_b H 2 (2 c + r)`` per layer (scores over ``c + r``, values over
  ``c``).

The bound is ``max(bytes / copy bandwidth, FLOPs / matmul rate)``, with the copy bandwidth of a
large device-to-device copy (read + write bytes, :func:`megatron_ext.bench.rope._copy_ceiling`)
and the rate of a large bf16 ``torch.mm`` (:func:`matmul_peak`), both measured in the same run;
the achieved fraction is the bound over the measured step time.
"""

import math
from typing import Any, Dict, Optional, Sequence

__all__ = ["decode_step_cost", "device_ceilings", "matmul_peak", "roofline"]


def _head_tile(heads: int, itemsize: int) -> int:
    from megatron_ext.fusions.mla_latent.tile_rules import head_tile

    return head_tile(heads, decode=True, fp32=itemsize == 4)


def decode_step_cost(
    sizes: Dict[str, Any],
    context_lengths: Sequence[int],
    itemsize: int = 2,
    head_tile: Optional[int] = None,
) -> Dict[str, float]:
    """Bytes and FLOPs of one decode step (the model of the module docstring).

    Args:
        sizes: an :data:`~megatron_ext.bench.mla_engine.ENGINE_MODELS` entry (``q_lora_rank``
            and ``kv_lora_rank`` default as :func:`~megatron_ext.testing.small_mla_gpt.
            build_small_mla_gpt`'s: ``hidden // 2`` and ``hidden // 4``).
        context_lengths: per request of the step, the cache rows it attends to.
        itemsize: bytes per element of weights, cache and activations.
        head_tile: heads per attention program (None: the kernel's decode tile).

    Returns:
        Dict[str, float]: ``weight_bytes``, ``cache_bytes``, ``activation_bytes``, ``bytes``
        (their sum), ``gemm_flops``, ``attention_flops``, ``flops`` (their sum) and
        ``head_passes``.

    Raises:
        ValueError: without requests, or with a context length below 1.
    """
    if not context_lengths or min(context_lengths) < 1:
        raise ValueError(f"a decode step needs requests with context >= 1, got {context_lengths}")
    h, heads, layers = sizes["hidden_size"], sizes["num_attention_heads"], sizes["num_layers"]
    q = sizes.get("q_lora_rank") or h // 2
    c = sizes.get("kv_lora_rank") or h // 4
    d, r, v = sizes["qk_head_dim"], sizes["qk_pos_emb_head_dim"], sizes["v_head_dim"]
    f, vocab = sizes.get("ffn_hidden_size") or 4 * h, sizes["vocab_size"]
    batch, rows = len(context_lengths), sum(context_lengths)
    tile = head_tile or _head_tile(heads, itemsize)
    passes = math.ceil(heads / tile)
    # (in, out) per token of each GEMM of a layer; the absorbed projections per head.
    gemms = [
        (h, q),
        (q, heads * (d + r)),
        (h, c + r),
        (heads * d, heads * c),
        (heads * c, heads * v),
        (heads * v, h),
        (h, f),
        (f, h),
    ]
    per_head = heads * d * c + heads * c * v  # the absorbed GEMMs' multiply-adds per token
    gemm_macs = sum(i * o for i, o in gemms[:3] + gemms[5:]) + per_head
    weights = (
        h * q
        + q
        + q * heads * (d + r)  # input norm's h below; q_down, q norm, q_up
        + h * (c + r)
        + c
        + c * heads * (d + v)  # kv_down, kv norm, kv_up
        + heads * v * h
        + h * f
        + f * h
        + 2 * h  # proj, fc1, fc2, the two norms
    )
    activations = sum(i + o for i, o in gemms) + heads * (c + r) + heads * c
    cache_rows = rows * passes + batch  # read once per head-tile pass; the new rows written
    weight_bytes = (layers * weights + h + h * vocab + batch * h) * itemsize
    cache_bytes = layers * cache_rows * (c + r) * itemsize
    activation_bytes = (layers * activations + h + vocab) * batch * itemsize
    gemm_flops = 2 * batch * (layers * gemm_macs + h * vocab)
    attention_flops = 2 * layers * rows * heads * (2 * c + r)
    return {
        "weight_bytes": float(weight_bytes),
        "cache_bytes": float(cache_bytes),
        "activation_bytes": float(activation_bytes),
        "bytes": float(weight_bytes + cache_bytes + activation_bytes),
        "gemm_flops": float(gemm_flops),
        "attention_flops": float(attention_flops),
        "flops": float(gemm_flops + attention_flops),
        "head_passes": float(passes),
    }


def roofline(
    cost: Dict[str, float],
    step_seconds: float,
    copy_bytes_per_s: float,
    matmul_flops_per_s: float,
) -> Dict[str, Any]:
    """The bound of a step and how close the measured step comes to it.

    Args:
        cost: :func:`decode_step_cost`'s result.
        step_seconds: the measured step time.
        copy_bytes_per_s: measured copy bandwidth (read + write bytes per second).
        matmul_flops_per_s: measured matmul rate.

    Returns:
        Dict[str, Any]: ``bytes``, ``flops``, ``memory_ms``, ``compute_ms``, ``bound_ms`` (the
        larger), ``bound_by`` (``"memory"`` or ``"compute"``) and ``achieved`` (bound over the
        step time).

    Raises:
        ValueError: if a time or rate is not positive.
    """
    if min(step_seconds, copy_bytes_per_s, matmul_flops_per_s) <= 0:
        raise ValueError("step time and rates must be positive")
    memory = cost["bytes"] / copy_bytes_per_s
    compute = cost["flops"] / matmul_flops_per_s
    bound = max(memory, compute)
    return {
        "bytes": cost["bytes"],
        "flops": cost["flops"],
        "memory_ms": memory * 1e3,
        "compute_ms": compute * 1e3,
        "bound_ms": bound * 1e3,
        "bound_by": "memory" if memory >= compute else "compute",
        "achieved": bound / step_seconds,
    }


def matmul_peak(quick: bool, n: int = 8192) -> Dict[str, float]:
    """The rate of a large bf16 ``torch.mm`` (``n x n`` by ``n x n``), timed as the copy ceiling
    is (Triton's ``do_bench``, median). GPU only.

    Args:
        quick: fewer repetitions.
        n: the matrices' side.

    Returns:
        Dict[str, float]: ``flops``, ``us`` and ``tflops``.
    """
    import torch

    from megatron_ext.bench.rope import _do_bench_us

    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(a)
    us = _do_bench_us(lambda: torch.mm(a, b, out=out), quick)
    flops = 2.0 * n**3
    return {"flops": flops, "us": us, "tflops": flops / us / 1e6}


def device_ceilings(quick: bool) -> Dict[str, Dict[str, float]]:
    """The copy bandwidth and matmul rate of this run's device. GPU only.

    Args:
        quick: fewer repetitions.

    Returns:
        Dict[str, Dict[str, float]]: ``copy`` (``bytes``, ``us``, ``tb_per_s``) and ``matmul``
        (``flops``, ``us``, ``tflops``).
    """
    from megatron_ext.bench.rope import _copy_ceiling

    return {"copy": _copy_ceiling(quick), "matmul": matmul_peak(quick)}
