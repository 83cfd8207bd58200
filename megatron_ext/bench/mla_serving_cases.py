# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The work the MLA serving benchmark times: shapes, the bytes and FLOP models, paged steps laid
out as megatron-core's ``DynamicInferenceContext`` lays them out, megatron-core's unfused key
RoPE + cache append run through its own context methods, and FlashInfer's MLA wrapper on the same
cache contents.

Nothing here times anything (:mod:`megatron_ext.bench.mla_serving` does); everything builds on
any device, so the no-GPU check uses the same code at small sizes.
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_ext.testing.latent_cache_baseline import (
    LatentCacheContextStandIn,
    yarn_rotary_embedding,
)

# DeepSeek-V3's latent cache row: kv_lora_rank + qk_pos_emb_head_dim.
LATENT, ROPE = 512, 64
WIDTH = LATENT + ROPE
# megatron-core forces 64 for MLA ("Flash MLA requires a block size of 64").
BLOCK_SIZE = 64
# MLA's logit scale uses the unabsorbed head size (qk_head_dim 128 + rope 64); yarn's mscale**2 is
# 1 for DeepSeek-V3 (mscale == mscale_all_dim).
SOFTMAX_SCALE = (128 + ROPE) ** -0.5

DECODE_BATCHES = (1, 16, 64, 128, 256)
DECODE_CONTEXTS = (1024, 4096, 16384, 32768)
# Heads per GPU as DeepSeek-style models are served: 16 (tensor parallel 8), 32 and 64 (TP 4 and
# 2), 128 (data-parallel attention).
DECODE_HEADS = (16, 32, 64, 128)
QUICK_DECODE_BATCHES = (1, 64, 128)
QUICK_DECODE_CONTEXTS = (4096, 32768)
QUICK_DECODE_HEADS = (16, 128)
# (batch, context, heads) of decode steps as servers run them at each head count, off the grid.
SERVED_DECODE_SHAPES: Tuple[Tuple[int, int, int], ...] = (
    (48, 6144, 16),
    (256, 2048, 16),
    (128, 1024, 32),
    (64, 4096, 64),
    (32, 8192, 128),
    (96, 3072, 128),
)

# Prefill, chunked-prefill and mixed steps: (cached before the step, new tokens) per request,
# decodes first as megatron-core orders a step's requests.
PREFILL_CASES: Dict[str, List[Tuple[int, int]]] = {
    "prefill 2 x 1536": [(0, 1536)] * 2,
    "prefill 4k from empty": [(0, 4096)],
    "prefill 8k from empty": [(0, 8192)],
    "chunk 1k on 3k cached": [(3072, 1024)],
    "chunk 2k on 2k cached": [(2048, 2048)],
    "chunk 1k on 32k cached": [(32768, 1024)],
    "mixed: 8 decodes at 4k + a 512-token chunk on 1k": [(4095, 1)] * 8 + [(1024, 512)],
    "mixed: 63 decodes at 4k + a 512-token chunk on 1.5k": [(4095, 1)] * 63 + [(1536, 512)],
}
QUICK_PREFILL_CASES = (
    "prefill 2 x 1536",
    "chunk 1k on 3k cached",
    "mixed: 8 decodes at 4k + a 512-token chunk on 1k",
)
PREFILL_HEADS = (16, 128)

APPEND_TOKENS = (1, 16, 64, 256, 1024, 4096)
# megatron-core's key RoPE has two branches; steps of up to this many tokens are taken as
# decode-only (one token per request at decode batch sizes), larger ones as prefill steps.
DECODE_ONLY_MAX_TOKENS = 256
# Rows of the cos/sin tables (the context's rotary sequence length).
ROPE_POSITIONS = 32768
# megatron-core 0.16's per-token context tensors are int64.
INDEX_DTYPE = torch.int64

__all__ = [
    "PagedStep",
    "append_bytes",
    "attention_reference",
    "build_append",
    "build_step",
    "decode_requests",
    "paged_attention",
    "flashinfer_available",
    "step_bytes",
    "step_flops",
]


def decode_requests(batch: int, context: int) -> List[Tuple[int, int]]:
    """A decode step: ``batch`` requests with ``context`` rows each, the new token's included."""
    return [(context - 1, 1)] * batch


def step_bytes(
    requests: Sequence[Tuple[int, int]], heads: int, elt: int = 2, width: int = WIDTH
) -> Dict[str, int]:
    """Bytes one attention call moves.

    ``minimum``: each attended cache row read once (``(cached + new) x width x elt`` per request),
    the query read and the output written once: what the call must move at least, and the
    figure its share of the copy ceiling is computed from. ``kernel``: megatron_ext's kernel reads
    the rows once per head tile (:func:`megatron_ext.fusions.mla_latent.tile_rules.head_tile`;
    the L2 may serve some of the repeats), so this is its traffic at most, not counting the split-KV
    partials.

    Args:
        requests: (cached, new) per request.
        heads: query heads.
        elt: bytes per element.
        width: cache row width (latent + rope).

    Returns:
        Dict[str, int]: ``cache`` (rows once), ``query``, ``output``, ``minimum``, ``kernel``,
        ``head_tiles``.
    """
    rows = sum(cached + new for cached, new in requests)
    tokens = sum(new for _, new in requests)
    latent = width - ROPE
    cache = rows * width * elt
    query = tokens * heads * width * elt
    output = tokens * heads * latent * elt
    from megatron_ext.fusions.mla_latent import head_tile

    decode = all(new == 1 for _, new in requests)
    tiles = math.ceil(heads / head_tile(heads, decode, fp32=elt == 4))
    return {
        "cache": cache,
        "query": query,
        "output": output,
        "minimum": cache + query + output,
        "kernel": cache * tiles + query + output,
        "head_tiles": tiles,
    }


def step_flops(requests: Sequence[Tuple[int, int]], heads: int, width: int = WIDTH) -> int:
    """FLOPs of one absorbed attention call, counting only attended (causal) pairs: per head and
    attended row, ``width`` multiply-adds for the logit and ``width - ROPE`` for the value."""
    pairs = sum(new * cached + new * (new + 1) // 2 for cached, new in requests)
    return 2 * heads * pairs * (width + width - ROPE)


def append_bytes(tokens: int, elt: int = 2, index_bytes: int = 8, width: int = WIDTH) -> int:
    """Bytes the key RoPE + append must move per step: the latent and k_pe read, each token's
    cos and sin rows read, its position, block and offset read, and its cache row written."""
    latent = width - ROPE
    per_token = (latent + ROPE + 2 * ROPE + width) * elt + 3 * index_bytes
    return tokens * per_token


@dataclass
class PagedStep:
    """One dynamic-batching step's attention inputs over one layer's paged latent cache."""

    query: torch.Tensor  # [tokens, heads, latent + rope]
    kv_cache: torch.Tensor  # [blocks, block_size, latent + rope]
    block_table: torch.Tensor  # [requests, max blocks] int32, -1 where unused
    cu_query_lengths: torch.Tensor  # [requests + 1] int32
    kv_lengths: torch.Tensor  # [requests] int32
    requests: List[Tuple[int, int]]
    max_query_len: int
    latent: int
    rope: int


def build_step(
    requests: Sequence[Tuple[int, int]],
    heads: int,
    *,
    latent: int = LATENT,
    rope: int = ROPE,
    block_size: int = BLOCK_SIZE,
    dtype: torch.dtype = torch.bfloat16,
    device="cuda",
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedStep:
    """A step with ``requests`` = [(cached, new), ...] and random cache rows and queries.

    The blocks are handed out in a shuffled order among a few unused ones, so no request's pages
    are contiguous or ordered, as in a cache that has served many requests.
    """
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-(cached + new) // block_size) for cached, new in requests]
    num_blocks = sum(counts) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.full((len(requests), max(counts)), -1, dtype=torch.int32)
    used = 0
    for r, count in enumerate(counts):
        table[r, :count] = order[used : used + count]
        used += count
    news = torch.tensor([new for _, new in requests], dtype=torch.int64)
    cu = torch.zeros(len(requests) + 1, dtype=torch.int32)
    cu[1:] = news.cumsum(0).to(torch.int32)
    kv = torch.tensor([cached + new for cached, new in requests], dtype=torch.int32)
    width = latent + rope
    device_gen = torch.Generator(device=device).manual_seed(seed + 1)
    cache = torch.randn(
        num_blocks, block_size, width, generator=device_gen, device=device, dtype=dtype
    )
    query = torch.randn(
        int(news.sum()), heads, width, generator=device_gen, device=device, dtype=dtype
    )
    return PagedStep(
        query=query,
        kv_cache=cache,
        block_table=table.to(device),
        cu_query_lengths=cu.to(device),
        kv_lengths=kv.to(device),
        requests=list(requests),
        max_query_len=max(new for _, new in requests),
        latent=latent,
        rope=rope,
    )


def paged_attention(
    step: PagedStep, kv_cache: torch.Tensor, query: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """megatron_ext's attention of ``step`` (its block table and lengths) on ``kv_cache`` and
    ``query`` (the step's own or copies of them), into ``out``."""
    from megatron_ext.fusions.mla_latent import mla_paged_latent_attention

    return mla_paged_latent_attention(
        query,
        kv_cache,
        step.block_table,
        step.cu_query_lengths,
        step.kv_lengths,
        SOFTMAX_SCALE,
        rope_dim=step.rope,
        max_query_len=step.max_query_len,
        out=out,
    )


def step_plan(step: PagedStep, out: torch.Tensor, kernel: str):
    """The launcher's plan for ``step`` on the kernel named (the public entry's plan cache chooses
    one kernel per layout; a benchmark times both).

    Args:
        step: the step (its block table and lengths).
        out: an output of the step's layout.
        kernel: ``"gluon"`` or ``"stage1"``.

    Returns:
        LatentAttentionPlan: the plan.

    Raises:
        ValueError: where the kernel does not take the step (the reason in the message).
    """
    from megatron_ext.fusions.mla_latent import plan_for_call

    return plan_for_call(
        step.query,
        step.kv_cache,
        step.block_table,
        step.cu_query_lengths,
        step.kv_lengths,
        SOFTMAX_SCALE,
        out,
        latent_dim=step.latent,
        max_query_len=step.max_query_len,
        num_kv_splits=None,
        kernel=kernel,
    )


def planned_attention(
    step: PagedStep, out: torch.Tensor, kernel: str
) -> Tuple[Callable[..., torch.Tensor], int]:
    """megatron_ext's attention of ``step`` on the kernel named, through :func:`step_plan`.

    Args:
        step: the step (its block table and lengths).
        out: an output of the step's layout.
        kernel: ``"gluon"`` or ``"stage1"``.

    Returns:
        Tuple[Callable, int]: ``call(kv_cache, query, out)`` and the plan's split count.

    Raises:
        ValueError: where the kernel does not take the step (the reason in the message).
    """
    plan = step_plan(step, out, kernel)

    def call(kv_cache: torch.Tensor, query: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        plan(query, kv_cache, step.block_table, step.cu_query_lengths, step.kv_lengths, out)
        return out

    return call, plan.workspace[0][1] if plan.workspace else 1


def attention_reference(step: PagedStep, softmax_scale: float) -> torch.Tensor:
    """The step's attention in float64, each request's rows gathered through the block table."""
    cache = step.kv_cache.double()
    block_size = cache.shape[1]
    cu = step.cu_query_lengths.tolist()
    out = torch.zeros(*step.query.shape[:2], step.latent, dtype=torch.float64)
    for r, (cached, new) in enumerate(step.requests):
        keys = torch.arange(cached + new)
        blocks = step.block_table[r].long().cpu()[keys // block_size]
        rows = cache.cpu()[blocks, keys % block_size]  # [keys, width]
        q = step.query[cu[r] : cu[r + 1]].double().cpu()
        scores = torch.einsum("qhd,nd->qhn", q, rows) * softmax_scale
        positions = cached + torch.arange(new)
        scores = scores.masked_fill((keys[None, :] > positions[:, None])[:, None, :], -math.inf)
        out[cu[r] : cu[r + 1]] = torch.einsum(
            "qhn,nd->qhd", scores.softmax(-1), rows[:, : step.latent]
        )
    return out


def flashinfer_available() -> Tuple[bool, str]:
    """Whether ``import flashinfer`` works, and its version or the import error."""
    try:
        import flashinfer
    except Exception as error:  # an ImportError, or a broken install failing at import
        return False, f"{type(error).__name__}: {error}"
    return True, str(getattr(flashinfer, "__version__", "unknown version"))


class FlashInferMLA:
    """FlashInfer's ``BatchMLAPagedAttentionWrapper`` planned for one step.

    FlashInfer 0.7.4 and later (``flashinfer.mla.MLAPlanMetadata``): planned by keyword over CSR
    metadata with its packed layouts, so it reads the step's own tensors as megatron-core holds
    them (cache rows ``[latent | rope]``, 576 wide; query likewise), as ours does. Older releases:
    the positional plan, and ``run`` on contiguous copies of the cache split into ``ckv``
    [blocks, block_size, latent] and ``kpe`` [.., rope] and of the query split likewise.

    ``plan`` (once per step in a server, shared by the layers; it copies the lengths to the host)
    runs here, outside any timing; ``run`` is what is timed.
    """

    WORKSPACE_BYTES = 256 << 20

    def __init__(self, step: PagedStep, heads: int, softmax_scale: float, causal: bool):
        import flashinfer

        device = step.kv_cache.device
        block_size = step.kv_cache.shape[1]
        counts = [-(-(cached + new) // block_size) for cached, new in step.requests]
        kv_indptr = torch.zeros(len(counts) + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
        table = step.block_table.cpu()
        kv_indices = torch.cat([table[r, :count] for r, count in enumerate(counts)])
        self.workspace = torch.empty(self.WORKSPACE_BYTES, dtype=torch.int8, device=device)
        self.wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(self.workspace)
        csr = (
            step.cu_query_lengths.to(torch.int32),
            kv_indptr.to(device),
            kv_indices.to(device),
            step.kv_lengths.to(torch.int32),
        )
        metadata = getattr(flashinfer.mla, "MLAPlanMetadata", None)
        self.packed = metadata is not None
        sizes = dict(
            num_heads=heads,
            head_dim_ckv=step.latent,
            head_dim_kpe=step.rope,
            page_size=block_size,
            causal=causal,
            sm_scale=softmax_scale,
            q_data_type=step.query.dtype,
            kv_data_type=step.kv_cache.dtype,
        )
        if self.packed:
            self.wrapper.plan(
                metadata=metadata.csr(*csr),
                **sizes,
                query_layout="packed",
                kv_cache_layout="packed",
            )
        else:
            # Before 0.7.4 the plan took these positionally, in this order.
            self.wrapper.plan(*csr, *sizes.values())
        self.latent = step.latent

    def inputs(self, kv_cache: torch.Tensor, query: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """``run``'s arguments for this cache and query, the output last: (query, kv_cache, out)
        with the packed layouts; else (q_nope, q_pe, ckv, kpe, out), contiguous copies."""
        lat = self.latent
        out = torch.empty_like(query[..., :lat])
        if self.packed:
            return query, kv_cache, out
        parts = (query[..., :lat], query[..., lat:], kv_cache[..., :lat], kv_cache[..., lat:])
        return (*(part.contiguous() for part in parts), out)

    def run(self, *inputs: torch.Tensor) -> torch.Tensor:
        """One attention call into the output (the last of ``inputs``)."""
        if self.packed:
            query, kv_cache, out = inputs
            return self.wrapper.run(query=query, kv_cache=kv_cache, out=out)
        return self.wrapper.run(*inputs[:4], out=inputs[4])


# --- the key RoPE + append -----------------------------------------------------------------------


def rope_config(latent: int = LATENT, rope: int = ROPE):
    """A megatron-core MLA config with DeepSeek-V3's RoPE (yarn, factor 40, mscale and
    mscale_all_dim 1, so cos/sin carry an mscale of 1), RoPE fusion off as inference needs."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=1,
        hidden_size=128,
        num_attention_heads=2,
        kv_lora_rank=latent,
        qk_pos_emb_head_dim=rope,
        rope_type="yarn",
        apply_rope_fusion=False,
        rotary_scaling_factor=40.0,
        original_max_position_embeddings=4096,
        mscale=1.0,
        mscale_all_dim=1.0,
    )


@contextmanager
def _rope_module_device(device: torch.device) -> Iterator[None]:
    """megatron-core's ``YarnRotaryEmbedding`` puts its frequencies on
    ``torch.cuda.current_device()``; on a CPU-only machine that answers "cpu" meanwhile."""
    if device.type == "cuda":
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved


@dataclass
class AppendStep:
    """One step's key RoPE + append: inputs, context indices, tables and the layer's cache."""

    kv_latent: torch.Tensor  # [tokens, 1, latent]
    k_pos_emb: torch.Tensor  # [tokens, 1, rope], pairs interleaved
    positions: torch.Tensor  # [tokens] INDEX_DTYPE
    block_idx: torch.Tensor
    block_offset: torch.Tensor
    memory_buffer: torch.Tensor  # [layers=1, blocks, block_size, width]
    freqs: torch.Tensor  # megatron-core's rotary embedding [positions, 1, 1, rope]
    mscale: float
    cos: torch.Tensor  # the fused kernel's tables, megatron-core's get_cached_cos_sin
    sin: torch.Tensor
    config: object
    decode_only: bool


def build_append(
    tokens: int,
    *,
    latent: int = LATENT,
    rope: int = ROPE,
    positions: int = ROPE_POSITIONS,
    block_size: int = BLOCK_SIZE,
    dtype: torch.dtype = torch.bfloat16,
    device="cuda",
    seed: int = 0,
) -> AppendStep:
    """``tokens`` new tokens at random positions, each written to its own row of a cache twice as
    large as needed (rows shuffled, as the allocator hands them out)."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    blocks = max(2, -(-2 * tokens // block_size))
    rows = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    config = rope_config(latent, rope)
    with _rope_module_device(device):
        yarn = yarn_rotary_embedding(config)
        freqs, mscale = yarn(positions)
        cos, sin = yarn.get_cached_cos_sin(positions, dtype=dtype)
    to = lambda x: x.to(device)  # noqa: E731
    return AppendStep(
        kv_latent=to(torch.randn(tokens, 1, latent, generator=gen).to(dtype)),
        k_pos_emb=to(torch.randn(tokens, 1, rope, generator=gen).to(dtype)),
        positions=to(torch.randint(0, positions, (tokens,), generator=gen).to(INDEX_DTYPE)),
        block_idx=to((rows // block_size).to(INDEX_DTYPE)),
        block_offset=to((rows % block_size).to(INDEX_DTYPE)),
        memory_buffer=to(
            torch.randn(1, blocks, block_size, latent + rope, generator=gen).to(dtype)
        ),
        freqs=freqs,
        mscale=mscale,
        cos=cos,
        sin=sin,
        config=config,
        decode_only=tokens <= DECODE_ONLY_MAX_TOKENS,
    )


def megatron_core_append(
    step: AppendStep, kv_latent: torch.Tensor, k_pos_emb: torch.Tensor, memory_buffer=None
) -> None:
    """megatron-core's path, as ``MLASelfAttention`` runs it with ``cache_mla_latents`` in a
    dynamic step: ``DynamicInferenceContext.apply_rotary_emb_key`` (cos/sin gathered by position,
    the unfused torch RoPE; in place on the input outside decode-only steps, as there), the
    ``torch.cat`` behind the latent, and ``append_key_value_cache`` (indexed assignment).

    Args:
        step: the step (indices, tables, config).
        kv_latent: [tokens, 1, latent].
        k_pos_emb: [tokens, 1, rope].
        memory_buffer: the cache to write (default: the step's).
    """
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    buffer = step.memory_buffer if memory_buffer is None else memory_buffer
    context = LatentCacheContextStandIn(
        buffer, step.positions, step.block_idx, step.block_offset, step.decode_only
    )
    key = DynamicInferenceContext.apply_rotary_emb_key(
        context,
        torch.unsqueeze(k_pos_emb, -2),
        step.freqs,
        config=step.config,
        cp_group=_NO_CONTEXT_PARALLEL,
        mscale=step.mscale,
    )
    kv_cached = torch.cat([kv_latent, key.squeeze(1)], dim=-1)
    DynamicInferenceContext.append_key_value_cache(context, 1, kv_cached, None)


# The bshd RoPE never reads the context-parallel group; a placeholder keeps megatron-core from
# asking its parallel state for one (which needs torch.distributed).
_NO_CONTEXT_PARALLEL = object()


def fused_append(
    step: AppendStep,
    kv_latent: torch.Tensor,
    k_pos_emb: torch.Tensor,
    memory_buffer: Optional[torch.Tensor] = None,
) -> None:
    """megatron_ext's ``fused_mla_rope_cache_append`` on the same step."""
    from megatron_ext.fusions.mla_latent import fused_mla_rope_cache_append

    buffer = step.memory_buffer if memory_buffer is None else memory_buffer
    fused_mla_rope_cache_append(
        kv_latent,
        k_pos_emb,
        step.cos,
        step.sin,
        step.positions,
        buffer[0],
        step.block_idx,
        step.block_offset,
    )
