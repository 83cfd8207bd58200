# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The MHA form's plan of one step: its chunks and attention calls (:mod:`.mha_chunks`), laid
out for the launches (which tokens, which packed rows, which lengths) with the rows' cache
addresses and every call's cumulative lengths already on the device.

A step's lengths are the same for every layer, so the plan is built once per step and kept
(:data:`MHA_PLANS`, keyed by the lengths and what the layout depends on): the other layers' calls
do no host planning and no host-to-device copy, only their GPU work. This is the MHA form's
counterpart of a paged-attention library's plan-once, run-per-layer split.
"""

from typing import NamedTuple, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from megatron_ext.fusions.launch_plans import PlanCache
from megatron_ext.fusions.mla_latent import mha_backends
from megatron_ext.fusions.mla_latent.mha_backends import (
    SPLIT_BACKENDS,
    Ragged,
    needs_offsets,
    ragged_metadata,
    ragged_offsets,
)
from megatron_ext.fusions.mla_latent.mha_chunks import call_tokens, each_token_once, plan_chunks
from megatron_ext.fusions.mla_latent.mha_dense import clear_groups
from megatron_ext.fusions.mla_latent.mha_rows import bucket, kept_for_step, to_device

__all__ = [
    "MHA_PLANS",
    "MhaPlan",
    "PlannedCall",
    "PlannedChunk",
    "clear_step_caches",
    "mha_plan",
    "padded_size",
]

# Steps' plans kept: a plan holds two int32 device arrays of its rows (and small offset arrays),
# so the bound keeps their memory small; the layers of one step share one.
MHA_PLANS: PlanCache = PlanCache(max_entries=8)


class PlannedCall(NamedTuple):
    """One attention call of a chunk, ready to launch.

    Attributes:
        causal: the mask (None, ``"top_left"`` or ``"bottom_right"``).
        tokens: its query tokens: a slice where they are consecutive (read and written through
            views), else their int32 indices on the device.
        count: how many tokens.
        padded: the query rows the backend is handed (``count`` rounded up to a bucket for the
            fused backends that plan per shape).
        rows: its keys' rows in the chunk's packed rows (bucket padding included).
        lengths: its query and key lengths per sequence, on the host.
        offsets: its cumulative lengths on the device in the backend's layout, or None where the
            backend takes none.
        ragged: the backend's packed-sequence metadata (views of ``offsets``, the bucketed
            maxima), or None where the backend takes none.
        last: none of its tokens is in a later call, and the plan's merges write the result
            (:attr:`MhaPlan.merges_write_out`): its merge writes its tokens' answers.
    """

    causal: Optional[str]
    tokens: Union[slice, Tensor]
    count: int
    padded: int
    rows: slice
    lengths: Tuple[np.ndarray, np.ndarray]
    offsets: Optional[Tensor]
    ragged: Optional[Ragged]
    last: bool


class PlannedChunk(NamedTuple):
    """Rows decompressed at once and the calls that attend them.

    Attributes:
        rows: [2, rows] int32 on the device: each packed row's place in the (contiguous) block
            table, ``request * max_blocks + position // block_size``, and its place in its
            block, ``position % block_size``.
        calls: the chunk's attention calls.
        places: ``rows[0]`` and ``rows[1]`` (views taken once for every layer).
    """

    rows: Tensor
    calls: Tuple[PlannedCall, ...]
    places: Tuple[Tensor, Tensor]


class MhaPlan(NamedTuple):
    """A step's MHA-form plan.

    Attributes:
        used: the tokens the requests have (the rest of the query is padding and gets zeros).
        direct: whether each token is in exactly one call, so that a call's output is the
            token's answer (written straight into the result, no merge).
        chunks: the chunks, in order.
        single: whether the plan is one chunk of one call whose tokens are ``0..used`` in order
            (a slice).
        merges_write_out: whether every token's last call is a call all of whose tokens end
            there (:attr:`PlannedCall.last`), so that those calls' merges write the result and
            no accumulator is cast into it afterwards.
        first_seeds: whether the first call's output and log-sum-exps can stand as the
            accumulator: its tokens are ``0..used`` in order, every token is in a later call
            and every later call's merge writes the result (so none writes the accumulator).
            Its merge into an empty accumulator would copy it there exactly; the step then
            allocates no accumulator and launches one merge fewer.
    """

    used: int
    direct: bool
    chunks: Tuple[PlannedChunk, ...]
    single: bool
    merges_write_out: bool
    first_seeds: bool


def padded_size(backend: str, n: int) -> int:
    """The rows a section or query set of ``n`` is handed to ``backend`` as: fused backends
    that plan per shape (``cudnn``, ``te``) get a bucket (rows no query attends), the others
    ``n``."""
    return bucket(n) if backend in ("cudnn", "te") else n


def _build(
    q_lens: np.ndarray,
    kv_lens: np.ndarray,
    backend: str,
    budget: int,
    block_size: int,
    max_blocks: int,
    device: torch.device,
) -> MhaPlan:
    used = int(q_lens.sum())
    plan = plan_chunks(q_lens, kv_lens, budget, backend in SPLIT_BACKENDS)
    tokens_per_call = [[call_tokens(call) for call in chunk.calls] for chunk in plan]
    direct = each_token_once(tokens_per_call, used)
    last_flags = _last_calls([t for chunk in tokens_per_call for t in chunk], used)
    merges_write_out = any(last_flags)
    last_flags.reverse()  # popped in call order below
    chunks = []
    for chunk, tokens_of_calls in zip(plan, tokens_per_call):
        starts, index_parts = [], []
        for section_requests, section_positions in chunk.sections:
            rows = len(section_requests)
            # Padding rows read the table's first entry (a real block, or a -1 read as block 0):
            # no query attends them.
            padded = np.zeros((2, padded_size(backend, rows) if rows else 0), dtype=np.int64)
            padded[0, :rows] = section_requests * max_blocks + section_positions // block_size
            padded[1, :rows] = section_positions % block_size
            starts.append(sum(part.shape[1] for part in index_parts))
            index_parts.append(padded)
        index = np.concatenate(index_parts, axis=1)
        lengths = [
            tuple(np.array(c, dtype=np.int64) for c in list(zip(*call.sequences))[1:])
            for call in chunk.calls
        ]
        # The rows' places, the scattered calls' tokens and every call's cumulative lengths in
        # one host-to-device copy (each part a multiple of 16 bytes, so each stays aligned).
        host = [index.reshape(-1), np.zeros(-index.size % 4, dtype=np.int64)]
        places = []
        for call, token_ids, (q_counts, k_counts) in zip(chunk.calls, tokens_of_calls, lengths):
            n, lo = len(token_ids), int(token_ids[0])
            consecutive = np.array_equal(token_ids, np.arange(lo, lo + n))
            token_place = None if consecutive else sum(len(part) for part in host)
            if not consecutive:
                host += [token_ids, np.zeros(-n % 4, dtype=np.int64)]
            offset_place = sum(len(part) for part in host)
            if needs_offsets(backend, call.causal):
                host.append(ragged_offsets(backend, q_counts, k_counts))
            places.append((token_place, offset_place))
        device_copy = to_device(np.concatenate(host), device)
        calls = []
        for call, token_ids, (q_counts, k_counts), (token_place, offset_place) in zip(
            chunk.calls, tokens_of_calls, lengths, places
        ):
            n, lo = len(token_ids), int(token_ids[0])
            begin = starts[call.section] + call.offset
            offsets = ragged = None
            if needs_offsets(backend, call.causal):
                offsets = device_copy[offset_place:]
                ragged = ragged_metadata(backend, q_counts, k_counts, offsets)
            calls.append(
                PlannedCall(
                    call.causal,
                    (
                        slice(lo, lo + n)
                        if token_place is None
                        else device_copy[token_place : token_place + n]
                    ),
                    n,
                    padded_size(backend, n),
                    slice(begin, begin + padded_size(backend, int(k_counts.sum()))),
                    (q_counts, k_counts),
                    offsets,
                    ragged,
                    last_flags.pop(),
                )
            )
        rows = device_copy[: index.size].view(2, -1)
        chunks.append(PlannedChunk(rows, tuple(calls), (rows[0], rows[1])))
    only = chunks[0].calls[0] if len(chunks) == 1 and len(chunks[0].calls) == 1 else None
    single = only is not None and isinstance(only.tokens, slice) and only.tokens == slice(0, used)
    return MhaPlan(
        used, direct, tuple(chunks), single, merges_write_out, _first_seeds(chunks, used)
    )


def _first_seeds(chunks: list, used: int) -> bool:
    """:attr:`MhaPlan.first_seeds` of a plan's chunks."""
    calls = [call for chunk in chunks for call in chunk.calls]
    first = calls[0].tokens if calls else None
    if len(calls) < 2 or not isinstance(first, slice) or first != slice(0, used):
        return False
    later = calls[1:]
    if not all(call.last for call in later):
        return False
    # Every token's answer is written by a later call's merge (the last ones hold disjoint
    # tokens, so their counts add up to the tokens they cover).
    return sum(call.count for call in later) == used


def _last_calls(tokens_of_calls: list, used: int) -> list:
    """Per call (in order), whether its merge may write its tokens' answers: none of its tokens
    is in a later call. All False unless every token's last call is such a call (a token whose
    last call also holds tokens of later calls would be left in the accumulator, and the cast
    of the accumulator afterwards would overwrite what the others wrote)."""
    last_call = np.full(used, -1, dtype=np.int64)
    for i, tokens in enumerate(tokens_of_calls):
        last_call[tokens] = i
    flags = [bool((last_call[tokens] == i).all()) for i, tokens in enumerate(tokens_of_calls)]
    # A token in no call (never so in a plan) keeps -1: then the cast writes every token.
    if used and not ((last_call >= 0).all() and np.array(flags)[last_call].all()):
        return [False] * len(flags)
    return flags


def mha_plan(
    q_lens: np.ndarray,
    kv_lens: np.ndarray,
    backend: str,
    budget: int,
    block_size: int,
    max_blocks: int,
    device: torch.device,
) -> MhaPlan:
    """The plan of a step with these (checked) lengths, built once and kept in
    :data:`MHA_PLANS` (per stream: :func:`~megatron_ext.fusions.mla_latent.mha_rows.kept_for_step`).

    Args:
        q_lens, kv_lens: int64 new tokens and attended rows per request (checked).
        backend: one of :data:`~megatron_ext.fusions.mla_latent.mha_backends.BACKENDS`.
        budget: the most rows decompressed at once.
        block_size: the cache's rows per block.
        max_blocks: the block table's columns.
        device: where the step runs.

    Returns:
        MhaPlan: the plan.
    """
    step = (q_lens, kv_lens, backend, budget, block_size, max_blocks, device)
    # The cuDNN backend's offsets (and the metadata kept with them) are laid out by whether
    # cuDNN takes empty sequences.
    empty = backend == "cudnn" and mha_backends.empty_sequences_supported()
    key = (q_lens.tobytes(), kv_lens.tobytes(), backend, budget, block_size, max_blocks, empty)
    return kept_for_step(MHA_PLANS, key, device, lambda: _build(*step))


def clear_step_caches() -> None:
    """Forget every kept step plan and the backends' per-step groups (the next call of each
    step builds them again)."""
    MHA_PLANS.clear()
    clear_groups()
