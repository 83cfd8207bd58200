# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The probe that picks the FMA pairing megatron-core's kernels have under the installed Triton.

Run once per (kernel kind, dtypes, device) at the first launch of that kind, outside CUDA-graph
capture: a small fixed input (random values with zeros of both signs among them, so that pairings
that differ only in a zero's sign are told apart) goes through megatron-core's kernel at
``BLOCK_H=1`` and through each candidate pairing of megatron_ext's kernel, and the first candidate
with the same bits wins. Why, and which candidates: :mod:`megatron_ext.fusions.mla_rope.pairing`.

The probe synchronises with the device (it compares on the host) and compiles megatron-core's kernel
once per kind and dtypes; both happen once per process.
"""

import contextlib
from typing import Callable, Dict, Optional

import torch

from megatron_ext import internals
from megatron_ext.fusions.mla_rope import checks, pairing
from megatron_ext.fusions.mla_rope.kernels import (
    mla_rope_q_bwd_kernel,
    mla_rope_q_fwd_kernel,
)
from megatron_ext.fusions.tensor_checks import INTERPRETED

# The probe's shape: sbhd, one sequence of ROWS tokens, HEADS heads (a 576-wide MLA query has
# 128; the pairing does not depend on the count), DeepSeek's 64 RoPE elements. Pairings can differ
# in few elements (fp16 input with fp32 tables: 16 x 2 heads told two apart on an H200 with Triton
# 3.9 where 64 x 3 x 4 did): 512 x 4 heads, 65536 rotated pairs per output. The interpreter (CPU
# tests only) gets fewer.
ROWS = 16 if INTERPRETED else 512
HEADS, NOPE, EMB = 4, 16, 64
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def pairing_for(
    kind: str, x_dtype: torch.dtype, table_dtype: torch.dtype, device: torch.device, inverse: bool
) -> pairing.Pairing:
    """The pairing a launch of ``kind`` uses (see :func:`megatron_ext.fusions.mla_rope.pairing.
    choose`); probes on first use where a probe can run.

    Args:
        kind: one of :data:`megatron_ext.fusions.mla_rope.pairing.KINDS`.
        x_dtype: dtype of the rotated input.
        table_dtype: dtype of cos/sin.
        device: the launch's device.
        inverse: the inverse rotation (fixed pairing, no megatron-core kernel to probe).

    Returns:
        Pairing: the pairing.
    """
    if inverse:
        return pairing.forced() or pairing.inverse_pairing(x_dtype, table_dtype, kind == "q_bwd")
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    runnable = device.type == "cuda" and not INTERPRETED and not capturing
    probe = _probe(kind, x_dtype, table_dtype, device) if runnable else None
    return pairing.choose(kind, x_dtype, table_dtype, device, probe, cacheable=not capturing)


def probe_pairing(
    kind: str, x_dtype: torch.dtype, table_dtype: torch.dtype, device: torch.device
) -> Optional[pairing.Pairing]:
    """Probe every candidate now (nothing cached); the first that matches megatron-core, or None.

    Args: as :func:`pairing_for`.

    Returns:
        Optional[Pairing]: the matching pairing, or None when no candidate matches.
    """
    probe = _probe(kind, x_dtype, table_dtype, device)
    return next((p for p in pairing.CANDIDATES[kind] if probe(p)), None)


def _probe(kind, x_dtype, table_dtype, device) -> Callable[[pairing.Pairing], bool]:
    """A function that runs one candidate and says whether its bits equal megatron-core's."""
    state: Dict[str, torch.Tensor] = {}

    def matches(candidate: pairing.Pairing) -> bool:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            if not state:
                state.update(_inputs(kind, x_dtype, table_dtype, device))
                state["reference"] = _MEGATRON_CORE[kind](**state)
            inputs = {k: v for k, v in state.items() if k != "reference"}
            ours, reference = _OURS[kind](candidate, **inputs), state["reference"]
            return torch.equal(ours.view(_BITS[ours.dtype]), reference.view(_BITS[reference.dtype]))

    return matches


def _inputs(kind, x_dtype, table_dtype, device) -> Dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(20261201)

    def rand(*shape, dtype):
        x = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
        flat = x.view(-1)
        flat[::11] = 0.0
        flat[5::11] = -0.0
        return x.to(dtype)

    cos = rand(ROWS, EMB, dtype=table_dtype)
    sin = rand(ROWS, EMB, dtype=table_dtype)
    if kind in ("q_fwd", "q_bwd"):
        return dict(x=rand(ROWS, 1, HEADS, NOPE + EMB, dtype=x_dtype), cos=cos, sin=sin)
    if kind == "kv_fwd":
        return dict(
            kv=rand(ROWS, 1, HEADS, 2 * NOPE, dtype=x_dtype),
            emb=rand(ROWS, 1, 1, EMB, dtype=x_dtype),
            cos=cos,
            sin=sin,
        )
    return dict(
        dkey=rand(ROWS, 1, HEADS, NOPE + EMB, dtype=x_dtype),
        dvalue=rand(ROWS, 1, HEADS, NOPE, dtype=x_dtype),
        cos=cos,
        sin=sin,
    )


# --------------------------------------------------------------------------------------------------
# megatron-core's kernels at BLOCK_H=1 (arguments by name, so a reordered signature still binds)
# --------------------------------------------------------------------------------------------------


def _mcore(name: str):
    from megatron.core.fusions import fused_mla_yarn_rope_apply

    return internals.triton_jit_function(getattr(fused_mla_yarn_rope_apply, name))


_COMMON = dict(batch_size=1, seq_num=None, cp_rank=0, cp_size=1, BLOCK_H=1)
_KV_COMMON = dict(_COMMON, emb_dim=EMB, k_dim=NOPE, v_dim=NOPE, head_num=HEADS, cu_seqlens_kv=None)


def _mcore_q(name, x, cos, sin):
    out = x.clone()
    flat = out.view(ROWS, HEADS, NOPE + EMB)
    _mcore(name)[(ROWS, HEADS)](
        flat,
        cos,
        sin,
        qk_head_dim=NOPE,
        emb_dim=EMB,
        head_num=HEADS,
        cu_seqlens_q=None,
        stride_x_seq=flat.stride(0),
        stride_x_nheads=flat.stride(1),
        **_COMMON,
    )
    return out


def _mcore_kv_fwd(kv, emb, cos, sin):
    key = kv.new_empty(ROWS, HEADS, NOPE + EMB)
    value = kv.new_empty(ROWS, HEADS, NOPE)
    flat = kv.view(ROWS, HEADS, 2 * NOPE)
    _mcore("rotary_fwd_kv_kernel")[(ROWS, HEADS)](
        flat,
        emb.view(ROWS, EMB),
        key,
        value,
        cos,
        sin,
        stride_kv_seq=flat.stride(0),
        stride_kv_nheads=flat.stride(1),
        stride_emb_seq=EMB,
        stride_k_seq=key.stride(0),
        stride_k_nheads=key.stride(1),
        stride_v_seq=value.stride(0),
        stride_v_nheads=value.stride(1),
        **_KV_COMMON,
    )
    return key


def _mcore_kv_bwd(dkey, dvalue, cos, sin):
    dk = dkey.view(ROWS, HEADS, NOPE + EMB)
    dv = dvalue.view(ROWS, HEADS, NOPE)
    d_kv = dk.new_empty(ROWS, HEADS, 2 * NOPE)
    d_emb = dk.new_empty(ROWS, EMB)
    _mcore("rotary_bwd_kv_kernel")[(ROWS, HEADS)](
        dk,
        dv,
        d_kv,
        d_emb,
        cos,
        sin,
        stride_dk_seq=dk.stride(0),
        stride_dk_nheads=dk.stride(1),
        stride_dv_seq=dv.stride(0),
        stride_dv_nheads=dv.stride(1),
        stride_dkv_seq=d_kv.stride(0),
        stride_dkv_nheads=d_kv.stride(1),
        stride_demb_seq=EMB,
        **_KV_COMMON,
    )
    return d_emb


_MEGATRON_CORE = {
    "q_fwd": lambda x, cos, sin: _mcore_q("rotary_fwd_q_kernel", x, cos, sin),
    "q_bwd": lambda x, cos, sin: _mcore_q("rotary_bwd_q_kernel", x, cos, sin),
    "kv_fwd": _mcore_kv_fwd,
    "kv_bwd": _mcore_kv_bwd,
}


# --------------------------------------------------------------------------------------------------
# Ours, at one candidate pairing
# --------------------------------------------------------------------------------------------------


def _launch(plan: checks.RopePlan, candidate: pairing.Pairing, *pointers) -> None:
    plan = plan.with_pairing(candidate)
    plan.kernel[plan.grid(1)[:2]](*pointers, **plan.args, **plan.options, BLOCK_H=1, num_warps=1)


def _ours_q(kernel, candidate, x, cos, sin):
    out = x.clone()
    rope = checks.QueryRope(cos, sin, None, None, NOPE, EMB, 0, 1, False, False)
    plan = checks.plan_query(kernel, out, rope)
    _launch(plan, candidate, out, cos, sin, None, None)
    return out


def _key_value_rope(cos, sin) -> checks.KeyValueRope:
    return checks.KeyValueRope(cos, sin, None, None, EMB, NOPE, NOPE, 0, 1, False)


def _ours_kv_fwd(candidate, kv, emb, cos, sin):
    plan = checks.plan_key_value(kv, emb, _key_value_rope(cos, sin))
    key, value = (kv.new_empty(shape) for shape in plan.outputs)
    _launch(plan, candidate, kv, emb, key, value, cos, sin, None, None)
    return key.view(ROWS, HEADS, NOPE + EMB)


def _ours_kv_bwd(candidate, dkey, dvalue, cos, sin):
    plan = checks.plan_key_value_grad(dkey, dvalue, _key_value_rope(cos, sin))
    d_kv, d_emb = (dkey.new_empty(shape) for shape in plan.outputs)
    _launch(plan, candidate, dkey, dvalue, d_kv, d_emb, cos, sin, None, None)
    return d_emb.view(ROWS, EMB)


_OURS = {
    "q_fwd": lambda candidate, **t: _ours_q(mla_rope_q_fwd_kernel, candidate, **t),
    "q_bwd": lambda candidate, **t: _ours_q(mla_rope_q_bwd_kernel, candidate, **t),
    "kv_fwd": _ours_kv_fwd,
    "kv_bwd": _ours_kv_bwd,
}
