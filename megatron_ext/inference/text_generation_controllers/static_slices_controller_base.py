# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""What the static-slices text generation controllers of every megatron-core line share: the
graph-safe sampling region, its CUDA-graph cache and its static buffers.

:class:`StaticSlicesControllerBase` runs one fixed-shape *graph-safe region*
(:meth:`~StaticSlicesControllerBase.graph_safe_step`) over rows
``[0, rows)`` of static buffers:

* inputs: the last-token logits, copied into a static buffer after the forward pass
  (:meth:`~StaticSlicesControllerBase.stage_logits`), and the context's
  ``device_active_slices`` (sampling parameters, termination ids, lengths, request ids);
* work: per-row sampling (greedy, temperature, top-k, top-p; all rows at once, parameters read
  as tensors), the log-prob of each sampled token, and the per-request "still active" mask;
* outputs: one packed static buffer (tokens, log-probs, mask, request ids, flags), among them
  a per-row code that says whether the row's scores were finite (``non_finite``): a row whose
  logits hold a NaN or a +inf, or are all -inf, or whose ``logits / temperature`` overflowed,
  has no distribution to sample, and the host fails that request alone after its one copy of
  the outputs (:meth:`~StaticSlicesControllerBase.non_finite_requests`) instead of taking the
  token the region drew from NaN probabilities.

The region has no host synchronisation and allocates nothing that outlives it, so it is
captured once per (row count, sampling plan) in a CUDA graph and replayed on every later step
with that key, whatever requests were added, paused, resumed or finished in between (the
padding rows are neutral, see ``ACTIVE_METADATA_PAD_VALUES``).

The *sampling plan* picks which parts of the region exist (greedy rows, top-k over a static
candidate count, top-p or whole-vocabulary sampling, log-probs). The region checks on the device
that the plan covers every active row; if it ever does not, the step is recomputed with a plan
that covers everything (and a warning is logged). Each megatron-core line's subclass says where
the plan comes from (``sampling_plan``) and how the region plugs into megatron-core's step.
"""

import logging
from typing import Any, Dict, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)
from torch import Tensor

from megatron_ext.fusions.fused_top_k_sampling import (
    FUSED_DTYPES,
    MAX_FUSED_CAP,
    sample_top_k_candidates,
)
from megatron_ext.inference.contexts.graph_replay import capture_graph
from megatron_ext.inference.contexts.sampling_registry import SamplingRequirements
from megatron_ext.inference.contexts.static_slices_buffers import PackedBuffer
from megatron_ext.inference.contexts.static_slices_context_base import (
    StaticSlicesContextBase,
    check_row_count,
)
from megatron_ext.inference.engines.dynamic_engine import engine_fails_requests

logger = logging.getLogger(__name__)

__all__ = [
    "NON_FINITE_REASONS",
    "REQUIRED_METADATA_LABELS",
    "SamplingPlan",
    "StaticSlicesControllerBase",
    "non_finite_codes",
]

# Metadata labels the graph-safe region reads.
REQUIRED_METADATA_LABELS = (
    "temperature",
    "top_k",
    "top_p",
    "termination_id",
    "return_log_probs",
    "top_n_logprobs",
)

# The region's per-row ``non_finite`` codes (0: the row's scores were finite) and what each means.
NON_FINITE_REASONS = {
    1: "logits / temperature overflowed float32 (the temperature is too small for these logits)",
    2: "its logits row is not finite (a NaN or a +inf, or every entry -inf)",
}

# The sampling plan is a SamplingRequirements with the top-k cap clamped to the vocabulary; it is
# hashable and keys the CUDA graph cache together with the row count.
SamplingPlan = SamplingRequirements


def _scaled_scores(logits: Tensor, temperature: Tensor) -> Tensor:
    """``logits.float() / temperature[:, None]``. GRAPH-SAFE. Half-precision logits divide in
    one kernel: type promotion casts each element to float32 exactly, as ``.float()`` would in a
    kernel of its own.

    Args:
        logits (Tensor): ``[rows, n]``, any floating dtype.
        temperature (Tensor): ``[rows]``.

    Returns:
        Tensor: ``[rows, n]`` float32.
    """
    if logits.dtype == torch.float64:
        logits = logits.float()
    return logits / temperature.unsqueeze(1).float()


def non_finite_codes(
    row_max: Tensor,
    temperature: Optional[Tensor] = None,
    greedy_rows: Optional[Tensor] = None,
    *,
    out: Tensor,
) -> Tensor:
    """Each row's :data:`NON_FINITE_REASONS` code (0 when its scores are finite), from its
    largest logit. GRAPH-SAFE.

    Args:
        row_max (Tensor): ``[rows]`` each row's largest logit; NaN where the row holds one
            (``argmax``, ``amax`` and ``topk`` all take a NaN as the maximum), -inf where every
            entry is -inf.
        temperature (Optional[Tensor]): ``[rows]`` the temperatures the rows are scaled by;
            None when no row is scaled (greedy rows only).
        greedy_rows (Optional[Tensor]): ``[rows]`` bool, the rows that are not scaled (their
            temperature may be 0); None when every row is scaled.
        out (Tensor): ``[rows]`` uint8 destination.

    Returns:
        Tensor: ``out``.
    """
    if temperature is None:
        return torch.mul(torch.isfinite(row_max).logical_not_(), 2, out=out)
    # The largest scaled score is the row maximum scaled (the division is monotonic).
    scaled_max = row_max.float() / temperature.float()
    if greedy_rows is not None:
        scaled_max = torch.where(greedy_rows, row_max.float(), scaled_max)
    # 2 where the logits are not finite (their scaled maximum then is not either), 1 where only
    # the scaling overflowed.
    return torch.add(
        torch.isfinite(scaled_max).logical_not_().to(torch.uint8),
        torch.isfinite(row_max).logical_not_(),
        out=out,
    )


class StaticSlicesControllerBase(TextGenerationController):
    """``TextGenerationController`` with a graph-safe, sync-free sampling region.

    Takes megatron-core's arguments, plus:

    Args:
        cuda_graph_sampling (Optional[bool]): capture the graph-safe region in CUDA graphs and
            replay it; default: True when the context lives on a CUDA device.
        sampling_rows (Optional[int]): process at least this many rows every step (the extra
            rows are padded neutrally), so that one graph per sampling plan serves every batch
            size up to it; default: the padded active request count (one graph per padded size).

    Raises:
        TypeError: if the model's inference context is not a StaticSlicesInferenceContext, or an
            option has the wrong type.
        ValueError: if the context tracks no label the region needs, or sampling_rows is out of
            range.
    """

    # Whether the packed output buffer owns the sampled-token tensor that megatron-core's step
    # reads (0.16), or megatron-core owns its address and the region writes into it (0.19).
    _OWNS_SAMPLED_TOKENS = True

    def __init__(
        self,
        *args: Any,
        cuda_graph_sampling: Optional[bool] = None,
        sampling_rows: Optional[int] = None,
        **kwargs: Any,
    ):
        if cuda_graph_sampling is not None and not isinstance(cuda_graph_sampling, bool):
            raise TypeError("cuda_graph_sampling must be a bool or None")
        if sampling_rows is not None and (
            isinstance(sampling_rows, bool) or not isinstance(sampling_rows, int)
        ):
            raise TypeError("sampling_rows must be an int or None")
        self._cuda_graph_sampling_option = cuda_graph_sampling
        self._sampling_rows_option = sampling_rows
        super().__init__(*args, **kwargs)

    # ---------------------------------------------------------------------- set-up

    def _init_dynamic_sampling_tensors(self) -> None:
        """megatron-core's sampling tensors, then the static buffers of the graph-safe region."""
        super()._init_dynamic_sampling_tensors()
        context = self.inference_wrapped_model.inference_context
        if not isinstance(context, StaticSlicesContextBase):
            raise TypeError(
                "StaticSlicesTextGenerationController needs a StaticSlicesInferenceContext, got "
                f"{type(context).__name__}; build the context after "
                "megatron_ext.inference.enable_static_active_slices()"
            )
        missing = [
            label for label in REQUIRED_METADATA_LABELS if label not in context.request_metadata
        ]
        if missing:
            raise ValueError(f"the context does not track request metadata {missing}")

        slices = context.device_active_slices
        self._device = slices.request_ids.device
        self.use_cuda_graphs = (
            self._device.type == "cuda"
            if self._cuda_graph_sampling_option is None
            else self._cuda_graph_sampling_option and self._device.type == "cuda"
        )
        rows = context.max_logit_rows
        if self._sampling_rows_option is not None and not 1 <= self._sampling_rows_option <= rows:
            raise ValueError(f"sampling_rows ({self._sampling_rows_option}) must be in [1, {rows}]")
        fields = [
            ("tokens", torch.int64, rows),
            ("request_ids", torch.int64, rows),
            ("log_probs", torch.float32, rows),
            ("top_n_logprobs", torch.int32, rows),
            ("active_mask", torch.uint8, rows),
            ("return_log_probs", torch.bool, rows),
            ("non_finite", torch.uint8, rows),
            ("plan_violation", torch.int32, 1),
        ]
        self._step_out = PackedBuffer(fields, self._device)
        self._step_out_host = PackedBuffer(
            fields, torch.device("cpu"), pin_memory=self._device.type == "cuda"
        )
        if self._OWNS_SAMPLED_TOKENS:
            # The sampled tokens live in the packed output buffer so that they travel to the
            # host with everything else in one copy.
            self._sampled_tokens_cuda = self._step_out["tokens"]
        self._logits_buffer: Optional[Tensor] = None
        vocab_size, logits_dtype = self._expected_logits_shape()
        check_row_count("the model's vocabulary", vocab_size, 1, 2**31 - 1, "the logits' width")
        self._vocab_size = vocab_size
        self._ensure_logits_buffer(vocab_size, logits_dtype)
        # Requests the sampler could not honour are refused when they are added.
        context.set_sampling_limits(
            max_top_k=self._largest_top_k(vocab_size), max_top_n_logprobs=vocab_size
        )
        # Column indices of the top-k candidates, shared by every row count and plan.
        self._candidate_columns: Dict[int, Tensor] = {}

        self._graphs: Dict[Tuple[int, SamplingPlan], Any] = {}
        self._checked_plans: Set[Tuple[SamplingPlan, int]] = set()
        self._graph_pool = None
        self._slices_generation = context.static_slices_generation
        self._warned_plan_violation = False
        self._on_context_buffers_changed()

    def _expected_logits_shape(self) -> Tuple[int, torch.dtype]:
        """(vocabulary size, dtype) of the logits the forward pass returns."""
        raise NotImplementedError

    def _largest_top_k(self, vocab_size: int) -> int:
        """The largest ``top_k`` megatron-core's sampler of this line accepts (0.16: the logits'
        width)."""
        return vocab_size

    def _ensure_logits_buffer(self, vocab_size: int, dtype: torch.dtype) -> Tensor:
        buffer = self._logits_buffer
        if buffer is None or buffer.shape[1] != vocab_size or buffer.dtype != dtype:
            context = self.inference_wrapped_model.inference_context
            # Zero-filled so that rows never written (padding rows before the first step) hold
            # finite values.
            self._logits_buffer = torch.zeros(
                context.max_logit_rows, vocab_size, dtype=dtype, device=self._device
            )
            self.clear_cuda_graphs()
        return self._logits_buffer

    def _on_context_buffers_changed(self) -> None:
        """Hook: the context (re)allocated its buffers."""

    def _sync_with_context(self) -> None:
        """Drop graphs and aliases captured over buffers the context has since reallocated."""
        context = self.inference_wrapped_model.inference_context
        if context.static_slices_generation != self._slices_generation:
            self._slices_generation = context.static_slices_generation
            self.clear_cuda_graphs()
            self._on_context_buffers_changed()

    def clear_cuda_graphs(self) -> None:
        """Forget every captured graph of the region (they are recaptured on demand)."""
        self._graphs = {}

    @property
    def logits_buffer(self) -> Tensor:
        """Static ``[max_logit_rows, vocab]`` buffer of last-token logits read by the region."""
        return self._logits_buffer

    @property
    def step_outputs(self) -> Dict[str, Tensor]:
        """Static device outputs of the region: ``tokens``, ``log_probs``, ``active_mask``,
        ``request_ids``, ``return_log_probs``, ``top_n_logprobs`` (rows ``[0, rows)``) and
        ``plan_violation``."""
        views = dict(self._step_out.views)
        views["tokens"] = self._sampled_tokens_cuda
        return views

    # ---------------------------------------------------------------------- plan

    def sampling_plan(self) -> SamplingPlan:
        """The sampling plan for this step (each megatron-core line says where it comes from).

        Returns:
            SamplingPlan: hashable plan; part of the CUDA graph cache key.
        """
        raise NotImplementedError

    def _clamped_plan(self, req: SamplingRequirements) -> SamplingPlan:
        """``req`` with its top-k cap clamped to the vocabulary.

        Raises:
            ValueError: if a request's ``top_k`` exceeds the logits' width (megatron-core's
                sampler asserts the same).
        """
        width = self._logits_buffer.shape[1]
        if req.max_top_k > width:
            raise ValueError(
                f"top_k ({req.max_top_k}) is larger than the vocabulary of the logits ({width})"
            )
        return SamplingPlan(
            sample=req.sample,
            top_k_cap=min(req.top_k_cap, self._logits_buffer.shape[1]),
            top_p=req.top_p,
            log_probs=req.log_probs,
            greedy=req.greedy,
            full_vocab=req.full_vocab,
        )

    def _universal_plan(self) -> SamplingPlan:
        return SamplingPlan(
            sample=True,
            top_k_cap=self._logits_buffer.shape[1],
            top_p=True,
            log_probs=True,
            greedy=True,
            full_vocab=True,
        )

    # ---------------------------------------------------------------------- region

    def _active_request_count(self) -> int:
        context = self.inference_wrapped_model.inference_context
        return context.total_request_count - context.paused_request_count

    def _check_rows(self, rows: Any) -> int:
        context = self.inference_wrapped_model.inference_context
        return check_row_count(
            "rows",
            rows,
            max(1, self._active_request_count()),
            context.max_logit_rows,
            "at least one row per active request, at most the context's max_logit_rows",
        )

    def stage_logits(self, logits: Tensor, rows: Optional[int] = None) -> None:
        """Copy the last-token logits of this step into the static logits buffer.

        Runs outside the graph-safe region (the forward pass's output has a new address every
        step), after the context's ``publish_active_slices``. Device-only: no host
        synchronisation.

        Args:
            logits (Tensor): forward-pass output ``[1, S, V]``: last-token rows when the context
                materializes only last-token logits, else one row per (padded) token.
            rows (Optional[int]): rows to gather when ``logits`` has one row per token; default
                ``max(padded_active_request_count, active requests)``. Padding rows gather row 0.

        Raises:
            TypeError: if logits is not a floating-point Tensor or rows not an int.
            ValueError: on a logits shape the buffer cannot hold (a width other than the
                model's vocabulary included), logits on another device or aliasing the buffer,
                fewer rows than the step's active requests (last-token logits) or active tokens,
                or rows outside [active requests, max_logit_rows]. Nothing is written then.
            RuntimeError: with one logit row per token, if the context has not published this
                step's slices (the gather reads their last-token indices).
        """
        context = self.inference_wrapped_model.inference_context
        if not isinstance(logits, Tensor):
            raise TypeError(f"logits must be a Tensor, got {type(logits).__name__}")
        if logits.dim() != 3 or logits.size(0) != 1:
            raise ValueError(f"expected logits of shape [1, S, V], got {tuple(logits.shape)}")
        if not logits.dtype.is_floating_point:
            raise TypeError(f"logits must be floating point, got {logits.dtype}")
        if logits.size(2) != self._vocab_size:
            raise ValueError(
                f"logits have {logits.size(2)} columns, the model's vocabulary has "
                f"{self._vocab_size}"
            )
        if logits.device != self._device:
            raise ValueError(
                f"logits are on {logits.device}, the sampling buffers on {self._device}"
            )
        if logits.numel() and (
            logits.untyped_storage().data_ptr() == self._logits_buffer.untyped_storage().data_ptr()
        ):
            raise ValueError("logits alias the controller's logits_buffer; pass the model's output")
        count = self._region_rows() if rows is None else self._check_rows(rows)
        flat = logits.squeeze(0)
        # Rows missing here would be sampled from the previous step's logits (or, per token,
        # gathered out of range): the counts are host ints, so the check costs no sync.
        if context.materializes_only_last_token_logits:
            needed, what = self._active_request_count(), "active requests (one row each)"
        else:
            needed, what = context.active_token_count, "active tokens"
        if flat.size(0) < needed:
            raise ValueError(
                f"logits have {flat.size(0)} rows, fewer than this step's {needed} {what}"
            )
        buffer = self._ensure_logits_buffer(flat.size(1), flat.dtype)
        if context.materializes_only_last_token_logits:
            count = flat.size(0)
            if count > buffer.size(0):
                raise ValueError(f"{count} logit rows exceed the buffer's {buffer.size(0)}")
            buffer[:count].copy_(flat)
        else:
            index = context.device_active_slices.last_token_idxs[:count]
            torch.index_select(flat, 0, index, out=buffer[:count])

    def _region_rows(self) -> int:
        context = self.inference_wrapped_model.inference_context
        active = self._active_request_count()
        rows = max(context.padded_active_request_count, active, self._sampling_rows_option or 0)
        return min(rows, context.max_requests)

    def graph_safe_step(self, rows: int, plan: SamplingPlan) -> None:
        """The graph-safe region: sample, compute log-probs and the termination mask.

        GRAPH-SAFE: reads only static buffers (the logits buffer, the context's
        ``device_active_slices``, the sampling generator's state), writes only the static
        ``step_outputs``, never synchronises with the host, and has shapes that depend only on
        ``rows`` and ``plan``. Capture it with :meth:`run_graph_safe_step`.

        Per row ``r < rows``:

        * ``tokens[r]``: ``argmax`` of the raw logits when ``top_k == 1`` (megatron-core's
          greedy rule); otherwise a sample from ``softmax(logits / temperature)`` restricted
          to the ``top_k`` largest entries (``top_k > 1``) or to the top-p nucleus
          (``top_k < 1`` and ``top_p > 0``), drawn with the exponential-race form of
          multinomial sampling from the controller's sampling generator;
        * ``log_probs[r]``: ``log_softmax(logits)[tokens[r]]`` (when ``plan.log_probs``);
        * ``active_mask[r]``: 1 unless the token is the termination id or the sequence reaches
          its output length (megatron-core's rule);
        * ``request_ids``, ``return_log_probs``, ``top_n_logprobs``: copies for the host;
        * ``non_finite[r]``: 0 when the row's scores were finite, else a key of
          :data:`NON_FINITE_REASONS` (``tokens[r]`` is then meaningless);
        * ``plan_violation``: non-zero if a real row needs something the plan left out.

        Args:
            rows (int): rows to process (the padded active request count).
            plan (SamplingPlan): which parts of the region to build.
        """
        context = self.inference_wrapped_model.inference_context
        slices = context.device_active_slices
        meta = slices.metadata
        out = self._step_out
        logits = self._logits_buffer[:rows]
        top_k = meta["top_k"][:rows]
        top_p = meta["top_p"][:rows]

        # Outputs are written with out= where an op can: each copy saved is a launch (int64
        # tokens on both megatron-core lines, as argmax writes them).
        tokens = self._sampled_tokens_cuda[:rows]
        non_finite = out["non_finite"][:rows]
        if not plan.sample:
            torch.argmax(logits, dim=-1, out=tokens)
            # argmax takes a NaN as the maximum, so the value it picked is the row's maximum in
            # every case that matters: NaN, +inf, or -inf for a row that is all -inf.
            row_max = logits.gather(1, tokens.unsqueeze(1)).squeeze(1)
            non_finite_codes(row_max, out=non_finite)
        else:
            temperature = meta["temperature"][:rows]
            sampled, row_max = self._sample_rows(logits, temperature, top_k, top_p, plan)
            greedy_rows = top_k == 1
            if plan.greedy:
                torch.where(greedy_rows, torch.argmax(logits, dim=-1), sampled, out=tokens)
            else:
                tokens.copy_(sampled)
            non_finite_codes(
                row_max, temperature, greedy_rows if plan.greedy else None, out=non_finite
            )

        if plan.log_probs:
            log_probs = F.log_softmax(logits.float(), dim=-1)
            torch.gather(log_probs, 1, tokens.unsqueeze(1), out=out["log_probs"][:rows, None])

        # megatron-core's termination rule: the new token is the termination id, or the sequence
        # (cached + fed this step + the new token) reaches the request's output length.
        sequence_lengths = slices.kv_length_offsets[:rows] + slices.query_lengths[:rows] + 1
        torch.logical_and(
            tokens != meta["termination_id"][:rows],
            sequence_lengths < slices.output_lengths[:rows],
            out=out["active_mask"][:rows],
        )
        request_ids = slices.request_ids[:rows]
        out["request_ids"][:rows].copy_(request_ids)
        wants_log_probs = meta["return_log_probs"][:rows]
        top_n = meta["top_n_logprobs"][:rows]
        out["return_log_probs"][:rows].copy_(wants_log_probs)
        out["top_n_logprobs"][:rows].copy_(top_n)

        # Device-side check that the plan covers every real row (padding rows have request id
        # -1), so that the plan is an optimisation, never a correctness assumption.
        # Only the masks the plan needs: run eagerly, each is a launch.
        real = request_ids >= 0
        if not plan.sample:
            missed = top_k != 1
        else:
            # Greedy rows are sampled by the greedy pass, whatever the cap (0 with no top-k row).
            missed = top_k > max(plan.top_k_cap, 1)
            if not (plan.top_p or plan.full_vocab):
                # No unbounded (top_k < 1) row is covered either.
                missed = missed | (top_k < (1 if plan.greedy else 2))
            else:
                if not plan.greedy:
                    missed = missed | (top_k == 1)
                if not (plan.top_p and plan.full_vocab):
                    # An unbounded row is nucleus when top_p > 0, else whole-vocabulary.
                    nucleus = top_p > 0
                    uncovered = nucleus if plan.full_vocab else ~nucleus
                    missed = missed | ((top_k < 1) & uncovered)
        if not plan.log_probs:
            missed = missed | wants_log_probs | (top_n > 0)
        torch.sum(missed & real, dim=0, keepdim=True, dtype=torch.int32, out=out["plan_violation"])

    def _sample_rows(
        self, logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, plan: SamplingPlan
    ) -> Tuple[Tensor, Tensor]:
        """Per-row temperature / top-k / top-p sampling. GRAPH-SAFE (see graph_safe_step).

        Returns:
            Tuple[Tensor, Tensor]: the drawn tokens and each row's largest logit (NaN where the
            row holds one).
        """
        if not (plan.top_p or plan.full_vocab) and plan.top_k_cap > 0:
            return self._sample_top_k_candidates(logits, temperature, top_k, plan.top_k_cap)
        row_max = logits.amax(dim=-1)
        scores = _scaled_scores(logits, temperature)
        neg_inf = float("-inf")
        if plan.top_k_cap > 0:
            # The k-th largest score per row, read from one top-k of the static cap.
            k = top_k.clamp(min=1, max=plan.top_k_cap).long()
            kth = torch.topk(scores, plan.top_k_cap, dim=-1).values.gather(1, k.unsqueeze(1) - 1)
            drop = (top_k > 1).unsqueeze(1) & (scores < kth)
            scores = scores.masked_fill(drop, neg_inf)
        if plan.top_p:
            # Nucleus: keep the smallest prefix of the sorted distribution whose mass exceeds
            # top_p (the first token always stays), as megatron-core does.
            sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=True)
            cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
            over = cumulative > top_p.unsqueeze(1)
            drop_sorted = torch.zeros_like(over)
            drop_sorted[:, 1:] = over[:, :-1]
            drop_sorted &= ((top_k < 1) & (top_p > 0)).unsqueeze(1)
            drop = torch.zeros_like(drop_sorted).scatter_(1, sorted_idx, drop_sorted)
            scores = scores.masked_fill(drop, neg_inf)
        return self._exponential_race(scores.softmax(dim=-1)), row_max

    def _exponential_race(self, probs: Tensor) -> Tensor:
        """One draw per row from ``probs``. GRAPH-SAFE.

        ``argmax(p / E)`` with ``E ~ Exp(1)`` draws from ``p``; this is how torch.multinomial
        samples one token, minus its validity check, which reads the probabilities back to the
        host.
        """
        noise = torch.empty_like(probs).exponential_(1.0, generator=self.sampling_rng)
        # A zero draw would turn a filtered (zero-probability) entry into 0/0 = NaN, which argmax
        # would pick.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return torch.argmax(probs / noise, dim=-1)

    def _sample_top_k_candidates(
        self, logits: Tensor, temperature: Tensor, top_k: Tensor, cap: int
    ) -> Tuple[Tensor, Tensor]:
        """Top-k sampling when every sampling row has ``1 < top_k <= cap``. GRAPH-SAFE.

        One ``topk`` of ``cap`` candidates per row reads the vocabulary once; the temperature,
        the per-row cut at the k-th largest logit (ties with it kept, as megatron-core keeps
        them, up to the cap), the softmax and the draw then work on ``[rows, cap]`` rather than
        ``[rows, vocab]``. Positive temperature scaling keeps the order, so the candidates are
        the same as after scaling.

        Returns:
            Tuple[Tensor, Tensor]: the drawn tokens and each row's largest logit (``topk`` sorts
            a NaN first, on the CPU and on CUDA devices).
        """
        values, indices = torch.topk(logits, cap, dim=-1)
        row_max = values[:, 0]
        if values.is_cuda and cap <= MAX_FUSED_CAP and values.dtype in FUSED_DTYPES:
            # The same draws as the torch path below ([rows, cap] float32 from the generator),
            # raced in one kernel instead of a dozen launches.
            noise = torch.empty(values.shape, dtype=torch.float32, device=values.device)
            noise.exponential_(1.0, generator=self.sampling_rng)
            return sample_top_k_candidates(values, indices, temperature, top_k, noise), row_max
        k = top_k.clamp(min=1, max=cap).long().unsqueeze(1)
        kth = values.gather(1, k - 1)
        scores = _scaled_scores(values, temperature)
        scores = scores.masked_fill(values < kth, float("-inf"))
        choice = self._exponential_race(scores.softmax(dim=-1))
        return indices.gather(1, choice.unsqueeze(1)).squeeze(1), row_max

    def run_graph_safe_step(
        self, rows: int, plan: SamplingPlan, use_cuda_graph: Optional[bool] = None
    ) -> None:
        """Run the graph-safe region eagerly, or replay its CUDA graph (capturing it first).

        Args:
            rows (int): rows to process: at least one per active request.
            plan (SamplingPlan): the plan.
            use_cuda_graph (Optional[bool]): default ``self.use_cuda_graphs``.

        Raises:
            TypeError: if rows is not an int, plan not a SamplingPlan or one of its flags not a
                bool.
            ValueError: if rows is outside [active requests, max_logit_rows], the plan's top-k
                cap outside [0, vocabulary], or a CUDA graph is asked for on a context that is
                not on a CUDA device.
        """
        self._check_rows(rows)
        self._check_plan(plan)
        self._sync_with_context()
        if use_cuda_graph is None:
            use_cuda_graph = self.use_cuda_graphs
        if not use_cuda_graph:
            self.graph_safe_step(rows, plan)
            return
        if self._device.type != "cuda":
            raise ValueError("CUDA graphs need the context on a CUDA device")
        graph = self._graphs.get((rows, plan))
        if graph is None:
            graph = self._capture(rows, plan)
            self._graphs[(rows, plan)] = graph
        graph.replay()

    def _check_plan(self, plan: Any) -> None:
        """A plan the region can build: flags that are bools and a top-k cap in ``[0, vocab]``
        (checked once per plan and logits width; the graph cache keys on both)."""
        if not isinstance(plan, SamplingPlan):
            raise TypeError(f"plan must be a SamplingPlan, got {type(plan).__name__}")
        width = self._logits_buffer.shape[1]
        if (plan, width) in self._checked_plans:
            return
        for name, value in plan.__dict__.items():
            if name in ("top_k_cap", "max_top_k"):
                check_row_count(f"plan.{name}", value, 0, width, "the logits' width")
            elif not isinstance(value, bool):
                raise TypeError(f"plan.{name} must be a bool, got {type(value).__name__}")
        self._checked_plans.add((plan, width))

    def _capture(self, rows: int, plan: SamplingPlan) -> "torch.cuda.CUDAGraph":
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        # Graphs share one pool: every output lives in buffers allocated outside it, so no
        # graph's temporaries are alive when another replays. Replays then advance the sampling
        # generator exactly as eager calls would.
        if plan.sample and not hasattr(torch.cuda.CUDAGraph, "register_generator_state"):
            raise RuntimeError(
                "capturing sampling needs torch.cuda.CUDAGraph.register_generator_state "
                "(torch >= 2.5); use cuda_graph_sampling=False"
            )
        return capture_graph(
            lambda: self.graph_safe_step(rows, plan),
            self._device,
            pool=self._graph_pool,
            generator=self.sampling_rng if plan.sample else None,
        )

    def fetch_step_outputs(self) -> Dict[str, Tensor]:
        """Copy the region's outputs to the host: one copy and one stream synchronisation.

        Returns:
            Dict[str, Tensor]: host views (pinned on CUDA) of the packed outputs; valid until
            the next call.
        """
        tokens = self._sampled_tokens_cuda
        if tokens.data_ptr() != self._step_out["tokens"].data_ptr():
            self._step_out["tokens"].copy_(tokens)
        if self._device.type == "cuda":
            self._step_out_host.buffer.copy_(self._step_out.buffer, non_blocking=True)
            torch.cuda.current_stream(self._device).synchronize()
        else:
            self._step_out_host.buffer.copy_(self._step_out.buffer)
        return self._step_out_host.views

    def run_sampling_step(self, rows: Optional[int] = None) -> Dict[str, Tensor]:
        """Run the region for this step (graphed or eager) and fetch its outputs to the host.

        Falls back to a plan that covers everything if the device reports that the plan missed
        an active row.

        Args:
            rows (Optional[int]): rows to process; default the padded active request count.

        Returns:
            Dict[str, Tensor]: host views of the outputs (see :meth:`fetch_step_outputs`).

        Raises:
            ValueError: if rows is below the active request count (the other rows' tokens
                would be stale) or above max_logit_rows.
        """
        rows = self._region_rows() if rows is None else self._check_rows(rows)
        plan = self.sampling_plan()
        self.run_graph_safe_step(rows, plan)
        host = self.fetch_step_outputs()
        if int(host["plan_violation"][0]) != 0:
            if not self._warned_plan_violation:
                logger.warning(
                    "sampling plan %s missed an active request; recomputing this step with every "
                    "sampling feature enabled (requests added to the context without "
                    "add_request?)",
                    plan,
                )
                self._warned_plan_violation = True
            self.run_graph_safe_step(rows, self._universal_plan(), use_cuda_graph=False)
            host = self.fetch_step_outputs()
        return host

    def non_finite_requests(self, host: Dict[str, Tensor], count: int) -> Dict[int, str]:
        """The requests among the first ``count`` rows of a fetched step whose scores were not
        finite, with the reason (host-only: reads the host copy of the outputs).

        The chunked-prefill request is left out: its token is never used, and its next chunk's
        row is checked again.

        Args:
            host (Dict[str, Tensor]): from :meth:`fetch_step_outputs` or
                :meth:`run_sampling_step`, or any host ``non_finite`` codes with the rows'
                ``request_ids``.
            count (int): rows that belong to active requests.

        Returns:
            Dict[int, str]: request id -> reason; empty in a step without such rows.
        """
        flags = host["non_finite"][:count]
        if not bool(flags.any()):
            return {}
        context = self.inference_wrapped_model.inference_context
        ids = host["request_ids"][:count].tolist()
        rows = flags.nonzero().flatten().tolist()
        return {
            ids[row]: NON_FINITE_REASONS[int(flags[row])]
            for row in rows
            if ids[row] != context.chunked_prefill_request_id
        }

    def _refuse_unless_failable(self, failed: Dict[int, str], can_fail: bool = True) -> None:
        """Raise for ``failed`` unless the step can hand them to an engine that fails single
        requests (the inference flag's patch): their tokens must not reach the requests.
        Called before the step's bookkeeping changes anything."""
        if failed and not (can_fail and engine_fails_requests()):
            raise ValueError(
                "no token can be sampled for requests "
                + "; ".join(f"{rid}: {reason}" for rid, reason in sorted(failed.items()))
                + " (megatron-core's engine fails them alone while "
                "megatron_ext.inference.enable_static_active_slices() is in effect)"
            )

    # ---------------------------------------------------------------------- engine hooks

    def _dynamic_step_context_init(self, *args: Any, **kwargs: Any):
        """megatron-core's step initialisation (which builds the active slices), after
        dropping state captured over reallocated context buffers."""
        self._sync_with_context()
        return super()._dynamic_step_context_init(*args, **kwargs)
