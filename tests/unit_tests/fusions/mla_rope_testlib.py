# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Shared helpers for the MLA RoPE kernel tests: inputs, float64 references, an exact model of
the kernels' FMA arithmetic, a two-load reference kernel for the modes megatron-core lacks, and
megatron-core's kernels at the launch configs where they are a valid reference.

Import it as ``tests.unit_tests.fusions.mla_rope_testlib`` (the tests are packages; scripts that
use it run with ``python -m`` from the repository root).
"""

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from megatron_ext.fusions.mla_rope import pairing

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, for bitwise comparison (NaN payloads and -0.0 included)."""
    return x.contiguous().view(INT_VIEW[x.dtype])


def assert_bitwise_equal(
    actual: torch.Tensor,
    expected: torch.Tensor,
    what: str = "",
    exact: Optional[torch.Tensor] = None,
    reference: str = "the reference",
) -> None:
    """Assert two float tensors hold the same bits, and say where they differ if not.

    ``actual`` is megatron_ext's output, ``expected`` that of ``reference``. With ``exact`` (the
    float64 result) the message also says whose bits moved: the less accurate of the two.
    """
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    diff = bits(actual) != bits(expected)
    if diff.any():
        idx = diff.nonzero()[0].tolist()
        message = (
            f"{what}: {int(diff.sum())} of {diff.numel()} elements differ in their bits; first at "
            f"{idx}: {actual[tuple(idx)].item()!r} vs {expected[tuple(idx)].item()!r}"
        )
        if exact is not None:
            ours = (actual.double() - exact.reshape(actual.shape)).abs().max().item()
            theirs = (expected.double() - exact.reshape(actual.shape)).abs().max().item()
            verdict = (
                "megatron_ext is the less accurate: megatron_ext's bits moved"
                if ours > theirs
                else f"megatron_ext is no less accurate: {reference}'s bits moved (its compiled "
                "arithmetic, e.g. FMA pairing, differs)"
            )
            message += (
                f". Max |error| vs float64 under triton {triton.__version__}: megatron_ext "
                f"{ours:.3g}, {reference} {theirs:.3g}: {verdict}"
            )
        raise AssertionError(message)


def assert_equals_reference_configs(
    ours: torch.Tensor,
    refs: dict,
    exact: Optional[torch.Tensor],
    reference: str,
) -> List[int]:
    """Assert ``ours`` equals ``refs[1]`` (the reference at BLOCK_H=1, always defined) and every
    other ``refs[block_h]`` that has the same bits as ``refs[1]``.

    Returns:
        The BLOCK_H values at which the reference disagrees with its own BLOCK_H=1 output (a
        config-dependent reference: printed by the caller, not a failure of megatron_ext).
    """
    assert_bitwise_equal(ours, refs[1], f"{reference} at BLOCK_H=1", exact, reference)
    disagreeing = []
    for block_h, ref in refs.items():
        if torch.equal(bits(ref), bits(refs[1])):
            assert_bitwise_equal(ours, ref, f"{reference} at BLOCK_H={block_h}", exact, reference)
        else:
            disagreeing.append(block_h)
    return disagreeing


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


@dataclass
class Case:
    """One query/kv layout: sbhd (cu_seqlens None) or thd, with optional cp and position ids."""

    seq_len: int  # sbhd: s; thd: total rows (including padding rows past cu_seqlens[-1])
    batch: int  # sbhd only
    heads: int
    qk_head_dim: int
    emb_dim: int
    cu_seqlens: Optional[torch.Tensor] = None
    cp_rank: int = 0
    cp_size: int = 1
    position_ids: Optional[torch.Tensor] = None
    table_rows: int = 0

    @property
    def thd(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def lead(self) -> Tuple[int, ...]:
        return (self.seq_len,) if self.thd else (self.seq_len, self.batch)

    @property
    def rows(self) -> int:
        return self.seq_len if self.thd else self.seq_len * self.batch


def make_case(
    layout: str,
    heads: int,
    device,
    qk_head_dim: int = 8,
    emb_dim: int = 16,
    seq_len: int = 6,
    batch: int = 2,
    generator: Optional[torch.Generator] = None,
) -> Case:
    """Build a layout: 'sbhd', 'sbhd_pos', 'thd', 'thd_pad' (CUDA-graph padding rows), 'thd_cp2'
    (rank 1 of 2) or 'thd_pos'."""
    if layout in ("sbhd", "sbhd_pos"):
        case = Case(seq_len, batch, heads, qk_head_dim, emb_dim, table_rows=seq_len + 3)
        if layout == "sbhd_pos":
            case.position_ids = torch.randint(
                0, case.table_rows, (seq_len, batch), generator=generator
            ).to(device)
        return case
    lens = [3, 1, 5, 4]
    if layout == "thd_cp2":
        lens = [4, 8, 2, 6]  # every length divisible by 2 * cp_size
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    cp_size = 2 if layout == "thd_cp2" else 1
    rows = cu[-1] // cp_size + (3 if layout == "thd_pad" else 0)
    case = Case(
        rows,
        1,
        heads,
        qk_head_dim,
        emb_dim,
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
        cp_rank=1 if cp_size == 2 else 0,
        cp_size=cp_size,
        table_rows=max(lens) + 1,
    )
    if layout == "thd_pos":
        case.position_ids = torch.randint(
            0, case.table_rows, (rows,), generator=generator, dtype=torch.int64
        ).to(device)
    return case


def make_tables(
    rows: int,
    emb_dim: int,
    dtype: torch.dtype,
    device,
    rotation: bool = False,
    row_pad: int = 0,
    generator: Optional[torch.Generator] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos/sin as [rows, 1, 1, emb_dim] views (row stride emb_dim + row_pad).

    rotation=True gives true YaRN-style tables (the same angles in both halves, cos^2 + sin^2 = 1);
    otherwise independent random values, so that a mixed-up half or pairing shows.
    """
    if rotation:
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, emb_dim, 2, dtype=torch.float64) / emb_dim))
        angles = torch.arange(rows, dtype=torch.float64)[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        cos_v, sin_v = angles.cos(), angles.sin()
    else:
        cos_v = torch.rand(rows, emb_dim, generator=generator, dtype=torch.float64) * 2 - 1
        sin_v = torch.rand(rows, emb_dim, generator=generator, dtype=torch.float64) * 2 - 1
    out = []
    for v in (cos_v, sin_v):
        buf = torch.full((rows, emb_dim + row_pad), float("nan"), dtype=dtype)
        buf[:, :emb_dim] = v.to(dtype)
        out.append(buf.to(device)[:, None, None, :emb_dim])
    return out[0], out[1]


def randn(shape: Sequence[int], dtype: torch.dtype, device, generator=None) -> torch.Tensor:
    return torch.randn(*shape, generator=generator, dtype=torch.float32).to(dtype).to(device)


# --------------------------------------------------------------------------------------------------
# Float64 references and the exact FMA model
# --------------------------------------------------------------------------------------------------


def positions(case: Case) -> List[int]:
    """The cos/sin row of every flattened row, computed on the host."""
    n = case.table_rows
    if case.position_ids is not None:
        pos = case.position_ids.reshape(-1).tolist()
    elif not case.thd:
        pos = [r // case.batch for r in range(case.rows)]
    else:
        cu = [c // case.cp_size for c in case.cu_seqlens.tolist()]
        pos = []
        for r in range(case.rows):
            k = next((k for k in range(len(cu) - 1) if cu[k + 1] > r), None)
            if k is None:
                pos.append(0)
                continue
            local, length = r - cu[k], cu[k + 1] - cu[k]
            if local < length // 2:
                local += case.cp_rank * length // 2
            else:
                local += -(length // 2) + (2 * case.cp_size - case.cp_rank - 1) * length // 2
            pos.append(local)
    return [min(max(p, 0), n - 1) for p in pos]


def _table_halves(case: Case, cos, sin, dtype):
    pos = torch.tensor(positions(case), device=cos.device)
    c = cos.reshape(cos.shape[0], -1)[pos].to(dtype)
    s = sin.reshape(sin.shape[0], -1)[pos].to(dtype)
    h = case.emb_dim // 2
    shape = (case.rows, 1, h)
    return (
        c[:, :h].reshape(shape),
        c[:, h:].reshape(shape),
        s[:, :h].reshape(shape),
        s[:, h:].reshape(shape),
    )


def _split_pairs(x: torch.Tensor, interleaved: bool):
    h = x.shape[-1] // 2
    return (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :h], x[..., h:])


def _merge_pairs(a: torch.Tensor, b: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack([a, b], dim=-1).flatten(-2)
    return torch.cat([a, b], dim=-1)


@triton.jit
def _fma_probe_kernel(out_ptr):
    a = tl.full((1,), 1.0 + 2.0**-12, tl.float32)
    tl.store(out_ptr + tl.arange(0, 1), tl.fma(a, a, tl.full((1,), -1.0, tl.float32)))


@functools.lru_cache(maxsize=None)
def interpreter_fma_is_fused() -> bool:
    """Whether the Triton interpreter rounds ``tl.fma(a, b, c)`` once, as the GPU does.

    Triton 3.9's interpreter does; 3.7 and 3.8 evaluate ``a * b + c`` in the operands' dtype and
    round twice. The kernels' arithmetic is what the CPU tests model, so they model whichever this
    interpreter does; the GPU tests always compare with a true FMA. Probe: (1 + 2^-12)^2 - 1 is
    2^-11 + 2^-24 with one rounding and 2^-11 with two.
    """
    out = torch.zeros(1, dtype=torch.float32)
    _fma_probe_kernel[(1,)](out)
    return out.item() != 2.0**-11


def _fma(a, b, c, out_dtype):
    # a * b is exact in float64 for fp16/bf16 and for fp32 operands; the add then rounds once in
    # float64 and once more to out_dtype. For fp16/bf16 that is exact; for fp32 the double rounding
    # can differ from a true FMA, with probability ~2^-29 per element.
    if a.device.type == "cpu" and INTERPRETED and not interpreter_fma_is_fused():
        product = (a.double() * b.double()).to(out_dtype)
        return (product.double() + c.double()).to(out_dtype)
    return (a.double() * b.double() + c.double()).to(out_dtype)


def compute_dtype(x_dtype: torch.dtype, table_dtype: torch.dtype) -> torch.dtype:
    """Triton's promotion of the two dtypes (bf16 with fp16 computes in fp16)."""
    if torch.float32 in (x_dtype, table_dtype):
        return torch.float32
    if torch.float16 in (x_dtype, table_dtype):
        return torch.float16
    return torch.bfloat16


def kernel_pairing(
    kind: str, x_dtype, table_dtype, inverse: bool = False, device=None
) -> pairing.Pairing:
    """The FMA pairing the kernels launch with on ``device``: what the product's launches use (on a
    GPU the probed one, which follows the installed Triton; in the interpreter and on CPU tensors
    the forced one, the inverse rotation's fixed one, or the default)."""
    from megatron_ext.fusions.mla_rope import probe

    device = torch.device("cpu") if device is None else torch.device(device)
    return probe.pairing_for(kind, x_dtype, table_dtype, device, inverse)


def _pair(a, b, c, d, subtract: bool, fuse: int, ct):
    """The kernels' ``_pair``: ``a * b -/+ c * d`` with the products paired as ``fuse`` says."""
    if fuse == pairing.FUSE_FIRST:
        return _fma(a, b, -(c * d) if subtract else c * d, ct)
    if fuse == pairing.FUSE_SECOND:
        return _fma(-c if subtract else c, d, a * b, ct)
    return a * b - c * d if subtract else a * b + c * d


def _rotate_bwd(g_l, g_r, cl, cr, sl, sr, fma: pairing.Pairing, ct):
    return _pair(g_l, cl, g_r, sr, False, fma.first, ct), _pair(
        -g_l, sl, g_r, cr, False, fma.second, ct
    )


def q_forward_reference(
    case: Case,
    t,
    cos,
    sin,
    inverse=False,
    remove_interleaving=False,
    exact_model=False,
) -> torch.Tensor:
    """The query forward: float64 math (default), or the kernels' exact FMA arithmetic.

    Returns the whole tensor ([rows, heads, head_dim]) in float64, or in t's dtype for the model.
    """
    ct = compute_dtype(t.dtype, cos.dtype) if exact_model else torch.float64
    x = t.reshape(case.rows, case.heads, -1)
    rope = x[..., case.qk_head_dim :].to(ct)
    x1, x2 = _split_pairs(rope, True)
    cl, cr, sl, sr = _table_halves(case, cos, sin, ct)
    if inverse:
        sl, sr = -sl, -sr
    if exact_model:
        fma = kernel_pairing("q_fwd", t.dtype, cos.dtype, inverse, t.device)
        left = _pair(x1, cl, x2, sl, True, fma.first, ct)
        right = _pair(x2, cr, x1, sr, False, fma.second, ct)
    else:
        left = x1 * cl - x2 * sl
        right = x2 * cr + x1 * sr
    out = x.to(ct).clone()
    out[..., case.qk_head_dim :] = _merge_pairs(left, right, remove_interleaving)
    return out.to(t.dtype) if exact_model else out


def q_backward_reference(
    case: Case,
    g,
    cos,
    sin,
    inverse=False,
    remove_interleaving=False,
    exact_model=False,
) -> torch.Tensor:
    """The query backward (the forward rotation transposed), like :func:`q_forward_reference`."""
    ct = compute_dtype(g.dtype, cos.dtype) if exact_model else torch.float64
    x = g.reshape(case.rows, case.heads, -1)
    g_l, g_r = _split_pairs(x[..., case.qk_head_dim :].to(ct), remove_interleaving)
    cl, cr, sl, sr = _table_halves(case, cos, sin, ct)
    if inverse:
        sl, sr = -sl, -sr
    if exact_model:
        g1, g2 = _rotate_bwd(
            g_l,
            g_r,
            cl,
            cr,
            sl,
            sr,
            kernel_pairing("q_bwd", g.dtype, cos.dtype, inverse, g.device),
            ct,
        )
    else:
        g1 = g_l * cl + g_r * sr
        g2 = -g_l * sl + g_r * cr
    out = x.to(ct).clone()
    out[..., case.qk_head_dim :] = _merge_pairs(g1, g2, True)
    return out.to(g.dtype) if exact_model else out


def kv_forward_reference(
    case: Case, kv, k_pos_emb, cos, sin, k_dim, remove_interleaving=False, exact_model=False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(key, value) as [rows, heads, *], float64 or (exact_model) in kv's dtype."""
    ct = compute_dtype(k_pos_emb.dtype, cos.dtype) if exact_model else torch.float64
    x = kv.reshape(case.rows, case.heads, -1)
    emb = k_pos_emb.reshape(case.rows, 1, case.emb_dim).to(ct)
    x1, x2 = _split_pairs(emb, True)
    cl, cr, sl, sr = _table_halves(case, cos, sin, ct)
    if exact_model:
        fma = kernel_pairing("kv_fwd", k_pos_emb.dtype, cos.dtype, device=k_pos_emb.device)
        left = _pair(x1, cl, x2, sl, True, fma.first, ct)
        right = _pair(x2, cr, x1, sr, False, fma.second, ct)
    else:
        left = x1 * cl - x2 * sl
        right = x2 * cr + x1 * sr
    rope = _merge_pairs(left, right, remove_interleaving).to(kv.dtype if exact_model else ct)
    k = x[..., :k_dim].to(rope.dtype)
    key = torch.cat([k, rope.expand(-1, case.heads, -1)], dim=-1)
    value = x[..., k_dim:].to(rope.dtype)
    return key, value


def kv_backward_reference(
    case: Case, dkey, dvalue, cos, sin, k_dim, remove_interleaving=False, exact_model=False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(d_kv [rows, heads, k+v], d_emb [rows, emb]); the exact model sums heads in order in fp32."""
    dk = dkey.reshape(case.rows, case.heads, -1)
    dv = dvalue.reshape(case.rows, case.heads, -1)
    d_kv = torch.cat([dk[..., :k_dim], dv], dim=-1)
    rope = dk[..., k_dim:]
    if exact_model:
        acc = torch.zeros(case.rows, case.emb_dim, dtype=torch.float32, device=dk.device)
        for h in range(case.heads):
            acc = acc + rope[:, h].float()
        summed = acc.to(dkey.dtype)
        ct = compute_dtype(dkey.dtype, cos.dtype)
    else:
        summed = rope.double().sum(dim=1)
        ct = torch.float64
    g_l, g_r = _split_pairs(summed.to(ct)[:, None, :], remove_interleaving)
    cl, cr, sl, sr = _table_halves(case, cos, sin, ct)
    if exact_model:
        g1, g2 = _rotate_bwd(
            g_l,
            g_r,
            cl,
            cr,
            sl,
            sr,
            kernel_pairing("kv_bwd", dkey.dtype, cos.dtype, device=dkey.device),
            ct,
        )
    else:
        g1 = g_l * cl + g_r * sr
        g2 = -g_l * sl + g_r * cr
    d_emb = _merge_pairs(g1, g2, True)[:, 0]
    if exact_model:
        return d_kv, d_emb.to(dkey.dtype)
    return d_kv.double(), d_emb


# --------------------------------------------------------------------------------------------------
# Two-load reference kernels (the structure of megatron-core's query kernels, with upstream main's
# INVERSE / REMOVE_INTERLEAVING / position_ids and a global head mask). Their arithmetic is written
# unfused, as megatron-core's is, so the compiler contracts it the way it does megatron-core's.
# --------------------------------------------------------------------------------------------------


@triton.jit
def _ref_position(
    row, batch_size, cu_seqlens, seq_num, position_ids, cp_rank, cp_size, n_table_rows
):
    if position_ids is not None:
        pos = tl.load(position_ids + row).to(tl.int64)
    elif cu_seqlens is None:
        pos = (row // batch_size).to(tl.int64)
    else:
        pos = tl.full((), -1, dtype=tl.int64)
        length = tl.full((), 0, dtype=tl.int64)
        prev = tl.load(cu_seqlens).to(tl.int64) // cp_size
        k = 0
        while k < seq_num:
            cur = tl.load(cu_seqlens + k + 1).to(tl.int64) // cp_size
            if pos == -1 and cur > row:
                pos = row - prev
                length = cur - prev
            prev = cur
            k += 1
        if pos == -1:
            pos = tl.full((), 0, dtype=tl.int64)
        if pos < length // 2:
            pos = pos + cp_rank * length // 2
        else:
            pos = pos - length // 2 + (2 * cp_size - cp_rank - 1) * length // 2
    return tl.minimum(tl.maximum(pos, 0), n_table_rows - 1)


@triton.jit
def two_load_q_fwd_kernel(
    q,
    cos,
    sin,
    cu_seqlens,
    position_ids,
    head_num,
    batch_size,
    seq_num,
    n_table_rows,
    cp_rank,
    cp_size,
    stride_s,
    stride_b,
    stride_h,
    nope_dim,
    stride_cos,
    stride_sin,
    EMB_DIM: tl.constexpr,
    INVERSE: tl.constexpr,
    REMOVE_INTERLEAVING: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0)
    pos = _ref_position(
        row, batch_size, cu_seqlens, seq_num, position_ids, cp_rank, cp_size, n_table_rows
    )
    half = tl.arange(0, EMB_DIM // 2)
    cos_left = tl.load(cos + pos * stride_cos + half)
    cos_right = tl.load(cos + pos * stride_cos + EMB_DIM // 2 + half)
    sin_left = tl.load(sin + pos * stride_sin + half)
    sin_right = tl.load(sin + pos * stride_sin + EMB_DIM // 2 + half)
    if INVERSE:
        sin_left = -sin_left
        sin_right = -sin_right
    cos_left = tl.broadcast_to(cos_left[None, :], (BLOCK_H, EMB_DIM // 2))
    cos_right = tl.broadcast_to(cos_right[None, :], (BLOCK_H, EMB_DIM // 2))
    sin_left = tl.broadcast_to(sin_left[None, :], (BLOCK_H, EMB_DIM // 2))
    sin_right = tl.broadcast_to(sin_right[None, :], (BLOCK_H, EMB_DIM // 2))

    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (heads < head_num)[:, None]
    s_idx = row // batch_size
    b_idx = row - s_idx * batch_size
    base = q + s_idx.to(tl.int64) * stride_s + b_idx * stride_b + nope_dim
    base += heads[:, None] * stride_h
    even = base + half[None, :] * 2
    x_1 = tl.load(even, mask=mask)
    x_2 = tl.load(even + 1, mask=mask)
    x_left = x_1 * cos_left - x_2 * sin_left
    x_right = x_2 * cos_right + x_1 * sin_right
    if REMOVE_INTERLEAVING:
        tl.store(even, x_left, mask=mask)
        tl.store(even + 1, x_right, mask=mask)
    else:
        tl.store(base + half[None, :], x_left, mask=mask)
        tl.store(base + EMB_DIM // 2 + half[None, :], x_right, mask=mask)


@triton.jit
def two_load_q_bwd_kernel(
    g,
    cos,
    sin,
    cu_seqlens,
    position_ids,
    head_num,
    batch_size,
    seq_num,
    n_table_rows,
    cp_rank,
    cp_size,
    stride_s,
    stride_b,
    stride_h,
    nope_dim,
    stride_cos,
    stride_sin,
    EMB_DIM: tl.constexpr,
    INVERSE: tl.constexpr,
    REMOVE_INTERLEAVING: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0)
    pos = _ref_position(
        row, batch_size, cu_seqlens, seq_num, position_ids, cp_rank, cp_size, n_table_rows
    )
    half = tl.arange(0, EMB_DIM // 2)
    cos_left = tl.load(cos + pos * stride_cos + half)
    cos_right = tl.load(cos + pos * stride_cos + EMB_DIM // 2 + half)
    sin_left = tl.load(sin + pos * stride_sin + half)
    sin_right = tl.load(sin + pos * stride_sin + EMB_DIM // 2 + half)
    if INVERSE:
        sin_left = -sin_left
        sin_right = -sin_right
    cos_left = tl.broadcast_to(cos_left[None, :], (BLOCK_H, EMB_DIM // 2))
    cos_right = tl.broadcast_to(cos_right[None, :], (BLOCK_H, EMB_DIM // 2))
    sin_left = tl.broadcast_to(sin_left[None, :], (BLOCK_H, EMB_DIM // 2))
    sin_right = tl.broadcast_to(sin_right[None, :], (BLOCK_H, EMB_DIM // 2))

    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (heads < head_num)[:, None]
    s_idx = row // batch_size
    b_idx = row - s_idx * batch_size
    base = g + s_idx.to(tl.int64) * stride_s + b_idx * stride_b + nope_dim
    base += heads[:, None] * stride_h
    even = base + half[None, :] * 2
    if REMOVE_INTERLEAVING:
        x_left = tl.load(even, mask=mask)
        x_right = tl.load(even + 1, mask=mask)
    else:
        x_left = tl.load(base + half[None, :], mask=mask)
        x_right = tl.load(base + EMB_DIM // 2 + half[None, :], mask=mask)
    x_1 = x_left * cos_left + x_right * sin_right
    x_2 = -x_left * sin_left + x_right * cos_right
    tl.store(even, x_1, mask=mask)
    tl.store(even + 1, x_2, mask=mask)


def _launcher(kernel, grid, warmup: bool):
    """kernel[grid], or a compile-only call (see :func:`parallel_compile`)."""
    if warmup:
        return lambda *args, **kwargs: kernel.warmup(*args, grid=grid, **kwargs)
    return kernel[grid]


@contextlib.contextmanager
def parallel_compile(threads: int = 8) -> Iterator[None]:
    """Compile the kernels warmed up (``warmup=True`` calls) inside the block on several threads.

    Uses Triton's async compile mode where the installed Triton has it (on an H200 machine it cut
    compile time per kernel variant from 0.37 s to 0.06 s); elsewhere the warm-ups compile in turn.
    Launches after the block find the compiled kernels in Triton's cache.
    """
    try:
        from concurrent.futures import ThreadPoolExecutor

        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        yield
        return
    with ThreadPoolExecutor(threads) as pool, AsyncCompileMode(pool):
        yield


def plan_ours_q(kernel, case: Case, x, cos, sin, inverse=False, remove_interleaving=False):
    """megatron_ext's launch plan of a query kernel for these inputs, and its pointer arguments
    (the copying kernel's output left out: the caller allocates it)."""
    from megatron_ext.fusions.mla_rope import checks, launch

    rope = checks.QueryRope(
        cos,
        sin,
        case.cu_seqlens,
        case.position_ids,
        case.qk_head_dim,
        case.emb_dim,
        case.cp_rank,
        case.cp_size,
        inverse,
        remove_interleaving,
    )
    # The pairing the product's launch takes (probed on a GPU), so that a launch at any config
    # through this plan has the public call's bits.
    plan = checks.plan_query(kernel, x, rope)
    plan = plan.with_pairing(launch.pairing_for(plan, x, None, rope))
    position_ids = case.position_ids
    if position_ids is not None:
        position_ids = position_ids.contiguous()  # the kernels index it by flat row
    return plan, (cos, sin, case.cu_seqlens, position_ids)


def warm_ours_q(
    backward: bool, case: Case, x, cos, sin, config, inverse=False, remove_interleaving=False
):
    """Compile megatron_ext's query kernel for these inputs at one config, without launching."""
    from megatron_ext.fusions.mla_rope import kernels

    kernel = kernels.mla_rope_q_bwd_kernel if backward else kernels.mla_rope_q_fwd_kernel
    plan, tables = plan_ours_q(kernel, case, x, cos, sin, inverse, remove_interleaving)
    kernel.warmup(
        x,
        *tables,
        grid=(1,),
        **plan.args,
        BLOCK_H=config.block_h,
        num_warps=config.num_warps,
    )


def run_two_load(
    backward: bool,
    case: Case,
    x: torch.Tensor,
    cos,
    sin,
    block_h: int,
    inverse: bool = False,
    remove_interleaving: bool = False,
    warmup: bool = False,
) -> torch.Tensor:
    """Run a two-load reference kernel in place on x at one BLOCK_H (or only compile it, with
    ``warmup``); returns x."""
    if case.thd:
        strides = (x.stride(0), 0, x.stride(1))
    else:
        strides = (x.stride(0), x.stride(1), x.stride(2))
    kernel = two_load_q_bwd_kernel if backward else two_load_q_fwd_kernel
    pos_ids = None if case.position_ids is None else case.position_ids.reshape(-1)
    grid = (case.rows, triton.cdiv(case.heads, block_h))
    _launcher(kernel, grid, warmup)(
        x,
        cos,
        sin,
        case.cu_seqlens,
        pos_ids,
        case.heads,
        1 if case.thd else case.batch,
        0 if case.cu_seqlens is None else case.cu_seqlens.numel() - 1,
        cos.shape[0],
        case.cp_rank,
        case.cp_size,
        *strides,
        case.qk_head_dim,
        cos.stride(0),
        sin.stride(0),
        EMB_DIM=case.emb_dim,
        INVERSE=inverse,
        REMOVE_INTERLEAVING=remove_interleaving,
        BLOCK_H=block_h,
    )
    return x


# --------------------------------------------------------------------------------------------------
# Which of megatron-core's launch configs can serve as a bitwise reference
# --------------------------------------------------------------------------------------------------

# Our names for megatron-core's four MLA RoPE kernels (attributes of its fused_mla_yarn_rope_apply).
MCORE_KERNELS = {
    "q_fwd": "rotary_fwd_q_kernel",
    "q_bwd": "rotary_bwd_q_kernel",
    "kv_fwd": "rotary_fwd_kv_kernel",
    "kv_bwd": "rotary_bwd_kv_kernel",
}
# The BLOCK_H values of megatron-core's autotuner configs (each with Triton's default 4 warps).
MCORE_BLOCK_HS = (1, 2, 4, 8, 16, 32, 64, 128)
MCORE_NUM_WARPS = 4

# BLOCK_H values at which megatron-core's in-place query kernels, relaunched on fresh copies of one
# input, never changed a bit: H200, triton 3.6, megatron-core 0.16.1 (0.19.2 ships the same file),
# [64, 1, 128, 192] and 16 heads, bf16 and fp16, 4 and 8 warps, 100 launches per config. Its query
# backward at BLOCK_H=2 gave other bits in up to 100 of 100 launches: it loads the two halves of
# each head's RoPE part and stores the interleaved result into the same addresses with no barrier
# in between, so one warp can overwrite elements another warp has not loaded yet (the fix proposed
# upstream, Megatron-LM PR #5963, adds a barrier). BLOCK_H 32, 64 and 128 were not measured there,
# so they are no reference until they are (the race survey next to the kernel tests measures every
# BLOCK_H; add what it finds race-free here).
# The key/value kernels are out of place: they read only kv/k_pos_emb (or the incoming gradients)
# and write only freshly allocated outputs, so no launch reads what it writes: every BLOCK_H is
# race-free by construction.
MCORE_RACE_FREE_BLOCK_H = {
    "q_fwd": (1, 2, 4, 8, 16),
    "q_bwd": (1, 4, 8, 16),
    "kv_fwd": MCORE_BLOCK_HS,
    "kv_bwd": MCORE_BLOCK_HS,
}
# Where the same measurement saw launches differ.
MCORE_RACY_BLOCK_H = {"q_bwd": (2,)}


def megatron_core_mask_correct(heads: int, block_h: int) -> bool:
    """Whether megatron-core's MLA RoPE kernels compute a defined output at this BLOCK_H.

    They mask heads by their index inside the head block (``arange(BLOCK_H) < head_num``), not by
    the global head index, so the last block of a head count that BLOCK_H does not divide also
    rotates (and, for the last token, writes past) heads beyond the tensor. That is harmless only
    when BLOCK_H divides the head count, or when one block holds every head.
    """
    return heads % block_h == 0 or heads <= block_h


def megatron_core_reference_skip_reason(
    kernel: str, heads: int, block_h: int, interpreted: Optional[bool] = None
) -> Optional[str]:
    """Why megatron-core's ``kernel`` at ``block_h`` is no bitwise reference; None when it is one.

    A reference must be mask-correct (:func:`megatron_core_mask_correct`) and race-free
    (:data:`MCORE_RACE_FREE_BLOCK_H`). The Triton interpreter runs each program's block operations
    one after another, so no launch races there.

    Args:
        kernel: 'q_fwd', 'q_bwd', 'kv_fwd' or 'kv_bwd'.
        heads: the head count of the launch.
        block_h: megatron-core's BLOCK_H.
        interpreted: whether kernels run in the Triton interpreter (default: TRITON_INTERPRET).

    Returns:
        Optional[str]: the reason, for a skip message, or None.
    """
    if kernel not in MCORE_KERNELS:
        raise ValueError(f"kernel must be one of {sorted(MCORE_KERNELS)}, got {kernel!r}")
    name = f"megatron-core's {MCORE_KERNELS[kernel]} at BLOCK_H={block_h}"
    if not megatron_core_mask_correct(heads, block_h):
        return (
            f"{name} is undefined for {heads} heads: its head mask is block-local and "
            f"{block_h} does not divide {heads}"
        )
    if interpreted is None:
        interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if not interpreted and block_h in MCORE_RACY_BLOCK_H.get(kernel, ()):
        return f"{name} races on a GPU: relaunched on one input it gives other bits"
    if not interpreted and block_h not in MCORE_RACE_FREE_BLOCK_H[kernel]:
        return (
            f"{name} has not been measured race-free on a GPU (measured race-free: BLOCK_H "
            f"{', '.join(map(str, MCORE_RACE_FREE_BLOCK_H[kernel]))})"
        )
    return None


def megatron_core_reference_block_hs(
    kernel: str, heads: int, interpreted: Optional[bool] = None
) -> Tuple[int, ...]:
    """The BLOCK_H values at which megatron-core's ``kernel`` is a bitwise reference for ``heads``.

    Every comparison with megatron-core's kernels goes through this (or
    :func:`megatron_core_reference_skip_reason`), so that a comparison can fail only because of
    megatron_ext, never because megatron-core's own output is undefined or differs from launch to
    launch. BLOCK_H=1 is always included.

    Args:
        kernel: 'q_fwd', 'q_bwd', 'kv_fwd' or 'kv_bwd'.
        heads: the head count of the launch.
        interpreted: whether kernels run in the Triton interpreter (default: TRITON_INTERPRET).

    Returns:
        Tuple[int, ...]: the valid BLOCK_H values, ascending.
    """
    return tuple(
        b
        for b in MCORE_BLOCK_HS
        if megatron_core_reference_skip_reason(kernel, heads, b, interpreted) is None
    )


def pin_megatron_core_autotuners(monkeypatch, heads: int):
    """Make megatron-core's four autotuned kernels launch at BLOCK_H=1, with no autotuning.

    BLOCK_H=1 is a reference for every head count (:func:`megatron_core_reference_block_hs`), and
    it is the one config whose key/value backward sums the heads in head order, the order
    megatron_ext uses at every config. The Triton interpreter cannot autotune at all, so CPU tests
    need a single config too. ``monkeypatch`` restores the autotuners afterwards.

    Args:
        monkeypatch: pytest's monkeypatch fixture.
        heads: the head count the kernels will see (checked against the reference selection).

    Returns:
        megatron-core's ``fused_mla_yarn_rope_apply`` module.
    """
    from megatron.core.fusions import fused_mla_yarn_rope_apply as mc

    for kernel, name in MCORE_KERNELS.items():
        block_h = megatron_core_reference_block_hs(kernel, heads)[0]
        tuner = getattr(mc, name)
        monkeypatch.setattr(tuner, "configs", [triton.Config({"BLOCK_H": block_h})])
        monkeypatch.setattr(tuner, "cache", {})
    return mc


# --------------------------------------------------------------------------------------------------
# megatron-core's kernels at one pinned BLOCK_H (its autotuner bypassed)
# --------------------------------------------------------------------------------------------------


def run_mcore_q(
    backward: bool,
    case: Case,
    x: torch.Tensor,
    cos,
    sin,
    block_h: int,
    warmup: bool = False,
    num_warps: int = MCORE_NUM_WARPS,
):
    """megatron-core's query kernel in place on a contiguous x at one BLOCK_H; returns x.

    Only defined when heads % block_h == 0 or heads <= block_h (its head mask is block-local);
    give x slack after it (see ``guarded``) otherwise. ``num_warps`` other than 4 is a launch its
    autotuner never makes (for surveys only).
    """
    from megatron.core.fusions import fused_mla_yarn_rope_apply as mc

    kernel = mc.rotary_bwd_q_kernel if backward else mc.rotary_fwd_q_kernel
    flat = x.view(case.rows, case.heads, -1)
    grid = (case.rows, triton.cdiv(case.heads, block_h))
    _launcher(kernel.fn, grid, warmup)(
        flat,
        cos,
        sin,
        case.qk_head_dim,
        case.emb_dim,
        case.heads,
        None if case.thd else case.batch,
        None if not case.thd else case.cu_seqlens.numel() - 1,
        case.cu_seqlens,
        flat.stride(0),
        flat.stride(1),
        case.cp_rank,
        case.cp_size,
        BLOCK_H=block_h,
        num_warps=num_warps,
    )
    return x


def run_mcore_kv_fwd(
    case: Case,
    kv,
    k_pos_emb,
    cos,
    sin,
    k_dim,
    v_dim,
    block_h: int,
    warmup: bool = False,
    num_warps: int = MCORE_NUM_WARPS,
):
    """megatron-core's kv forward kernel at one BLOCK_H; returns (key, value) as [rows, h, *]."""
    from megatron.core.fusions import fused_mla_yarn_rope_apply as mc

    flat = kv.reshape(case.rows, case.heads, -1)
    emb = k_pos_emb.reshape(case.rows, case.emb_dim)
    key = kv.new_empty(case.rows, case.heads, k_dim + case.emb_dim)
    value = kv.new_empty(case.rows, case.heads, v_dim)
    grid = (case.rows, triton.cdiv(case.heads, block_h))
    _launcher(mc.rotary_fwd_kv_kernel.fn, grid, warmup)(
        flat,
        emb,
        key,
        value,
        cos,
        sin,
        case.emb_dim,
        k_dim,
        v_dim,
        case.heads,
        None if case.thd else case.batch,
        None if not case.thd else case.cu_seqlens.numel() - 1,
        case.cu_seqlens,
        flat.stride(0),
        flat.stride(1),
        emb.stride(0),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        case.cp_rank,
        case.cp_size,
        BLOCK_H=block_h,
        num_warps=num_warps,
    )
    return key, value


def run_mcore_kv_bwd(
    case: Case,
    dkey,
    dvalue,
    cos,
    sin,
    k_dim,
    v_dim,
    block_h: int,
    warmup: bool = False,
    num_warps: int = MCORE_NUM_WARPS,
):
    """megatron-core's kv backward kernel at one BLOCK_H; returns (d_kv [rows, h, *], d_emb)."""
    from megatron.core.fusions import fused_mla_yarn_rope_apply as mc

    dk = dkey.reshape(case.rows, case.heads, -1).contiguous()
    dv = dvalue.reshape(case.rows, case.heads, -1).contiguous()
    d_kv = dk.new_empty(case.rows, case.heads, k_dim + v_dim)
    d_emb = dk.new_empty(case.rows, 1, case.emb_dim)
    grid = (case.rows, triton.cdiv(case.heads, block_h))
    _launcher(mc.rotary_bwd_kv_kernel.fn, grid, warmup)(
        dk,
        dv,
        d_kv,
        d_emb,
        cos,
        sin,
        case.emb_dim,
        k_dim,
        v_dim,
        case.heads,
        None if case.thd else case.batch,
        None if not case.thd else case.cu_seqlens.numel() - 1,
        case.cu_seqlens,
        dk.stride(0),
        dk.stride(1),
        dv.stride(0),
        dv.stride(1),
        d_kv.stride(0),
        d_kv.stride(1),
        d_emb.stride(0),
        case.cp_rank,
        case.cp_size,
        BLOCK_H=block_h,
        num_warps=num_warps,
    )
    return d_kv, d_emb[:, 0]


def guarded(x: torch.Tensor, before: int, after: int, fill: float = 1234.5):
    """A copy of contiguous x inside a larger buffer with ``before``/``after`` guard elements.

    Returns (view, buffer); the guard elements hold ``fill`` (a value no kernel output takes).
    """
    buf = torch.full((before + x.numel() + after,), fill, dtype=x.dtype, device=x.device)
    view = buf[before : before + x.numel()].view(x.shape)
    view.copy_(x)
    return view, buf


def guard_intact(buf: torch.Tensor, before: int, numel: int, fill: float = 1234.5) -> bool:
    """Whether both guard regions of a buffer from :func:`guarded` still hold ``fill``."""
    head, tail = buf[:before], buf[before + numel :]
    return bool((head == fill).all()) and bool((tail == fill).all())
