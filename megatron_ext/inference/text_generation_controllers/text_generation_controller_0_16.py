# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""``StaticSlicesTextGenerationController`` for megatron-core 0.16.x.

megatron-core 0.16's ``TextGenerationController`` copies every host-side request-metadata label
to pinned host memory each step, buckets the active requests by ``(temperature, top_k, top_p)``
in a Python loop and samples each bucket separately, then derives the termination mask with
``nonzero`` (a host synchronisation). This controller's step instead runs the graph-safe region
(``static_slices_controller_base``), does one device-to-host copy of its packed outputs and one
stream synchronisation, then runs megatron-core's ``update_requests`` unchanged.

The sampling plan comes from the sampling parameters the context recorded when each request was
added (host-only); the region checks on the device that it covers every active row.
"""

import asyncio
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from megatron_ext.inference.engines.dynamic_engine import FAILED_REQUESTS_KEY
from megatron_ext.inference.text_generation_controllers.static_slices_controller_base import (
    SamplingPlan,
    StaticSlicesControllerBase,
)

__all__ = ["StaticSlicesTextGenerationController"]


class StaticSlicesTextGenerationController(StaticSlicesControllerBase):
    """``TextGenerationController`` with a graph-safe, sync-free sampling step (megatron-core
    0.16.x). Takes megatron-core's arguments plus ``cuda_graph_sampling`` and ``sampling_rows``
    (see :class:`StaticSlicesControllerBase`)."""

    def _expected_logits_shape(self) -> Tuple[int, torch.dtype]:
        config = self.inference_wrapped_model.inference_wrapper_config
        return config.padded_vocab_size, config.params_dtype

    def _on_context_buffers_changed(self) -> None:
        # megatron-core 0.16 copies each host-side label from the context into
        # self._request_metadata at every step. Pointing those entries at the context's own
        # tensors turns each copy into a copy of a tensor onto itself, which torch returns from
        # without launching anything; stock methods that still read self._request_metadata then
        # see current values.
        context = self.inference_wrapped_model.inference_context
        for label in list(self._request_metadata):
            self._request_metadata[label] = context.request_metadata[label]

    def sampling_plan(self) -> SamplingPlan:
        """The sampling plan for this step, from the context's host-side record of the requests
        it holds (active or paused): a superset of what the active rows need.

        Returns:
            SamplingPlan: hashable plan; part of the CUDA graph cache key.
        """
        context = self.inference_wrapped_model.inference_context
        return self._clamped_plan(context.sampling_requirements())

    def _dynamic_step_forward_logits(self, input_ids: Tensor, position_ids: Tensor):
        """megatron-core's forward step, then the logits copied into the static buffer."""
        logits = super()._dynamic_step_forward_logits(input_ids, position_ids)
        rows = self._region_rows()
        context = self.inference_wrapped_model.inference_context
        context.publish_active_slices()  # only checks the order: 0.16 builds on the device
        context.extend_active_padding(rows)
        self.stage_logits(logits, rows=rows)
        return logits

    @torch.inference_mode()
    async def async_generate_output_tokens_dynamic_batch(
        self, skip_bookkeeping: Optional[bool] = False
    ) -> Optional[Dict]:
        """Forward step the model, sample, and update the inference context.

        Overrides megatron-core's step because the stock one reads request metadata on the
        host between the GPU stages (bucketing, log-prob flags, termination mask); this one
        runs the graph-safe region and reads everything back in one copy. Returns the same
        keys as megatron-core; tensors are on the host.

        Args:
            skip_bookkeeping (Optional[bool]): skip the context update.

        Returns:
            Optional[Dict]: sample, log_probs, top_n_logprobs, cuda_graph_request_count,
            and (unless skipped) active_request_ids, finished_request_ids,
            newly_paused_request_ids, evict_request_ids; None when there are no tokens.
        """
        context = self.inference_wrapped_model.inference_context
        if context.active_token_count == 0:
            return None
        active_request_count = context.total_request_count - context.paused_request_count

        input_ids, position_ids = self._dynamic_step_context_init()
        cuda_graph_request_count = (
            context.padded_active_request_count if context.is_decode_only() else None
        )
        logits = self._dynamic_step_forward_logits(input_ids, position_ids)

        # Yield to the event loop while the forward kernels run (as megatron-core does).
        await asyncio.sleep(0)

        host = self.run_sampling_step()
        failed = self.non_finite_requests(host, active_request_count)
        self._refuse_unless_failable(failed, can_fail=not skip_bookkeeping)
        tokens = host["tokens"][:active_request_count].clone()
        log_probs, top_n_logprobs = self._step_log_probs(logits, host, active_request_count)

        result = {
            "sample": tokens,
            "log_probs": log_probs,
            "top_n_logprobs": top_n_logprobs,
            "cuda_graph_request_count": cuda_graph_request_count,
        }
        if not skip_bookkeeping:
            result.update(self._step_bookkeeping(host, active_request_count, failed))
            if failed:
                # The engine takes their rows out of this result and fails them.
                result[FAILED_REQUESTS_KEY] = failed
        return result

    def _step_log_probs(
        self, logits: Tensor, host: Dict[str, Tensor], active_request_count: int
    ) -> Tuple[Optional[List[List[float]]], Optional[Dict]]:
        """Log-probs in megatron-core's format, from the region when it has them.

        Prompt log-probs (prefill with full logits) and top-n log-probs take megatron-core's
        own path, outside the region.
        """
        context = self.inference_wrapped_model.inference_context
        wants = bool(host["return_log_probs"][:active_request_count].any())
        wants_top_n = bool((host["top_n_logprobs"][:active_request_count] > 0).any())
        if not (wants or wants_top_n):
            return None, None
        last_token_only = context.materializes_only_last_token_logits or context.is_decode_only()
        if last_token_only and not wants_top_n:
            return [[lp] for lp in host["log_probs"][:active_request_count].tolist()], None
        log_probs, log_probs_tensor = self._dynamic_step_calculate_log_probs(logits)
        top_n_logprobs = None
        if wants_top_n:
            top_n_logprobs = self._dynamic_step_calculate_top_n_logprobs(logits, log_probs_tensor)
        return log_probs, top_n_logprobs

    def _step_bookkeeping(
        self, host: Dict[str, Tensor], active_request_count: int, failed: Dict[int, str]
    ) -> Dict[str, Any]:
        """Finished requests from the region's mask (and the requests to fail, which leave
        the context as finished ones do), then megatron-core's update_requests."""
        context = self.inference_wrapped_model.inference_context
        n = active_request_count
        request_ids = host["request_ids"][:n].clone()
        mask = host["active_mask"][:n].clone()
        device_mask = self._step_out["active_mask"][:n]

        leaving = set(failed)
        if self._get_stop_word_finished_ids_callback is not None:
            leaving |= set(self._get_stop_word_finished_ids_callback(request_ids.tolist()) or ())
        if leaving:
            for idx, request_id in enumerate(request_ids.tolist()):
                if request_id in leaving:
                    mask[idx] = 0
                    device_mask[idx] = 0

        # As in megatron-core, finished ids are taken before update_requests keeps the
        # chunked-prefill request alive.
        finished_request_ids = request_ids[mask == 0]
        # update_requests keeps a view of the tokens it is given (paused tokens).
        new_tokens = self._sampled_tokens_cuda[:n].clone()
        update_result = context.update_requests(device_mask, new_tokens)
        context._release_finished_requests(finished_request_ids.tolist())
        return {
            "active_request_ids": request_ids,
            "finished_request_ids": finished_request_ids,
            **(update_result or {}),
        }
