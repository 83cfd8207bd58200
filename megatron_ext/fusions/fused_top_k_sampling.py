# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""One kernel for the draw among the top-k candidates of each row.

The graph-safe sampling region takes ``cap`` candidates per row with one ``torch.topk`` and draws
one of them with the exponential race (``argmax(p / E)``, ``E ~ Exp(1)`` drawn by torch from the
controller's generator). In torch, the cut at the row's k-th largest logit, the temperature, the
softmax, the race and the gather of the vocabulary index are about a dozen launches on
``[rows, cap]`` tensors, each a few microseconds of GPU work but a full launch of host time when
the region runs eagerly. :func:`sample_top_k_candidates` does them in one kernel, one program per
row.

The softmax is the kernel's own, so a token can differ from the torch path's where two candidates'
``p / E`` are within rounding of each other; the draw follows the same distribution, and the
region is bitwise equal between eager runs and CUDA-graph replays because both launch this kernel.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from megatron_ext.fusions.direct_launch import KernelLaunches, PreparedLaunch
from megatron_ext.fusions.launch_math import next_power_of_2
from megatron_ext.fusions.launch_plans import NO_LAUNCH, LaunchPlan, PlanCache, layout_key
from megatron_ext.fusions.tensor_checks import FLOAT_DTYPES, check_disjoint, check_runnable

__all__ = ["FUSED_DTYPES", "MAX_FUSED_CAP", "sample_top_k_candidates"]

# Above this many candidates a row no longer fits one program's registers well; the caller keeps
# its torch path there.
MAX_FUSED_CAP = 4096
# Logit dtypes the kernel reads (the sampling controller asks by this name).
FUSED_DTYPES = FLOAT_DTYPES


@triton.jit
def _top_k_candidates_kernel(
    values_ptr,
    indices_ptr,
    temperature_ptr,
    top_k_ptr,
    noise_ptr,
    out_ptr,
    cap,
    values_stride,
    indices_stride,
    noise_stride,
    TINY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < cap
    values = tl.load(values_ptr + row * values_stride + cols, mask=inside, other=float("-inf"))
    values = values.to(tl.float32)
    # The k-th largest candidate (topk's values are sorted): ties with it stay, up to the cap.
    k = tl.minimum(tl.maximum(tl.load(top_k_ptr + row).to(tl.int64), 1), cap)
    kth = tl.load(values_ptr + row * values_stride + k - 1).to(tl.float32)
    scores = values / tl.load(temperature_ptr + row).to(tl.float32)
    # "Below the k-th" as torch's masked_fill reads it (a NaN candidate is not below it).
    scores = tl.where(values < kth, float("-inf"), scores)
    scores = tl.where(inside, scores, float("-inf"))
    exp = tl.exp(scores - tl.max(scores, axis=0))
    probs = exp / tl.sum(exp, axis=0)
    # A zero draw would make a filtered entry 0/0 = NaN, which argmax would pick.
    noise = tl.load(noise_ptr + row * noise_stride + cols, mask=inside, other=1.0)
    race = probs / tl.maximum(noise, TINY)
    # A row without finite scores (a NaN or +inf logit, or all -inf) races NaN in every lane,
    # where argmax may name a lane past the candidates: NaN races as 0 (lane 0 wins) and the
    # lane is clamped, so the read stays in the row. Finite rows race no NaN: nothing changes
    # for them. The region reports such rows and never uses their token.
    race = tl.where(race == race, race, 0.0)
    choice = tl.minimum(tl.argmax(race, axis=0, tie_break_left=True), cap - 1)
    token = tl.load(indices_ptr + row * indices_stride + choice)
    tl.store(out_ptr + row, token)


def _num_warps(block: int) -> int:
    return 1 if block <= 64 else 4 if block <= 1024 else 8


# Triton's JIT on a specialisation's first call, then the direct launch.
_LAUNCHES = KernelLaunches(_top_k_candidates_kernel)
# Checked call layouts -> their prepared launches (megatron_ext.fusions.launch_plans).
_PLANS: PlanCache[LaunchPlan] = PlanCache()


def _check_disjoint_out(values, indices, temperature, top_k, noise, out) -> None:
    check_disjoint(
        "out",
        out,
        (
            ("values", values),
            ("indices", indices),
            ("temperature", temperature),
            ("top_k", top_k),
            ("noise", noise),
        ),
    )


def _check(
    values: Tensor,
    indices: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    noise: Tensor,
    out: Tensor,
) -> int:
    inputs = (
        ("values", values),
        ("indices", indices),
        ("temperature", temperature),
        ("top_k", top_k),
        ("noise", noise),
    )
    for name, tensor in inputs:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(tensor).__name__}")
    # Before out's checks: without a caller's out, none is allocated for inputs of other ranks.
    if values.dim() != 2 or indices.shape != values.shape or noise.shape != values.shape:
        raise ValueError(
            "values, indices and noise must be [rows, cap] alike, got "
            f"{tuple(values.shape)}, {tuple(indices.shape)}, {tuple(noise.shape)}"
        )
    if not isinstance(out, Tensor):
        raise TypeError(f"out must be a Tensor, got {type(out).__name__}")
    device = values.device
    for name, tensor in inputs[1:] + (("out", out),):
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, values on {device}")
    rows, cap = values.shape
    for name, tensor in (("temperature", temperature), ("top_k", top_k), ("out", out)):
        if tensor.shape != (rows,):
            raise ValueError(f"{name} must have shape ({rows},), got {tuple(tensor.shape)}")
    if not 1 <= cap <= MAX_FUSED_CAP:
        raise ValueError(f"the candidate count must be in [1, {MAX_FUSED_CAP}], got {cap}")
    if values.dtype not in FUSED_DTYPES:
        raise TypeError(f"values must be float32, float16 or bfloat16, got {values.dtype}")
    expected = {
        "indices": (indices, torch.int64),
        "temperature": (temperature, torch.float32),
        "noise": (noise, torch.float32),
        "out": (out, torch.int64),
    }
    for name, (tensor, dtype) in expected.items():
        if tensor.dtype != dtype:
            raise TypeError(f"{name} must be {dtype}, got {tensor.dtype}")
    if top_k.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"top_k must be int32 or int64, got {top_k.dtype}")
    for name, tensor in (("values", values), ("indices", indices), ("noise", noise)):
        if tensor.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dimension")
    for name, tensor in (("temperature", temperature), ("top_k", top_k), ("out", out)):
        if rows > 1 and tensor.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    _check_disjoint_out(values, indices, temperature, top_k, noise, out)
    check_runnable("sample_top_k_candidates", "values", values)
    return cap


def sample_top_k_candidates(
    values: Tensor,
    indices: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    noise: Tensor,
    out: Optional[Tensor] = None,
) -> Tensor:
    """Draw one of each row's top-k candidates. GRAPH-SAFE (no synchronisation; it reads and
    writes only the given tensors).

    Per row: the candidates at least as large as the ``top_k``-th (clamped to ``[1, cap]``) are
    kept, their ``softmax(values / temperature)`` raced against ``noise`` (``argmax(p / E)``, a
    zero draw read as the smallest normal float32), and the winner's ``indices`` entry written.

    Args:
        values (Tensor): ``[rows, cap]`` candidate logits, sorted descending per row (what
            ``torch.topk`` returns); float32, float16 or bfloat16.
        indices (Tensor): ``[rows, cap]`` int64 vocabulary index of each candidate.
        temperature (Tensor): ``[rows]`` float32, positive.
        top_k (Tensor): ``[rows]`` int32 or int64.
        noise (Tensor): ``[rows, cap]`` float32 ``Exp(1)`` draws.
        out (Optional[Tensor]): ``[rows]`` int64 to write the tokens to (a new tensor if None).

    Returns:
        Tensor: ``out``, the drawn vocabulary indices.

    Raises:
        TypeError, ValueError: for arguments of other types, dtypes, shapes, devices or layouts,
            before any launch.
    """
    tensors = (values, indices, temperature, top_k, noise)
    key = layout_key((*tensors, out), ())
    launch = _PLANS.get(key)
    if launch is None:
        # First call of this layout: every check, then the launch (cached once they passed).
        if out is None and isinstance(values, Tensor) and values.dim() == 2:
            out = torch.empty(values.shape[0], dtype=torch.int64, device=values.device)
        launch = _PLANS.put(key, _plan(*tensors, out))
    elif out is None:
        out = torch.empty(values.shape[0], dtype=torch.int64, device=values.device)
    else:
        # What the layout cannot tell: whether out shares memory with an input.
        _check_disjoint_out(*tensors, out)
    launch(*tensors, out)
    return out


def _plan(values, indices, temperature, top_k, noise, out) -> LaunchPlan:
    """Check a call; return its prepared launch (``NO_LAUNCH`` without rows)."""
    cap = _check(values, indices, temperature, top_k, noise, out)
    rows = values.shape[0]
    if rows == 0:
        return NO_LAUNCH
    block = next_power_of_2(cap)
    args = dict(
        values_ptr=values,
        indices_ptr=indices,
        temperature_ptr=temperature,
        top_k_ptr=top_k,
        noise_ptr=noise,
        out_ptr=out,
        cap=cap,
        values_stride=values.stride(0),
        indices_stride=indices.stride(0),
        noise_stride=noise.stride(0),
        TINY=torch.finfo(torch.float32).tiny,
        BLOCK=block,
    )
    return PreparedLaunch(_LAUNCHES, (rows,), args, dict(num_warps=_num_warps(block)))
