# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Shared helpers for the tests of the paged MLA latent-cache kernels: dynamic-batching steps
laid out as megatron-core's ``DynamicInferenceContext`` lays them out (shuffled blocks, padded
requests and tokens), guard regions, and float64 references that gather the pages explicitly.

Imported as ``tests.unit_tests.fusions.mla_latent_cache_testlib`` (run from the repository root).
"""

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, List, Sequence, Tuple

import pytest
import torch

from megatron_ext.fusions.launch_plans import PlanCache
from megatron_ext.testing.latent_cache_baseline import LatentCacheContextStandIn

REPO_ROOT = Path(__file__).resolve().parents[3]


def load_script(name: str) -> ModuleType:
    """Import ``scripts/<name>.py`` of this checkout as a module (the scripts are no package)."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_refuses_without_a_gpu(script: ModuleType, capsys) -> None:
    """A GPU-only script's ``main([])`` exits 2 and says there is no CUDA GPU."""
    assert script.main([]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


# What the guard elements around a cache or an output hold: no kernel writes it.
GUARD = 1234.5
# What an output holds before a call: a row the kernel forgot stays NaN.
POISON = float("nan")
GUARD_ELEMENTS = 97
# A cache offset that keeps a cache 16-byte aligned (64 elements: 128 bytes at 16 bits), for the
# kernels that copy rows 16 bytes at a time and take only such caches.
ALIGNED_CACHE_OFFSET = 64


def compiled_outside_interpreter(code: str, inputs: Any, path: Path, timeout: int) -> Any:
    """Run ``code`` (``python -c code INPUTS_JSON OUT_PATH``) in a process of its own without
    Triton's interpreter and return what it wrote to ``path`` as JSON: the test session runs
    Triton in its interpreter (TRITON_INTERPRET=1 without a GPU, set before Triton was
    imported), where Gluon kernels do not compile.

    Args:
        code: the program; it reads its inputs from ``sys.argv[1]`` and writes ``sys.argv[2]``.
        inputs: what it is given (as JSON).
        path: where it writes its result.
        timeout: seconds before the process is stopped.

    Returns:
        Any: the result, read back.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(inputs), str(path)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(path.read_text())


def guarded_tensor(shape: Sequence[int], dtype, device, fill: float) -> Tuple[torch.Tensor, ...]:
    """A contiguous tensor filled with ``fill`` inside a buffer whose guard elements hold GUARD.

    Returns:
        (view, buffer).
    """
    numel = 1
    for n in shape:
        numel *= n
    buffer = torch.full((2 * GUARD_ELEMENTS + numel,), GUARD, dtype=dtype, device=device)
    view = buffer[GUARD_ELEMENTS : GUARD_ELEMENTS + numel].view(*shape)
    view.fill_(fill)
    return view, buffer


def guards_intact(buffer: torch.Tensor) -> bool:
    """Whether both guard regions of a buffer from :func:`guarded_tensor` still hold GUARD."""
    head, tail = buffer[:GUARD_ELEMENTS], buffer[-GUARD_ELEMENTS:]
    return bool((head == GUARD).all()) and bool((tail == GUARD).all())


@dataclass
class Step:
    """One dynamic-batching step's attention inputs over one layer's paged latent cache."""

    query: torch.Tensor  # [tokens, heads, latent + rope]
    kv_cache: torch.Tensor  # [blocks, block_size, latent + rope], a view into cache_buffer
    cache_buffer: torch.Tensor
    block_table: torch.Tensor  # [requests (padded), max blocks]
    cu_query_lengths: torch.Tensor  # [requests + 1]
    kv_lengths: torch.Tensor  # [requests]
    requests: List[Tuple[int, int]]  # (cached before the step, new) per real request
    latent_dim: int
    rope_dim: int


def build_step(
    requests: Sequence[Tuple[int, int]],
    *,
    heads: int,
    latent_dim: int = 32,
    rope_dim: int = 16,
    block_size: int = 16,
    dtype=torch.float32,
    device="cpu",
    seed: int = 0,
    padding_requests: int = 0,
    padding_tokens: int = 0,
    spare_blocks: int = 3,
    index_dtype=torch.int32,
    cache_offset: int = GUARD_ELEMENTS,
) -> Step:
    """A step with ``requests`` = [(cached tokens, new tokens), ...].

    Blocks are handed out in a shuffled order among ``spare_blocks`` unused ones, so a request's
    pages are neither contiguous nor ordered; the block table has one unused (-1) column more than
    the longest request needs; padded requests (length 0, table row -1) and padded tokens follow
    the real ones, as megatron-core pads them for CUDA graphs. Every cache row holds random values
    (rows no request owns too), and the query random values.
    The cache sits ``cache_offset`` elements into a buffer whose other elements hold GUARD (by
    default 97: a cache no 16-byte multiple from the allocation's start).
    """
    gen = torch.Generator().manual_seed(seed)
    width = latent_dim + rope_dim
    blocks = [-(-(cached + new) // block_size) for cached, new in requests]
    num_blocks = sum(blocks) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    rows = len(requests) + padding_requests
    table = torch.full((rows, max(blocks, default=0) + 1), -1, dtype=index_dtype)
    used = 0
    for r, count in enumerate(blocks):
        table[r, :count] = order[used : used + count].to(index_dtype)
        used += count
    new_counts = [new for _, new in requests] + [0] * padding_requests
    kv = [cached + new for cached, new in requests] + [0] * padding_requests
    cu = torch.zeros(rows + 1, dtype=index_dtype)
    cu[1:] = torch.tensor(new_counts, dtype=torch.int64).cumsum(0).to(index_dtype)
    tokens = sum(new_counts) + padding_tokens
    cache = torch.randn(num_blocks, block_size, width, generator=gen).to(dtype)
    buffer = torch.full((cache_offset + GUARD_ELEMENTS + cache.numel(),), GUARD, dtype=dtype)
    view = buffer[cache_offset : cache_offset + cache.numel()].view(cache.shape)
    view.copy_(cache)
    buffer = buffer.to(device)
    query = torch.randn(tokens, heads, width, generator=gen).to(dtype)
    return Step(
        query=query.to(device),
        kv_cache=buffer[cache_offset : cache_offset + cache.numel()].view(cache.shape),
        cache_buffer=buffer,
        block_table=table.to(device),
        cu_query_lengths=cu.to(device),
        kv_lengths=torch.tensor(kv, dtype=index_dtype, device=device),
        requests=list(requests),
        latent_dim=latent_dim,
        rope_dim=rope_dim,
    )


def attention_reference(step: Step, softmax_scale: float, query=None) -> torch.Tensor:
    """The step's attention in float64, each request's cache rows gathered page by page.

    Follows the kernel's contract for metadata the host cannot check: ``cu_query_lengths`` is
    clamped into ``[0, tokens]``; tokens outside ``[cu[0], cu[-1])`` get zeros, and all tokens
    inside it NaN if the clamped values ever decrease; a row whose block id lies outside the cache
    is left out, and a request's context is cut at the block table's capacity. A token's output
    depends only on the rows it attends to: NaN if one of them holds a non-finite value, zeros if
    it attends to none.
    """
    query = step.query if query is None else query
    cache = step.kv_cache.double()
    blocks, block_size, _ = cache.shape
    table = step.block_table.long()
    tokens, heads, _ = query.shape
    cu = step.cu_query_lengths.long().clamp(0, tokens).tolist()
    kv_lengths = step.kv_lengths.long().tolist()
    out = torch.zeros(tokens, heads, step.latent_dim, dtype=torch.float64, device=query.device)
    if any(b < a for a, b in zip(cu, cu[1:])):
        out[cu[0] : cu[-1]] = float("nan")
        return out
    for r in range(table.shape[0]):
        start, end = cu[r], cu[r + 1]
        if end <= start:
            continue
        context = max(0, min(kv_lengths[r], table.shape[1] * block_size))
        keys = torch.arange(context, device=cache.device)
        ids = table[r, keys // block_size]
        present = (ids >= 0) & (ids < blocks)
        rows = cache[ids.clamp(0, blocks - 1), keys % block_size]  # [keys, width], page by page
        q = query[start:end].double()
        scores = torch.einsum("qhd,nd->qhn", q, rows) * softmax_scale
        positions = kv_lengths[r] - (end - start) + torch.arange(end - start, device=cache.device)
        attend = present[None, :] & (keys[None, :] <= positions[:, None])  # [new tokens, keys]
        scores = scores.masked_fill(~attend[:, None, :], float("-inf"))
        weights = scores.softmax(-1)
        # Only the attended rows' values, so that a masked row holding NaN or inf adds nothing.
        values = torch.where(attend[:, :, None], rows[None, :, : step.latent_dim], 0.0)
        result = torch.einsum("qhn,qnd->qhd", weights, values)
        result[~attend.any(-1)] = 0.0
        finite_rows = torch.isfinite(rows).all(-1)
        result[(attend & ~finite_rows[None, :]).any(-1)] = float("nan")
        out[start:end] = result
    return out


def megatron_core_append(
    config, yarn, rotary_seq_len, kv_latent, k_pos_emb, memory_buffer, index, decode_only
) -> None:
    """What megatron-core's MLASelfAttention does with cache_mla_latents in a dynamic step:
    rotate ``k_pos_emb`` through the context (``DynamicInferenceContext.apply_rotary_emb_key``),
    concatenate, append by indexed assignment (``append_key_value_cache``), into
    ``memory_buffer`` ([layers=1, blocks, block_size, width]).

    Args: megatron-core's MLA config and ``YarnRotaryEmbedding``, the rotary sequence length,
    [tokens, 1, width] inputs, the buffer, (positions, block_idx, block_offset) and whether the
    step is decode-only (megatron-core's two branches of the key RoPE).
    """
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    positions, block_idx, block_offset = index
    context = LatentCacheContextStandIn(
        memory_buffer, positions, block_idx, block_offset, decode_only
    )
    rotary_pos_emb, mscale = yarn(rotary_seq_len)
    k_pos_emb = torch.unsqueeze(k_pos_emb, -2)
    k_pos_emb = DynamicInferenceContext.apply_rotary_emb_key(
        context, k_pos_emb.clone(), rotary_pos_emb, config=config, cp_group=object(), mscale=mscale
    )
    kv_cached = torch.cat([kv_latent, k_pos_emb.squeeze(1)], dim=-1)
    DynamicInferenceContext.append_key_value_cache(context, 1, kv_cached, None)


def mla_rope_config(latent_dim: int = 512, rope_dim: int = 64):
    """A megatron-core MLA config with DeepSeek-V3's RoPE: yarn, factor 40, mscale 1 and
    mscale_all_dim 0 (so cos/sin carry an mscale of 1.37, not 1)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=1,
        hidden_size=128,
        num_attention_heads=2,
        kv_lora_rank=latent_dim,
        qk_pos_emb_head_dim=rope_dim,
        rope_type="yarn",
        apply_rope_fusion=False,
        rotary_scaling_factor=40.0,
        original_max_position_embeddings=64,
    )


class _Recorder:
    """Stands in for a kernel (``kernel[grid](...)``) or a
    :class:`~megatron_ext.fusions.direct_launch.KernelLaunches` (``launches(grid, args)``):
    records each launch's grid, then launches."""

    def __init__(self, launches, kernel):
        self.launches, self.kernel = launches, kernel

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]

    def __call__(self, grid, *args, **kwargs):
        self.launches.append(grid)
        return self.kernel(grid, *args, **kwargs)


def fresh_plan_caches(monkeypatch) -> None:
    """Empty plan caches for both latent-cache kernels, for the rest of the test."""
    from megatron_ext.fusions.mla_latent import attention, rope_cache_append

    monkeypatch.setattr(attention, "ATTENTION_PLANS", PlanCache())
    monkeypatch.setattr(rope_cache_append, "APPEND_PLANS", PlanCache())


def record_launches(monkeypatch, module, *kernels: str) -> list:
    """Record the launches of ``module``'s kernels or kernel launchers (by attribute name: where
    the plans read them when they are built); returns the list of grids."""
    launches = []
    for name in kernels:
        monkeypatch.setattr(module, name, _Recorder(launches, getattr(module, name)))
    # Cached plans launch what they were built with: fresh caches for the recorders.
    fresh_plan_caches(monkeypatch)
    return launches


def check_attention_step(
    step: Step, softmax_scale: float, tolerance: dict, poison: float = POISON, **kwargs
):
    """Run the paged attention on ``step`` into a guarded output filled with ``poison`` and
    assert that it matches :func:`attention_reference` within ``tolerance`` (NaN where it is
    NaN: pass a finite ``poison`` where NaN is expected), writes nothing outside the output and
    leaves every bit of the cache buffer (guards included) as it was.

    Returns:
        torch.Tensor: the output.
    """
    from megatron_ext.fusions.mla_latent import mla_paged_latent_attention

    tokens, heads, _ = step.query.shape
    out, out_buffer = guarded_tensor(
        (tokens, heads, step.latent_dim), step.query.dtype, step.query.device, poison
    )
    cache_before = step.cache_buffer.clone()
    returned = mla_paged_latent_attention(
        step.query,
        step.kv_cache,
        step.block_table,
        step.cu_query_lengths,
        step.kv_lengths,
        softmax_scale,
        rope_dim=step.rope_dim,
        out=out,
        **kwargs,
    )
    assert returned.data_ptr() == out.data_ptr()
    expected = attention_reference(step, softmax_scale)
    torch.testing.assert_close(out.double(), expected, equal_nan=True, **tolerance)
    assert guards_intact(out_buffer), "a write outside the output"
    # Bitwise (a cache may hold NaN on purpose).
    assert torch.equal(
        step.cache_buffer.view(torch.uint8), cache_before.view(torch.uint8)
    ), "the cache changed"
    return out


def layout_twins(kwargs: dict) -> dict:
    """``kwargs`` with each tensor replaced by one of the same layout (shape, strides, dtype,
    device) in memory of its own, filled with its values: the call a launch-plan cache keys
    alike, without the aliasing of the original."""
    twins = {}
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            twin = torch.empty_strided(
                value.shape, value.stride(), dtype=value.dtype, device=value.device
            )
            # An expanded view's twin is expanded too (and left unfilled: nothing to copy into).
            expanded = any(st == 0 and n > 1 for n, st in zip(value.shape, value.stride()))
            value = twin if expanded else twin.copy_(value)
        twins[name] = value
    return twins


def assert_refused_after_a_call_of_its_layout(function, module, launcher_names, case, monkeypatch):
    """A bad call ``case`` (name, kwargs, error, match) is refused before any launch also when a
    call of the same layout (:func:`layout_twins`) ran before it, so its plan is cached: what
    depends on the memory (outputs overlapping inputs) is checked on every call."""
    name, kwargs, error, match = case
    launches = record_launches(monkeypatch, module, *launcher_names)
    try:
        function(**layout_twins(kwargs))
    except (TypeError, ValueError):
        pass  # the layout itself is refused: nothing was cached
    del launches[:]
    cache = kwargs.get("kv_cache")
    before = cache.clone() if isinstance(cache, torch.Tensor) else None
    with pytest.raises(error, match=match):
        function(**kwargs)
    assert launches == [], name
    if before is not None:
        assert torch.equal(cache, before), name


def gluon_decode_refusal_here(device="cuda"):
    """Why a DeepSeek-V3 bf16 decode call on ``device`` (this GPU and Triton) would not take the
    Gluon decode kernel with its switch on; None if it would."""
    from megatron_ext.fusions.mla_latent import gluon_decode_refusal

    query = torch.empty(1, 128, 576, dtype=torch.bfloat16, device=device)
    kv_cache = torch.empty(1, 64, 576, dtype=torch.bfloat16, device=device)
    return gluon_decode_refusal(query, kv_cache, 512, 1, enabled=True)
