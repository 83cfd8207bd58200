# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""``StaticSlicesTextGenerationController`` for megatron-core 0.19.x.

megatron-core 0.19 already reads request metadata from host-side active slices, keeps logits in
a static buffer when it captures the model, and does its bookkeeping on the host after one
read-back of the sampled tokens. Here the controller replaces only the sampling kernels
(``_dynamic_step_sample_logits``) with the graph-safe region, for the legacy (non-overlapped)
scheduling mode without speculative decoding, reads the plan from those host slices (exact for
the active rows, no synchronisation), and leaves log-probs and bookkeeping to upstream; other
modes run upstream's sampler unchanged.
"""

from typing import Dict, Tuple

import torch
from megatron.core.inference.config import AsyncScheduleMode
from torch import Tensor

from megatron_ext.inference.contexts.sampling_registry import top_k_cap_for
from megatron_ext.inference.text_generation_controllers.static_slices_base import (
    SamplingPlan,
    StaticSlicesControllerBase,
)

__all__ = ["StaticSlicesTextGenerationController"]


class StaticSlicesTextGenerationController(StaticSlicesControllerBase):
    """``TextGenerationController`` with a graph-safe, sync-free sampler (megatron-core 0.19.x).
    Takes megatron-core's arguments plus ``cuda_graph_sampling`` and ``sampling_rows`` (see
    :class:`StaticSlicesControllerBase`)."""

    # Upstream owns the sampled-token buffer's address (its bookkeeping reads it).
    _OWNS_SAMPLED_TOKENS = False

    def _expected_logits_shape(self) -> Tuple[int, torch.dtype]:
        return self.vocab_size, self.inference_wrapped_model.config.params_dtype

    def sampling_plan(self) -> SamplingPlan:
        """The sampling plan for this step, read from upstream's host-side active slices (exact
        for the active rows; reading pinned host memory needs no synchronisation).

        Returns:
            SamplingPlan: hashable plan; part of the CUDA graph cache key.
        """
        context = self.inference_wrapped_model.inference_context
        n = self._active_request_count()
        meta = context.active_request_metadata
        top_k = meta["top_k"][:n]
        top_p = meta["top_p"][:n]
        unfiltered = top_k < 1
        plan = SamplingPlan(
            sample=bool((top_k != 1).any()),
            top_k_cap=top_k_cap_for(int(top_k.max()) if n else 0),
            top_p=bool((unfiltered & (top_p > 0)).any()),
            log_probs=bool(
                meta["return_log_probs"][:n].any() or (meta["top_n_logprobs"][:n] > 0).any()
            ),
            greedy=bool((top_k == 1).any()),
            full_vocab=bool((unfiltered & (top_p <= 0)).any()),
        )
        return self._clamped_plan(plan)

    def _dynamic_step_forward_logits(self, input_ids: Tensor, position_ids: Tensor):
        """megatron-core's forward step, then this step's logits rows copied into the static
        buffer."""
        logits = super()._dynamic_step_forward_logits(input_ids, position_ids)
        rows = self._region_rows()
        context = self.inference_wrapped_model.inference_context
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
        """Sample with the graph-safe region (legacy scheduling, no speculative decoding);
        megatron-core's sampler otherwise."""
        context = self.inference_wrapped_model.inference_context
        if (
            self.num_speculative_tokens
            or context.config.async_sched_mode != AsyncScheduleMode.LEGACY
        ):
            return super()._dynamic_step_sample_logits()
        plan = self.sampling_plan()
        # Upstream computes log-probs itself (raw or processed, per its config).
        plan = SamplingPlan(**{**plan.__dict__, "log_probs": False})
        self.run_graph_safe_step(self._region_rows(), plan)

    def _dynamic_step_context_bookkeeping(self) -> Dict[str, Tensor]:
        """megatron-core's bookkeeping, then release finished requests' sampling state."""
        result = super()._dynamic_step_context_bookkeeping()
        finished = result.get("finished_request_ids")
        if finished is not None:
            # A host tensor on 0.19: no synchronisation.
            context = self.inference_wrapped_model.inference_context
            context.release_request_sampling_state(finished.tolist())
        return result
