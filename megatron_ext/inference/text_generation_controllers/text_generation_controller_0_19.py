# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""``StaticSlicesTextGenerationController`` for megatron-core 0.19.x.

megatron-core 0.19 already reads request metadata from host-side active slices, keeps logits in
a static buffer when it captures the model, and does its bookkeeping on the host after one
read-back of the sampled tokens. Here the controller replaces only the sampling kernels
(``_dynamic_step_sample_logits``) with the graph-safe region replayed from a CUDA graph, for the
legacy (non-overlapped) scheduling mode without speculative decoding, reads the plan from those
host slices (exact for the active rows, no synchronisation), and leaves log-probs and bookkeeping
to upstream.

Every other step runs upstream's sampler, including steps of a controller whose region is not
graphed (``cuda_graph_sampling=False``, or a context off CUDA): run eagerly, the region
launches its kernels one by one (sampling, plus the termination mask, the request-id copies and
the plan check that only the 0.16 step and the public ``run_sampling_step`` read), after a copy
of the logits into its static buffer; upstream's bucketed sampler does less launch work for the
same tokens, so an eager step of this controller is megatron-core's step, with one addition in
legacy scheduling: the rows' ``non_finite`` codes are computed on the device first (the region's
classification) and read with upstream's copy of the tokens, and those requests fail alone as
after a graphed step, where upstream's greedy rule took a NaN's index as the token and its
``multinomial`` raised for the whole step.
"""

from typing import Dict, Optional, Tuple

import torch
from megatron.core.inference.config import AsyncScheduleMode
from torch import Tensor

from megatron_ext.inference.contexts.sampling_registry import top_k_cap_for
from megatron_ext.inference.engines.dynamic_engine import FAILED_REQUESTS_KEY
from megatron_ext.inference.text_generation_controllers.static_slices_controller_base import (
    SamplingPlan,
    StaticSlicesControllerBase,
    non_finite_codes,
)

__all__ = ["StaticSlicesTextGenerationController"]


class StaticSlicesTextGenerationController(StaticSlicesControllerBase):
    """``TextGenerationController`` with a graph-safe, sync-free sampler (megatron-core 0.19.x).
    Takes megatron-core's arguments plus ``cuda_graph_sampling`` and ``sampling_rows`` (see
    :class:`StaticSlicesControllerBase`)."""

    # Upstream owns the sampled-token buffer's address (its bookkeeping reads it).
    _OWNS_SAMPLED_TOKENS = False
    # Whether the region sampled this step (its outputs are then read back in one copy), and the
    # requests that step found without finite scores (request id -> reason), until bookkeeping.
    _region_sampled = False
    # Whether megatron-core's sampler sampled this step with the rows' ``non_finite`` codes
    # computed (they travel to the host with its tokens).
    _eager_flagged = False
    _step_failed: Optional[Dict[int, str]] = None

    def _expected_logits_shape(self) -> Tuple[int, torch.dtype]:
        return self.vocab_size, self.inference_wrapped_model.config.params_dtype

    def _largest_top_k(self, vocab_size: int) -> int:
        # 0.19's sampler asserts top_k < vocab_size when it samples (greedy takes the argmax
        # first).
        return max(vocab_size - 1, 1)

    def sampling_plan(self) -> SamplingPlan:
        """The sampling plan for this step, read from upstream's host-side active slices (exact
        for the active rows; reading pinned host memory needs no synchronisation).

        Returns:
            SamplingPlan: hashable plan; part of the CUDA graph cache key.

        Raises:
            ValueError: if a request's ``top_k`` is not below the vocabulary size.
        """
        context = self.inference_wrapped_model.inference_context
        n = self._active_request_count()
        meta = context.active_request_metadata
        top_k = meta["top_k"][:n]
        top_p = meta["top_p"][:n]
        unfiltered = top_k < 1
        max_top_k = int(top_k.max()) if n else 0
        if max_top_k >= self.vocab_size:
            # 0.19's sampler asserts top_k < vocab_size (0.16's only top_k <= the logits' width).
            raise ValueError(
                f"top_k ({max_top_k}) must be smaller than the model's vocabulary "
                f"({self.vocab_size})"
            )
        plan = SamplingPlan(
            sample=bool((top_k != 1).any()),
            top_k_cap=top_k_cap_for(max_top_k),
            top_p=bool((unfiltered & (top_p > 0)).any()),
            log_probs=bool(
                meta["return_log_probs"][:n].any() or (meta["top_n_logprobs"][:n] > 0).any()
            ),
            greedy=bool((top_k == 1).any()),
            full_vocab=bool((unfiltered & (top_p <= 0)).any()),
            max_top_k=max_top_k,
        )
        return self._clamped_plan(plan)

    def region_samples_this_step(self) -> bool:
        """Whether this step samples with the graph-safe region: only when it is replayed from a
        CUDA graph, in legacy scheduling, without speculative decoding (megatron-core's sampler
        otherwise; see the module docstring). Host-only.

        Returns:
            bool: True when the region replaces megatron-core's sampler this step.
        """
        context = self.inference_wrapped_model.inference_context
        return (
            self.use_cuda_graphs
            and not self.num_speculative_tokens
            and context.config.async_sched_mode == AsyncScheduleMode.LEGACY
        )

    def _dynamic_step_forward_logits(self, input_ids: Tensor, position_ids: Tensor):
        """megatron-core's forward step, then, when the region samples this step, the context's
        active slices published and this step's logits rows copied into the static buffer. A step
        sampled by megatron-core's sampler publishes nothing: it reads none of the slices."""
        logits = super()._dynamic_step_forward_logits(input_ids, position_ids)
        if not self.region_samples_this_step():
            return logits
        rows = self._region_rows()
        context = self.inference_wrapped_model.inference_context
        context.publish_active_slices()
        context.extend_active_padding(rows)
        # 0.19 leaves the logits in self._all_logits_cuda, which may be its own [1, max_rows, V]
        # buffer; only the leading rows belong to this step.
        if context.materializes_only_last_token_logits:
            count = context.num_last_token_logits
        else:
            count = context.padded_active_token_count
        self.stage_logits(self._all_logits_cuda[:, :count], rows=rows)
        return logits

    def _dynamic_step_sample_logits(self) -> None:
        """Sample with the graph-safe region's CUDA graph (see ``region_samples_this_step``);
        megatron-core's sampler otherwise, on rows whose scores were classified first (see
        ``_sample_flagged_rows``) in legacy scheduling, where the step's bookkeeping reads the
        flags."""
        self._region_sampled = False
        self._eager_flagged = False
        if not self.region_samples_this_step():
            context = self.inference_wrapped_model.inference_context
            if context.config.async_sched_mode != AsyncScheduleMode.LEGACY:
                return super()._dynamic_step_sample_logits()
            return self._sample_flagged_rows()
        plan = self.sampling_plan()
        # Upstream computes log-probs itself (raw or processed, per its config).
        plan = SamplingPlan(**{**plan.__dict__, "log_probs": False})
        self.run_graph_safe_step(self._region_rows(), plan)
        self._region_sampled = True

    def _sample_flagged_rows(self) -> None:
        """megatron-core's sampler on this step's rows after their ``non_finite`` codes are
        computed on the device (:func:`non_finite_codes`, the region's classification).

        megatron-core's ``multinomial`` raises on a row without a distribution, failing the whole
        step, and its greedy argmax returns the NaN's or inf's index: the sampler reads a copy of
        the rows (this controller's, never megatron-core's logits buffer, which its log-prob
        passes read afterwards) in which the flagged rows are zeros; their tokens are discarded
        (the requests fail, ``_transfer_samples_to_cpu``). The call is megatron-core's
        ``_dynamic_step_sample_logits`` minus its row gather, done here already (that method
        samples ``_all_logits_cuda`` itself, with no way to pass it other rows). Device-only:
        the plan flags below read pinned host metadata.
        """
        context = self.inference_wrapped_model.inference_context
        n = self._active_request_count()
        flat = self._all_logits_cuda.squeeze(0)
        # The rows megatron-core's sampler would read: a view of its buffer, or (one logit row
        # per token) a gathered copy this method owns.
        owned = not context.config.materialize_only_last_token_logits
        if owned:
            rows = flat.index_select(0, context.gpu_view.active_request_last_token_idxs[:n])
        else:
            rows = flat[:n]
        if n:
            view = context.gpu_view
            greedy = context.active_request_metadata["top_k"][:n] == 1
            scaled, mixed = bool(not greedy.all()), bool(greedy.any())
            codes = non_finite_codes(
                rows.amax(dim=-1),
                view.temperature[:n] if scaled else None,
                view.top_k[:n] == 1 if scaled and mixed else None,
                out=self._step_out["non_finite"][:n],
            )
            flagged = codes.bool().unsqueeze(1)
            rows = rows.masked_fill_(flagged, 0) if owned else rows.masked_fill(flagged, 0)
        no_top_k, no_top_p = self._active_requests_sampling_filter_flags(n)
        self._sampling.sample_kernel(
            rows,
            n,
            context,
            no_top_k=no_top_k,
            no_top_p=no_top_p,
            output=self._sampled_tokens_cuda[:n],
        )
        self._eager_flagged = True

    def _transfer_samples_to_cpu(self, active_request_count: int) -> tuple:
        """megatron-core's one copy of the sampled tokens to the host; after a step the region
        sampled, the copy of the region's packed outputs instead (the tokens and the per-row
        ``non_finite`` codes in one copy). The requests whose scores were not finite are noted
        for the bookkeeping (or refused, before it changes anything, where the engine cannot
        fail them alone), after either kind of step."""
        n = active_request_count
        if self._region_sampled:
            self._region_sampled = False
            host = self.fetch_step_outputs()
            samples = host["tokens"][:n].clone(), None
        elif self._eager_flagged:
            self._eager_flagged = False
            host = self._step_out_host.views
            # Queued on the stream before megatron-core's blocking copy of the tokens, whose
            # synchronisation therefore covers it: no synchronisation of its own.
            host["non_finite"][:n].copy_(self._step_out["non_finite"][:n], non_blocking=True)
            samples = super()._transfer_samples_to_cpu(n)
            context = self.inference_wrapped_model.inference_context
            # The active rows' ids, on the host in 0.19.
            ids = context.request_ids[context.paused_request_count : context.total_request_count]
            host = {"non_finite": host["non_finite"], "request_ids": ids}
        else:
            return super()._transfer_samples_to_cpu(n)
        failed = self.non_finite_requests(host, n)
        self._refuse_unless_failable(failed)
        self._step_failed = failed
        return samples

    def _apply_stop_word_finished_ids(
        self, active_request_ids: Tensor, active_request_mask: Tensor
    ):
        """megatron-core's stop-word finishes; the requests to fail leave the context too."""
        super()._apply_stop_word_finished_ids(active_request_ids, active_request_mask)
        failed = self._step_failed
        if failed:
            for row, request_id in enumerate(active_request_ids.tolist()):
                if request_id in failed:
                    active_request_mask[row] = 0

    def _dynamic_step_context_bookkeeping(self) -> Dict[str, Tensor]:
        """megatron-core's bookkeeping, then release finished requests' sampling state; the
        requests to fail are handed to the engine under ``FAILED_REQUESTS_KEY``."""
        self._step_failed = None
        result = super()._dynamic_step_context_bookkeeping()
        if self._step_failed:
            result[FAILED_REQUESTS_KEY] = self._step_failed
        self._step_failed = None
        finished = result.get("finished_request_ids")
        if finished is not None:
            # A host tensor on 0.19: no synchronisation.
            context = self.inference_wrapped_model.inference_context
            context._release_finished_requests(finished.tolist())
        return result
