# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""How the MHA form cuts a step's attended rows into chunks and its attention into calls
(:func:`plan_chunks`): host work on host lengths, nothing here launches on the GPU. The calls'
partial attentions are merged by :mod:`.mha_merge`.
"""

from typing import NamedTuple, Optional, Sequence, Tuple

import numpy as np

from megatron_ext.fusions.mla_latent.mha_rows import offsets_within

__all__ = ["Call", "Chunk", "call_tokens", "each_token_once", "plan_chunks"]


class Call(NamedTuple):
    """One attention call of a chunk: its mask, where its keys start in the chunk's packed
    rows, and its sequences as (first token, tokens, keys)."""

    causal: Optional[str]
    section: int
    offset: int
    sequences: Tuple[Tuple[int, int, int], ...]


class Chunk(NamedTuple):
    """A chunk's packed rows per section (requests, positions) and its attention calls."""

    sections: Tuple[Tuple[np.ndarray, np.ndarray], ...]
    calls: Tuple[Call, ...]


def _rows(parts: Sequence[Tuple[int, int, int]]) -> Tuple[np.ndarray, np.ndarray]:
    """The (request, position) of each row of the (request, start, end) parts, in order."""
    requests = [np.full(end - start, r, dtype=np.int64) for r, start, end in parts]
    positions = [np.arange(start, end, dtype=np.int64) for _, start, end in parts]
    empty = np.zeros(0, dtype=np.int64)
    return np.concatenate(requests or [empty]), np.concatenate(positions or [empty])


def call_tokens(call: Call) -> np.ndarray:
    """The query tokens of an attention call, sequence after sequence."""
    first, q_counts = (np.array(c, dtype=np.int64) for c in list(zip(*call.sequences))[:2])
    return np.repeat(first, q_counts) + offsets_within(q_counts)


def each_token_once(tokens_per_call: Sequence[Sequence[np.ndarray]], used: int) -> bool:
    """Whether each of the ``used`` tokens is in exactly one call (per chunk, per call, its
    tokens)."""
    tokens = np.concatenate([t for chunk in tokens_per_call for t in chunk])
    return len(tokens) == used and bool((np.bincount(tokens, minlength=used) == 1).all())


def _segments(q_lens: np.ndarray, kv_lens: np.ndarray, budget: int) -> list:
    """Every row of the requests with new tokens, request after request, cut into chunks of at
    most ``budget`` rows: per chunk, its (request, first row, end row) segments."""
    chunks, current, room = [], [], budget
    for r in np.flatnonzero(q_lens).tolist():
        start, length = 0, int(kv_lens[r])
        while start < length:
            end = start + min(room, length - start)
            current.append((r, start, end))
            room -= end - start
            start = end
            if room == 0:
                chunks.append(current)
                current, room = [], budget
    if current:
        chunks.append(current)
    return chunks


def plan_chunks(q_lens: np.ndarray, kv_lens: np.ndarray, budget: int, top_left: bool) -> list:
    """The chunks of a step: rows to decompress and attention calls, for a backend whose causal
    mask is aligned top-left (``top_left``) or bottom-right.

    Only a chunk's last segment can end before its request's last row (the others end there, or
    the chunk would have taken more rows), so only it needs the extra calls below, and every
    call's sequences have queries and keys.

    Top-left (cuDNN: only square blocks are masked): sections [prefix parts][new-row parts, the
    last segment's first]; an unmasked call of each prefix part with all of its request's
    queries, a causal call of each new-row part ``a..b`` (own indices) with queries ``a..b``
    (square), and an unmasked call of the last segment's new-row part with queries ``b..q``.

    Bottom-right: one section, the segments in order; a causal call of each segment ``s..e``
    that reaches new rows with the queries whose positions lie in it (the mask's last query
    sits at ``e - 1``, as theirs does), and an unmasked call of the last segment with the queries
    past it.

    Returns:
        list: of :class:`Chunk`.
    """
    prefix = kv_lens - q_lens
    first_token = np.cumsum(q_lens) - q_lens
    plan = []
    for segments in _segments(q_lens, kv_lens, budget):
        last_r, _, last_end = segments[-1]
        cut = last_end < kv_lens[last_r]  # the last segment stops short of its request's end
        calls = []
        if top_left:
            cached = [(r, s, min(e, prefix[r])) for r, s, e in segments if s < prefix[r]]
            new = [(r, max(s, prefix[r]), e) for r, s, e in segments if e > prefix[r]]
            if cut and new and new[-1][0] == last_r:
                new = new[-1:] + new[:-1]  # first: the below-diagonal call's keys start at 0
            sequences = tuple((first_token[r], q_lens[r], e - s) for r, s, e in cached)
            calls.append(Call(None, 0, 0, sequences))
            diagonal = tuple((first_token[r] + s - prefix[r], e - s, e - s) for r, s, e in new)
            calls.append(Call("top_left", 1, 0, diagonal))
            if cut and new and new[0][0] == last_r:
                r, s, e = new[0]
                below = e - prefix[r]
                calls.append(
                    Call(None, 1, 0, ((first_token[r] + below, q_lens[r] - below, e - s),))
                )
            sections = (_rows(cached), _rows(new))
        else:
            reaching = [(r, s, e) for r, s, e in segments if e > prefix[r]]
            sequences = tuple(
                (first_token[r] + max(s, prefix[r]) - prefix[r], e - max(s, prefix[r]), e - s)
                for r, s, e in reaching
            )
            calls.append(Call("bottom_right", 0, 0, sequences))
            if cut:
                r, s, e = segments[-1]
                past = max(e - prefix[r], 0)
                offset = sum(end - start for _, start, end in segments[:-1])
                sequences = ((first_token[r] + past, q_lens[r] - past, e - s),)
                calls.append(Call(None, 0, offset, sequences))
            sections = (_rows(segments),)
        calls = tuple(
            Call(c.causal, c.section, c.offset, tuple(tuple(map(int, q)) for q in c.sequences))
            for c in calls
            if c.sequences
        )
        plan.append(Chunk(sections, calls))
    return plan
