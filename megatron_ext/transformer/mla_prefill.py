# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The MHA form of MLA attention for the prefill and chunked-prefill requests of a dynamic step.

:func:`~megatron_ext.transformer.mla_dynamic_inference.mla_dynamic_attention` hands each step's
attention split here first (:func:`mha_form_split`); where it returns None the step runs in the
absorbed form as before. Otherwise the step's requests are split in two: the leading ones (the
decodes megatron-core puts first, short chunks) in the absorbed form, the rest in the MHA form
(:func:`~megatron_ext.fusions.mla_latent.mha_form.mla_paged_mha_attention`), at the split point
the cost model (:class:`CostModel`) finds cheapest.

When the MHA form runs (each rule decided in one function):

* the mode, :data:`MODE` (environment ``MEGATRON_EXT_MLA_MHA_FORM``): ``off`` (the default:
  always absorbed, the form the engine's golden values are taken in; ``auto`` moves prefill
  bits), ``auto`` (the cost model decides) or ``force`` (every request of every prefill step in
  the MHA form, the tests' switch; the plain-torch backend where no fused one runs);
* the backend, :func:`backend_for` (override ``MEGATRON_EXT_MLA_MHA_BACKEND``): on CUDA in bf16 or
  fp16, torch's ragged FlashAttention where torch has it, its SDPA switch is on and a check call
  on the (sm80+) device runs and agrees with plain torch, else Transformer Engine's fused
  attention where TE is installed, else torch's ragged cuDNN attention on the same terms
  (sm90+); otherwise (CPU, fp32, the Triton interpreter) none in ``auto`` mode, so CPU runs
  stay absorbed. Where the rule reaches ``flash``, torch's dense cuDNN attention
  (``cudnn-dense``) stands in for it where that runs too: batched by bucketed length, twice
  FlashAttention-2's speed on fresh prefills; a chunk behind cached rows runs as an unmasked
  call over those rows and a square causal one over its own, merged by their log-sum-exps;
* never in a step megatron-core runs from a CUDA graph or while a stream is capturing
  (:func:`graphed_step`): the MHA form sizes its tensors from the step's lengths, read on the
  host. megatron-core 0.16 captures decode-only steps (and, with
  ``use_cuda_graphs_for_non_decode_steps``, mixed steps of fixed token counts without an explicit
  chunked prefill); 0.19 captures decode-only and mixed steps up to ``cuda_graph_max_tokens``
  (512 by default) tokens and runs larger steps eagerly. Those eager steps are where prefills
  and long chunks land;
* never in decode-only steps (the MHA form never pays there);
* never for a softmax scale above
  :data:`~megatron_ext.fusions.mla_latent.checks.MHA_MAX_SOFTMAX_SCALE` (about 0.35; DeepSeek-V3's
  is about 0.14): the MHA form's backends scale each logit before subtracting the row maximum,
  which can overflow past it, where the absorbed kernel keeps such logits in raw units.

Where a chunk's calls are merged (cuDNN: over the cached rows, over the chunk's own rows), they run
side by side on two streams only with :data:`OVERLAP_CALLS` (environment
``MEGATRON_EXT_MLA_MHA_OVERLAP=on``; ``off`` by default): on an H100 that cut the GPU time of a
16-head mixed step by 15-18% but added about 105 us of host time per call, and these steps run
eagerly, bound by their host time at 16 heads.

The host lengths (:func:`step_lengths`): on 0.19 the request bookkeeping is host memory, read
without synchronisation; on 0.16 it lives on the GPU and is read once per step (eager steps
only), kept while the tensors' in-place write counters say it is current.
"""

import contextlib
import dataclasses
import os
import threading
import warnings
import weakref
from typing import Any, Dict, Iterator, NamedTuple, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from megatron_ext import internals
from megatron_ext.fusions.launch_plans import PlanCache
from megatron_ext.fusions.mla_latent import mha_form
from megatron_ext.fusions.mla_latent.checks import MHA_MAX_SOFTMAX_SCALE
from megatron_ext.fusions.mla_latent.mha_form import BACKENDS, mla_paged_mha_attention

__all__ = [
    "BACKEND",
    "COST_MODEL",
    "COST_MODELS",
    "MODE",
    "CostModel",
    "MhaFormSplit",
    "absorbed_request_count",
    "backend_for",
    "graphed_step",
    "mha_form_core",
    "mha_form_mode",
    "mha_form_split",
    "step_lengths",
    "step_split",
]

MODES = ("auto", "off", "force")


def _env_choice(name: str, default: str, choices: Tuple[str, ...]) -> str:
    """An environment setting among ``choices``; a misspelt value fails at import rather than
    silently meaning the default."""
    value = os.environ.get(name, default).strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}={os.environ[name]!r}: expected one of {', '.join(choices)}")
    return value


MODE = _env_choice("MEGATRON_EXT_MLA_MHA_FORM", "off", MODES)
BACKEND = _env_choice("MEGATRON_EXT_MLA_MHA_BACKEND", "auto", ("auto",) + tuple(BACKENDS))
OVERLAP_CALLS = _env_choice("MEGATRON_EXT_MLA_MHA_OVERLAP", "off", ("on", "off")) == "on"


@contextlib.contextmanager
def mha_form_mode(mode: str) -> Iterator[None]:
    """Run the block with :data:`MODE` set to ``mode``, as the environment setting would
    (process-wide: for benchmarks and tests that compare the forms in one process, not while
    another thread runs steps).

    Args:
        mode: one of :data:`MODES`.

    Raises:
        ValueError: for another mode, before anything changes.
    """
    global MODE
    if mode not in MODES:
        raise ValueError(f"MHA-form mode {mode!r}: expected one of {', '.join(MODES)}")
    previous, MODE = MODE, mode
    try:
        yield
    finally:
        MODE = previous


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Time of one layer's attention per form, from static sizes.

    Per head, with latent width ``c``, RoPE ``r``, query/key ``d`` and value ``v`` widths: the
    absorbed form pays ``2 (c + r) + 2 c`` FLOPs per query-key pair (2176 at DeepSeek-V3's widths)
    and ``2 d c + 2 c v`` per query (W_UK into the query, W_UV after: 262144); the MHA form pays
    ``2 (d + r) + 2 v`` per pair (640) and ``2 c (d + v)`` per attended row (the decompression
    GEMM: 262144). The MHA form's host time (its planning and launches, per layer and again per
    chunk of attended rows past the first: it decompresses at most
    :data:`~megatron_ext.fusions.mla_latent.mha_form.ROW_BUDGET` rows at a time) overlaps its GPU
    work and the absorbed part's, so a step's attention costs the larger of the two. A request
    with ``q`` new tokens and ``L`` rows has ``q (L - q) + q (q + 1) / 2`` pairs.

    Attributes:
        absorbed_flops: the absorbed kernel's attention FLOP/s.
        mha_flops: the dense backend's attention FLOP/s (real FLOPs: 640 per pair and head).
        gemm_flops: the absorbed form's absorption GEMMs' FLOP/s.
        decompress_flops: the MHA form's decompression FLOP/s (262144 per row and head), its
            copies included.
        mha_fixed_seconds: the MHA form's host time per layer.
        mha_chunk_seconds: the MHA form's host time per extra chunk of rows.
        absorbed_row_seconds: the absorbed kernel's time per attended row of one program, the
            floor of a launch that holds a request of more than one new token: such a launch
            runs prefill tiles without splitting the keys, so each request's longest rows are
            one program's serial loop (a 4k decode beside a chunk takes about 0.39 ms at 16
            heads, whatever the FLOPs).
    """

    absorbed_flops: float = 170e12
    mha_flops: float = 220e12
    gemm_flops: float = 600e12
    decompress_flops: float = 300e12
    mha_fixed_seconds: float = 900e-6
    mha_chunk_seconds: float = 600e-6
    absorbed_row_seconds: float = 96e-9


# Per backend, fitted to eager calls on an H100 (torch 2.11; 16 and 128 heads, prefills of
# 2 x 1536 to 8192 tokens, chunks of 1024 behind 0-32k rows), the step's plan kept across layers
# and the decompression weights kept across steps. ``flash``: FlashAttention-2 runs 220-255
# TFLOP/s of real FLOPs at head size 192; the decompression GEMMs and the copy of the output out
# of its padded value columns 270 TFLOP/s of decompression FLOPs; 0.31-0.46 ms of host time per
# call. ``cudnn-dense`` (in FlashAttention's place: :func:`backend_for`), with the rows' gather
# in one kernel and a chunk's first call standing as the merge's accumulator: 484-510 TFLOP/s of
# real FLOPs at 128 heads (attention and decompression together; prefills of 2 x 1536, chunks of
# 1k on 3k; 328-387 at 16 heads, where the host bounds the call), 0.18-0.31 ms of host time per
# call (a fresh prefill, a chunk). The cost of an extra chunk of rows (0.6 ms) was measured before
# the plan was kept and is an upper bound. ``cudnn``: torch's ragged cuDNN entry rebuilds its
# cuDNN graph on every call (62-174 ms measured on that H100), which this fixed cost keeps out of
# any step. ``te``: not measured; cuDNN's fused-attention rate.
COST_MODELS: Dict[str, CostModel] = {
    "flash": CostModel(decompress_flops=270e12, mha_fixed_seconds=450e-6),
    "te": CostModel(mha_flops=450e12, decompress_flops=440e12, mha_fixed_seconds=450e-6),
    "cudnn": CostModel(mha_fixed_seconds=60e-3),
    "cudnn-dense": CostModel(mha_flops=500e12, decompress_flops=480e12, mha_fixed_seconds=310e-6),
}
COST_MODEL = COST_MODELS["flash"]


# Splits by everything they depend on (the lengths' values, heads, widths, rates, row budget):
# every layer of a step asks with the same (once per backend it weighs), and the cost model is
# some twenty numpy operations and a loop over the requests.
_SPLITS: PlanCache = PlanCache(max_entries=64)


def absorbed_request_count(
    query_lengths: np.ndarray,
    kv_lengths: np.ndarray,
    heads: int,
    widths: Tuple[int, int, int, int],
    model: CostModel = COST_MODEL,
) -> int:
    """How many leading requests to run in the absorbed form (the rest in the MHA form),
    worked out once per step's lengths and kept for its other layers.

    Args:
        query_lengths, kv_lengths: the step's new tokens and rows per request (host).
        heads: query heads on this rank.
        widths: (latent, rope, qk, v) head widths.
        model: the rates.

    Returns:
        int: ``s`` in ``0..requests``; ``requests`` means all absorbed. Of splits the host
        bounds alike, the one with less GPU work; exact ties go to the absorbed form.
    """
    key = (
        query_lengths.dtype.str,
        query_lengths.tobytes(),
        kv_lengths.dtype.str,
        kv_lengths.tobytes(),
        heads,
        widths,
        model,
        mha_form.ROW_BUDGET,
    )
    split = _SPLITS.get(key)
    if split is None:
        split = _SPLITS.put(key, _cheapest_split(query_lengths, kv_lengths, heads, widths, model))
    return split


def _cheapest_split(
    query_lengths: np.ndarray,
    kv_lengths: np.ndarray,
    heads: int,
    widths: Tuple[int, int, int, int],
    model: CostModel,
) -> int:
    """:func:`absorbed_request_count`'s cost model, worked out."""
    latent, rope, qk, v = widths
    q = query_lengths.astype(np.float64)
    rows = kv_lengths.astype(np.float64)
    pairs = q * (rows - q) + q * (q + 1) / 2
    absorbed = heads * (
        pairs * (2 * (latent + rope) + 2 * latent) / model.absorbed_flops
        + q * (2 * qk * latent + 2 * latent * v) / model.gemm_flops
    )
    mha = heads * (
        pairs * (2 * (qk + rope) + 2 * v) / model.mha_flops
        + rows * (2 * latent * (qk + v)) / model.decompress_flops
    )
    n = len(q)
    # cost(s) = max(absorbed[:s].sum() + mha[s:].sum(), the MHA form's host time: its fixed cost
    # and one per extra chunk) if s < n: the host plans the MHA part while the GPU runs the
    # absorbed part and the MHA part's earlier launches
    before = np.concatenate([[0.0], np.cumsum(absorbed)])
    # The absorbed launch of requests [0, s) has a floor where one of them has more than one new
    # token (CostModel.absorbed_row_seconds); a launch of decodes alone splits its keys.
    prefill_tiles = np.concatenate([[False], np.maximum.accumulate(q) > 1])
    longest = np.concatenate([[0.0], np.maximum.accumulate(rows)])
    before = np.maximum(before, np.where(prefill_tiles, longest * model.absorbed_row_seconds, 0))
    after = np.concatenate([np.cumsum(mha[::-1])[::-1], [0.0]])
    mha_rows = np.concatenate([np.cumsum(np.where(q > 0, rows, 0.0)[::-1])[::-1], [0.0]])
    chunks = np.maximum(np.ceil(mha_rows / mha_form.ROW_BUDGET), 1.0)
    host = model.mha_fixed_seconds + (chunks - 1) * model.mha_chunk_seconds
    gpu = before + np.where(np.arange(n + 1) < n, after, 0.0)
    cost = np.where(np.arange(n + 1) < n, np.maximum(gpu, host), before)
    # Where the host bounds two splits alike, the one with less GPU work: it leaves the GPU to
    # the step's other work sooner.
    best = n
    for s in range(n - 1, -1, -1):
        if (cost[s], gpu[s]) < (cost[best], gpu[best]):
            best = s
    return best


_DEVICE_SUPPORT: dict = {}
_DEVICE_SUPPORT_LOCK = threading.Lock()
_TE_PRESENT: list = []


def _decide_fused(backend: str, index: int) -> bool:
    """The once-per-device part of :func:`_fused_usable`, under the lock (one check call per
    backend and device, however many threads step at once)."""
    with _DEVICE_SUPPORT_LOCK:
        usable = _DEVICE_SUPPORT.get((backend, index))
        if usable is not None:
            return usable
        # torch's ragged cuDNN attention needs sm90, as torch's own nested-tensor rule for it;
        # FlashAttention and dense cuDNN sm80.
        floor = (9, 0) if backend == "cudnn" else (8, 0)
        usable = (
            backend in mha_form.present_backends()
            and (backend == "flash" or torch.backends.cudnn.is_available())
            and torch.cuda.get_device_capability(index) >= floor
        )
        if usable:
            problem = mha_form.ragged_check(backend, torch.device("cuda", index))
            if problem is not None:
                warnings.warn(
                    f"megatron_ext: the MHA form does not use its {backend} backend on "
                    f"cuda:{index}: {problem}",
                    stacklevel=3,
                )
                usable = False
        _DEVICE_SUPPORT[(backend, index)] = usable
        return usable


def _fused_usable(backend: str, device: torch.device) -> bool:
    """Whether torch's ``backend`` entry (one of
    :data:`~megatron_ext.fusions.mla_latent.mha_form.CHECKED_BACKENDS`) runs the MHA form on
    ``device``: decided once per device (the GPU generation and a check call that must run and
    agree with plain torch), then whether torch's SDPA switches for the entries it calls
    (``torch.backends.cuda.<name>_sdp_enabled``) are on now: the user's, read on every call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    usable = _DEVICE_SUPPORT.get((backend, index))
    if usable is None:
        usable = _decide_fused(backend, index)
    # Dense cuDNN stands in for FlashAttention (backend_for): a user who turned either off
    # gets neither.
    switches = ("cudnn", "flash") if backend == "cudnn-dense" else (backend,)
    return usable and all(getattr(torch.backends.cuda, f"{s}_sdp_enabled")() for s in switches)


def _te_present() -> bool:
    if not _TE_PRESENT:
        try:
            import transformer_engine.pytorch  # noqa: F401

            _TE_PRESENT.append(True)
        except Exception:  # noqa: BLE001 (any import failure: not usable)
            _TE_PRESENT.append(False)
    return _TE_PRESENT[0]


def backend_for(
    device: torch.device,
    dtype: torch.dtype,
    mode: str = "auto",
    head_dim: Optional[int] = None,
) -> Optional[str]:
    """The MHA form's backend for tensors on ``device`` in ``dtype``, or None (absorbed form).

    The rule: on CUDA in bf16/fp16, :data:`BACKEND` if it names one that runs there, else torch's
    FlashAttention entry where usable (and the head size fits it), with torch's dense cuDNN entry
    standing in for it where that runs too (twice its speed on prefills and chunks:
    :data:`COST_MODELS`), else Transformer Engine where installed, else torch's cuDNN entry where
    usable; anywhere else none, except in ``force`` mode, which takes the plain-torch backend. A
    backend's once-per-device check runs only when the rule reaches it.

    Args:
        device: the step's device.
        dtype: the step's activation dtype.
        mode: the MHA form's mode (:data:`MODE`).
        head_dim: the head size the ``flash`` backend would run at
            (:func:`~megatron_ext.fusions.mla_latent.mha_form.flash_head_dim`); None: not known.

    Returns:
        Optional[str]: one of :data:`~megatron_ext.fusions.mla_latent.mha_form.BACKENDS`.
    """
    fused_ok = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)

    def available(backend: str) -> bool:
        if backend in ("torch", "torch-bottom-right"):
            return True
        if not fused_ok:
            return False
        if backend == "te":
            return _te_present()
        if backend in ("flash", "cudnn-dense") and (head_dim or 0) > mha_form.FLASH_MAX_HEAD_DIM:
            return False
        return _fused_usable(backend, device)

    if BACKEND in BACKENDS:
        return BACKEND if available(BACKEND) else None
    # cuDNN last: torch's ragged cuDNN entry builds its cuDNN graph on every call without keeping
    # it in the releases the README installs (62-174 ms for one prefill step's attention,
    # measured with torch 2.11 on an H100, where the absorbed form takes 0.6-5.7 ms);
    # FlashAttention builds no plan.
    for backend in ("flash", "te", "cudnn"):
        if available(backend):
            # Dense cuDNN stands in for FlashAttention only: it needs both SDPA switches.
            if backend == "flash" and available("cudnn-dense"):
                return "cudnn-dense"
            return backend
    return "torch" if mode == "force" else None


def graphed_step(context: Any) -> bool:
    """Whether this step runs from (or is being captured into) a CUDA graph: the one place that
    keeps the MHA form, which reads lengths on the host, out of graphs."""
    using = getattr(context, "using_cuda_graph_this_step", None)
    if callable(using) and using():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_LENGTHS_LOCK = threading.Lock()
_LENGTHS_CACHE: list = []  # [(key, weak references to the buffers, (query, kv) lengths)]


def step_lengths(context: Any) -> Tuple[np.ndarray, np.ndarray]:
    """The step's new tokens and cached rows (new ones included) per active request, on the
    host, in the order of the attention metadata.

    Args:
        context: a ``DynamicInferenceContext`` whose attention state is initialised.

    Returns:
        Tuple[np.ndarray, np.ndarray]: int64 query and KV lengths.
    """
    paused, total = int(context.paused_request_count), int(context.total_request_count)
    query_buffer = context.request_query_lengths
    offset_buffer = context.request_kv_length_offsets
    # Each step's attention metadata is a new dict on both releases: held (so its id is not
    # reused) and compared by identity, beside the buffers' write counters.
    metadata = getattr(context, "active_attn_metadata", None) or {}
    state = getattr(metadata.get("mha_metadata"), "state_data", None)
    key = (
        state,
        id(query_buffer),
        internals.tensor_version(query_buffer),
        id(offset_buffer),
        internals.tensor_version(offset_buffer),
        paused,
        total,
    )
    with _LENGTHS_LOCK:
        if _LENGTHS_CACHE:
            cached_key, refs, lengths = _LENGTHS_CACHE[0]
            same = cached_key[0] is key[0] and cached_key[1:] == key[1:]
            if same and refs[0]() is query_buffer and refs[1]() is offset_buffer:
                return lengths
    query = query_buffer[paused:total]
    rows = offset_buffer[paused:total] + query
    # On 0.19 these are host tensors; on 0.16 this is the step's one device-to-host read.
    lengths = (
        query.to("cpu").numpy().astype(np.int64),
        rows.to("cpu").numpy().astype(np.int64),
    )
    with _LENGTHS_LOCK:
        _LENGTHS_CACHE[:] = [
            (key, (weakref.ref(query_buffer), weakref.ref(offset_buffer)), lengths)
        ]
    return lengths


class MhaFormSplit(NamedTuple):
    """How a step's requests divide between the two forms (:func:`mha_form_split`).

    Attributes:
        backend: the MHA form's backend.
        query_lengths: every request's new tokens (host).
        kv_lengths: every request's attended rows, the new ones included (host).
        absorbed_requests: the leading requests taken by the absorbed form.
        absorbed_tokens: their tokens (the step's first rows).
        absorbed_max_query_len: their longest new-token count (1 where there are none).
    """

    backend: str
    query_lengths: np.ndarray
    kv_lengths: np.ndarray
    absorbed_requests: int
    absorbed_tokens: int
    absorbed_max_query_len: int


def step_split(
    query_lengths: np.ndarray,
    kv_lengths: np.ndarray,
    heads: int,
    widths: Tuple[int, int, int, int],
    backend: str,
) -> int:
    """How many leading requests of a step stay absorbed: the cost model's split at
    ``backend``'s rates (:func:`absorbed_request_count`; none in ``force`` mode).

    Args:
        query_lengths, kv_lengths: new tokens and rows per request (host).
        heads: query heads on this rank.
        widths: (latent, rope, qk, v) head widths.
        backend: :func:`backend_for`'s backend.

    Returns:
        int: the absorbed leading requests (all: absorbed form).
    """
    if MODE == "force":
        return 0
    model = COST_MODELS.get(backend, COST_MODEL)
    return absorbed_request_count(query_lengths, kv_lengths, heads, widths, model)


def mha_form_split(module: Any, context: Any, q: Tensor) -> Optional[MhaFormSplit]:
    """Whether the step's prefill requests take the MHA form, and where the split falls; None
    where the whole step runs in the absorbed form (see the module docstring).

    Args:
        module: the MLA self-attention module (its config and heads).
        context: the dynamic inference context.
        q: [tokens, heads, qk + rope], the rotated, un-absorbed query.

    Returns:
        Optional[MhaFormSplit]: the split, or None.
    """
    if MODE not in ("auto", "force") or context.is_decode_only() or graphed_step(context):
        return None
    if module.softmax_scale > MHA_MAX_SOFTMAX_SCALE:
        return None
    config = module.config
    head_dim = mha_form.flash_head_dim(q.shape[-1], config.v_head_dim)
    backend = backend_for(q.device, q.dtype, MODE, head_dim)
    if backend is None:
        return None
    heads = module.num_attention_heads_per_partition
    widths = (
        config.kv_lora_rank,
        config.qk_pos_emb_head_dim,
        config.qk_head_dim,
        config.v_head_dim,
    )
    query_lengths, rows = step_lengths(context)
    split = step_split(query_lengths, rows, heads, widths, backend)
    if split == len(query_lengths):
        return None
    leading = query_lengths[:split]
    return MhaFormSplit(
        backend,
        query_lengths,
        rows,
        split,
        int(leading.sum()),
        max(1, int(leading.max())) if split else 1,
    )


def mha_form_core(
    module: Any, q: Tensor, kv_cache: Tensor, block_table: Tensor, split: MhaFormSplit
) -> Tensor:
    """The MHA form's core attention output for the requests after the split.

    Args:
        module: the MLA self-attention module (its config, heads, ``linear_kv_up_proj``).
        q: [tokens, heads, qk + rope], the rotated, un-absorbed query of those requests (and the
            step's padding tokens after them).
        kv_cache, block_table: the layer's paged latent cache (this step's rows appended) and
            the step's block table.
        split: from :func:`mha_form_split`.

    Returns:
        Tensor: [tokens, heads, v_head_dim].
    """
    first = split.absorbed_requests
    return mla_paged_mha_attention(
        q,
        kv_cache,
        block_table[first:] if first else block_table,  # a prefill step's: no view to take
        module.linear_kv_up_proj.weight,
        module.softmax_scale,
        query_lengths=split.query_lengths[first:],
        kv_lengths=split.kv_lengths[first:],
        rope_dim=module.config.qk_pos_emb_head_dim,
        backend=split.backend,
        overlap=OVERLAP_CALLS,
    )
