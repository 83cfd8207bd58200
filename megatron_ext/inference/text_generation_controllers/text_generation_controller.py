# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Text generation controller whose sampling step reads the context's static active slices.

megatron-core 0.16's ``TextGenerationController`` copies every host-side request-metadata label
to pinned host memory each step, buckets the active requests by ``(temperature, top_k, top_p)``
in a Python loop and samples each bucket separately, then derives the termination mask with
``nonzero`` (a host synchronisation). None of it can be captured in a CUDA graph.

:class:`StaticSlicesTextGenerationController` instead runs one fixed-shape *graph-safe region*
(:meth:`~StaticSlicesTextGenerationController.graph_safe_step`) over rows
``[0, padded_active_request_count)`` of static buffers:

* inputs: the last-token logits, copied into a static buffer after the forward pass
  (:meth:`~StaticSlicesTextGenerationController.stage_logits`), and the context's
  ``device_active_slices`` (sampling parameters, termination ids, lengths, request ids);
* work: per-row sampling (greedy, temperature, top-k, top-p; all rows at once, parameters read
  as tensors), the log-prob of each sampled token, and the per-request "still active" mask;
* outputs: one packed static buffer (tokens, log-probs, mask, request ids, flags).

The region has no host synchronisation and allocates nothing that outlives it, so it is
captured once per (padded row count, sampling plan) in a CUDA graph and replayed on every later
step with that key, whatever requests were added, paused, resumed or finished in between (the
padding rows are neutral, see ``ACTIVE_METADATA_PAD_VALUES``). After it, the step does one
device-to-host copy of the packed outputs and one stream synchronisation, then runs
megatron-core's ``update_requests`` unchanged.

The *sampling plan* picks which parts of the region exist (greedy only, top-k with a static cap,
top-p, log-probs). It is derived on the host from the sampling parameters of the requests in the
context, recorded when they were added, so no metadata is read back to choose it. On
megatron-core 0.16 the region also checks on the device that the plan covers every active row; if
it ever does not, the step is recomputed with a plan that covers everything (and a warning is
logged). On 0.19 the plan is read from upstream's host-side active slices and is exact.

megatron-core 0.19 already reads request metadata from host-side active slices, keeps logits in
a static buffer when it captures the model, and does its bookkeeping on the host after one
read-back of the sampled tokens. There this controller replaces only the sampling kernels
(``_dynamic_step_sample_logits``) with the region, for the legacy (non-overlapped) scheduling
mode without speculative decoding, reads the plan from those host slices, and leaves
log-probs and bookkeeping to upstream; other modes run upstream's sampler unchanged.
"""

import asyncio
import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)
from torch import Tensor

from megatron_ext.inference.contexts.dynamic_context import (
    UPSTREAM_HAS_ACTIVE_SLICES,
    SamplingRequirements,
    StaticSlicesInferenceContext,
    _PackedBuffer,
)

logger = logging.getLogger(__name__)

# Metadata labels the graph-safe region reads.
REQUIRED_METADATA_LABELS = (
    "temperature",
    "top_k",
    "top_p",
    "termination_id",
    "return_log_probs",
    "top_n_logprobs",
)

# The sampling plan is the host-derived SamplingRequirements, with the top-k cap clamped to the
# vocabulary; it is hashable and keys the CUDA graph cache together with the row count.
SamplingPlan = SamplingRequirements


class StaticSlicesTextGenerationController(TextGenerationController):
    """``TextGenerationController`` with a graph-safe, sync-free sampling step.

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
        if not isinstance(context, StaticSlicesInferenceContext):
            raise TypeError(
                "StaticSlicesTextGenerationController needs a StaticSlicesInferenceContext, got "
                f"{type(context).__name__}; build the context with "
                "megatron_ext.inference.get_inference_context_class()"
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
            ("plan_violation", torch.int32, 1),
        ]
        self._step_out = _PackedBuffer(fields, self._device)
        self._step_out_host = _PackedBuffer(
            fields, torch.device("cpu"), pin_memory=self._device.type == "cuda"
        )
        if not UPSTREAM_HAS_ACTIVE_SLICES:
            # The sampled tokens live in the packed output buffer so that they travel to the
            # host with everything else in one copy. On 0.19 upstream owns this buffer's address
            # (its sampling and bookkeeping read it) and the region writes into it instead.
            self._sampled_tokens_cuda = self._step_out["tokens"]
        self._logits_buffer: Optional[Tensor] = None
        vocab_size, logits_dtype = self._expected_logits_shape()
        self._ensure_logits_buffer(vocab_size, logits_dtype)

        self._graphs: Dict[Tuple[int, SamplingPlan], Any] = {}
        self._graph_pool = None
        self._slices_generation = context.static_slices_generation
        self._warned_plan_violation = False
        self._alias_request_metadata()

    def _expected_logits_shape(self) -> Tuple[int, torch.dtype]:
        if UPSTREAM_HAS_ACTIVE_SLICES:
            return self.vocab_size, self.inference_wrapped_model.config.params_dtype
        config = self.inference_wrapped_model.inference_wrapper_config
        return config.padded_vocab_size, config.params_dtype

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

    def _alias_request_metadata(self) -> None:
        if UPSTREAM_HAS_ACTIVE_SLICES:
            return
        # megatron-core 0.16 copies each host-side label from the context into
        # self._request_metadata at every step. Pointing those entries at the context's own
        # tensors turns each copy into a copy of a tensor onto itself, which torch returns from
        # without launching anything; stock methods that still read self._request_metadata
        # then see current values.
        context = self.inference_wrapped_model.inference_context
        for label in list(self._request_metadata):
            self._request_metadata[label] = context.request_metadata[label]

    def _sync_with_context(self) -> None:
        """Drop graphs and aliases captured over buffers the context has since reallocated."""
        context = self.inference_wrapped_model.inference_context
        if context.static_slices_generation != self._slices_generation:
            self._slices_generation = context.static_slices_generation
            self.clear_cuda_graphs()
            self._alias_request_metadata()

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
        views["tokens"] = self._region_tokens()
        return views

    def _region_tokens(self) -> Tensor:
        return self._sampled_tokens_cuda if UPSTREAM_HAS_ACTIVE_SLICES else self._step_out["tokens"]

    # ---------------------------------------------------------------------- plan

    def sampling_plan(self) -> SamplingPlan:
        """The sampling plan for this step, from the context's host-side requirements.

        Returns:
            SamplingPlan: hashable plan; part of the CUDA graph cache key.
        """
        context = self.inference_wrapped_model.inference_context
        req = context.sampling_requirements()
        vocab_size = self._logits_buffer.shape[1]
        return SamplingPlan(
            sample=req.sample,
            top_k_cap=min(req.top_k_cap, vocab_size),
            top_p=req.top_p,
            log_probs=req.log_probs,
        )

    def _universal_plan(self) -> SamplingPlan:
        return SamplingPlan(
            sample=True, top_k_cap=self._logits_buffer.shape[1], top_p=True, log_probs=True
        )

    # ---------------------------------------------------------------------- region

    def stage_logits(self, logits: Tensor, rows: Optional[int] = None) -> None:
        """Copy the last-token logits of this step into the static logits buffer.

        Runs outside the graph-safe region (the forward pass's output has a new address every
        step). Device-only: no host synchronisation.

        Args:
            logits (Tensor): forward-pass output ``[1, S, V]``: last-token rows when the context
                materializes only last-token logits, else one row per (padded) token.
            rows (Optional[int]): rows to gather when ``logits`` has one row per token; default
                ``max(padded_active_request_count, active requests)``. Padding rows gather row 0.

        Raises:
            ValueError: on a logits shape the buffer cannot hold.
        """
        context = self.inference_wrapped_model.inference_context
        if logits.dim() != 3 or logits.size(0) != 1:
            raise ValueError(f"expected logits of shape [1, S, V], got {tuple(logits.shape)}")
        flat = logits.squeeze(0)
        buffer = self._ensure_logits_buffer(flat.size(1), flat.dtype)
        if context.materializes_only_last_token_logits:
            count = flat.size(0)
            if count > buffer.size(0):
                raise ValueError(f"{count} logit rows exceed the buffer's {buffer.size(0)}")
            buffer[:count].copy_(flat)
        else:
            count = self._region_rows() if rows is None else rows
            index = context.device_active_slices.last_token_idxs[:count]
            torch.index_select(flat, 0, index, out=buffer[:count])

    def _region_rows(self) -> int:
        context = self.inference_wrapped_model.inference_context
        active = context.total_request_count - context.paused_request_count
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

        tokens = torch.argmax(logits, dim=-1)
        if plan.sample:
            sampled = self._sample_rows(logits, meta["temperature"][:rows], top_k, top_p, plan)
            tokens = torch.where(top_k == 1, tokens, sampled)
        self._region_tokens()[:rows].copy_(tokens)

        if plan.log_probs:
            log_probs = F.log_softmax(logits.float(), dim=-1)
            out["log_probs"][:rows].copy_(log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1))

        # megatron-core's termination rule: the new token is the termination id, or the sequence
        # (cached + fed this step + the new token) reaches the request's output length.
        sequence_lengths = slices.kv_length_offsets[:rows] + slices.query_lengths[:rows] + 1
        keep = (tokens != meta["termination_id"][:rows]) & (
            sequence_lengths < slices.output_lengths[:rows]
        )
        out["active_mask"][:rows].copy_(keep)
        request_ids = slices.request_ids[:rows]
        out["request_ids"][:rows].copy_(request_ids)
        wants_log_probs = meta["return_log_probs"][:rows]
        top_n = meta["top_n_logprobs"][:rows]
        out["return_log_probs"][:rows].copy_(wants_log_probs)
        out["top_n_logprobs"][:rows].copy_(top_n)

        # Device-side check that the host-derived plan covers every real row (padding rows have
        # request id -1), so that the plan is an optimisation, never a correctness assumption.
        real = request_ids >= 0
        if not plan.sample:
            missed = top_k != 1
        elif plan.top_k_cap == 0:
            missed = top_k > 1
        else:
            missed = top_k > plan.top_k_cap
        if not plan.top_p:
            missed = missed | ((top_k < 1) & (top_p > 0))
        if not plan.log_probs:
            missed = missed | wants_log_probs | (top_n > 0)
        out["plan_violation"].copy_((missed & real).sum(dtype=torch.int32).reshape(1))

    def _sample_rows(
        self, logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, plan: SamplingPlan
    ) -> Tensor:
        """Per-row temperature / top-k / top-p sampling. GRAPH-SAFE (see graph_safe_step)."""
        scores = logits.float() / temperature.unsqueeze(1)
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
        probs = scores.softmax(dim=-1)
        # argmax(p / E) with E ~ Exp(1) draws from p; this is how torch.multinomial samples one
        # token, minus its validity check, which reads the probabilities back to the host.
        noise = torch.empty_like(probs).exponential_(1.0, generator=self.sampling_rng)
        # A zero draw would turn a filtered (zero-probability) entry into 0/0 = NaN, which argmax
        # would pick.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return torch.argmax(probs / noise, dim=-1)

    def run_graph_safe_step(
        self, rows: int, plan: SamplingPlan, use_cuda_graph: Optional[bool] = None
    ) -> None:
        """Run the graph-safe region eagerly, or replay its CUDA graph (capturing it first).

        Args:
            rows (int): rows to process.
            plan (SamplingPlan): the plan.
            use_cuda_graph (Optional[bool]): default ``self.use_cuda_graphs``.

        Raises:
            TypeError: if rows is not an int or plan not a SamplingPlan.
            ValueError: if rows is outside [1, max_requests].
        """
        context = self.inference_wrapped_model.inference_context
        if isinstance(rows, bool) or not isinstance(rows, int):
            raise TypeError(f"rows must be an int, got {type(rows).__name__}")
        if not 1 <= rows <= context.max_logit_rows:
            raise ValueError(f"rows ({rows}) must be in [1, {context.max_logit_rows}]")
        if not isinstance(plan, SamplingPlan):
            raise TypeError(f"plan must be a SamplingPlan, got {type(plan).__name__}")
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

    def _capture(self, rows: int, plan: SamplingPlan) -> "torch.cuda.CUDAGraph":
        # One eager run on a side stream first (lazy library initialisation must not happen
        # during capture); the generator state is restored so the warm-up draws nothing.
        rng_state = self.sampling_rng.get_state()
        side = torch.cuda.Stream(device=self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            self.graph_safe_step(rows, plan)
        torch.cuda.current_stream(self._device).wait_stream(side)
        self.sampling_rng.set_state(rng_state)

        graph = torch.cuda.CUDAGraph()
        if plan.sample:
            register = getattr(graph, "register_generator_state", None)
            if register is None:
                raise RuntimeError(
                    "capturing sampling needs torch.cuda.CUDAGraph.register_generator_state "
                    "(torch >= 2.5); use cuda_graph_sampling=False"
                )
            # Replays then advance this generator exactly as eager calls would.
            register(self.sampling_rng)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        # Graphs share one pool: every output lives in buffers allocated outside it, so no
        # graph's temporaries are alive when another replays.
        with torch.cuda.graph(graph, pool=self._graph_pool):
            self.graph_safe_step(rows, plan)
        return graph

    def fetch_step_outputs(self) -> Dict[str, Tensor]:
        """Copy the region's outputs to the host: one copy and one stream synchronisation.

        Returns:
            Dict[str, Tensor]: host views (pinned on CUDA) of the packed outputs; valid until
            the next call.
        """
        tokens = self._region_tokens()
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

        Falls back to a plan that covers everything if the device reports that the host-side
        plan missed an active row.

        Args:
            rows (Optional[int]): rows to process; default the padded active request count.

        Returns:
            Dict[str, Tensor]: host views of the outputs (see :meth:`fetch_step_outputs`).
        """
        rows = self._region_rows() if rows is None else rows
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

    # ---------------------------------------------------------------------- engine hooks

    def _dynamic_step_context_init(self, *args: Any, **kwargs: Any):
        """megatron-core's step initialisation (which builds the active slices), after
        dropping state captured over reallocated context buffers."""
        self._sync_with_context()
        return super()._dynamic_step_context_init(*args, **kwargs)

    def _dynamic_step_forward_logits(self, input_ids: Tensor, position_ids: Tensor):
        """megatron-core's forward step, then the logits copied into the static buffer."""
        logits = super()._dynamic_step_forward_logits(input_ids, position_ids)
        rows = self._region_rows()
        self.inference_wrapped_model.inference_context.extend_active_padding(rows)
        if UPSTREAM_HAS_ACTIVE_SLICES:
            # 0.19 leaves the logits in self._all_logits_cuda, which may be its own
            # [1, max_rows, V] buffer; only the leading rows belong to this step.
            context = self.inference_wrapped_model.inference_context
            if context.materializes_only_last_token_logits:
                count = context.num_last_token_logits
            else:
                count = context.padded_active_token_count
            self.stage_logits(self._all_logits_cuda[:, :count], rows=rows)
        else:
            self.stage_logits(logits, rows=rows)
        return logits

    if not UPSTREAM_HAS_ACTIVE_SLICES:

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
            tokens = host["tokens"][:active_request_count].clone()
            log_probs, top_n_logprobs = self._step_log_probs(logits, host, active_request_count)

            result = {
                "sample": tokens,
                "log_probs": log_probs,
                "top_n_logprobs": top_n_logprobs,
                "cuda_graph_request_count": cuda_graph_request_count,
            }
            if not skip_bookkeeping:
                result.update(self._step_bookkeeping(host, active_request_count))
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
            last_token_only = (
                context.materializes_only_last_token_logits or context.is_decode_only()
            )
            if last_token_only and not wants_top_n:
                return [[lp] for lp in host["log_probs"][:active_request_count].tolist()], None
            log_probs, log_probs_tensor = self._dynamic_step_calculate_log_probs(logits)
            top_n_logprobs = None
            if wants_top_n:
                top_n_logprobs = self._dynamic_step_calculate_top_n_logprobs(
                    logits, log_probs_tensor
                )
            return log_probs, top_n_logprobs

        def _step_bookkeeping(
            self, host: Dict[str, Tensor], active_request_count: int
        ) -> Dict[str, Any]:
            """Finished requests from the region's mask, then megatron-core's update_requests."""
            context = self.inference_wrapped_model.inference_context
            n = active_request_count
            request_ids = host["request_ids"][:n].clone()
            mask = host["active_mask"][:n].clone()
            device_mask = self._step_out["active_mask"][:n]

            if self._get_stop_word_finished_ids_callback is not None:
                id_list = request_ids.tolist()
                stop_word_finished_ids = self._get_stop_word_finished_ids_callback(id_list)
                if stop_word_finished_ids:
                    for idx, request_id in enumerate(id_list):
                        if request_id in stop_word_finished_ids:
                            mask[idx] = 0
                            device_mask[idx] = 0

            # As in megatron-core, finished ids are taken before update_requests keeps the
            # chunked-prefill request alive.
            finished_request_ids = request_ids[mask == 0]
            # update_requests keeps a view of the tokens it is given (paused tokens).
            new_tokens = self._sampled_tokens_cuda[:n].clone()
            update_result = context.update_requests(device_mask, new_tokens)
            context.release_request_sampling_state(finished_request_ids.tolist())
            return {
                "active_request_ids": request_ids,
                "finished_request_ids": finished_request_ids,
                **(update_result or {}),
            }

    else:

        def sampling_plan(self) -> SamplingPlan:
            """The sampling plan for this step, read from upstream's host-side active slices.

            On 0.19 the active sampling parameters already sit in pinned host memory, so the
            plan is exact for the active rows (and reading it needs no synchronisation).

            Returns:
                SamplingPlan: hashable plan; part of the CUDA graph cache key.
            """
            context = self.inference_wrapped_model.inference_context
            n = context.total_request_count - context.paused_request_count
            meta = context.active_request_metadata
            top_k = meta["top_k"][:n]
            top_p = meta["top_p"][:n]
            max_top_k = int(top_k.max()) if n else 0
            cap = 0 if max_top_k <= 1 else 1 << (max_top_k - 1).bit_length()
            return SamplingPlan(
                sample=bool((top_k != 1).any()),
                top_k_cap=min(cap, self._logits_buffer.shape[1]),
                top_p=bool(((top_k < 1) & (top_p > 0)).any()),
                log_probs=bool(
                    meta["return_log_probs"][:n].any() or (meta["top_n_logprobs"][:n] > 0).any()
                ),
            )

        def _dynamic_step_sample_logits(self) -> None:
            """Sample with the graph-safe region (legacy scheduling, no speculative decoding);
            megatron-core's sampler otherwise.

            On 0.19 upstream already reads sampling metadata from pinned host slices and does
            its bookkeeping on the host after one read-back of the tokens, so only the sampling
            kernels change here; log-probs and bookkeeping stay upstream's.
            """
            from megatron.core.inference.config import AsyncScheduleMode

            context = self.inference_wrapped_model.inference_context
            if (
                self.num_speculative_tokens
                or context.config.async_sched_mode != AsyncScheduleMode.LEGACY
            ):
                return super()._dynamic_step_sample_logits()
            rows = self._region_rows()
            plan = self.sampling_plan()
            # Upstream computes log-probs itself (raw or processed, per its config).
            plan = SamplingPlan(
                sample=plan.sample, top_k_cap=plan.top_k_cap, top_p=plan.top_p, log_probs=False
            )
            self.run_graph_safe_step(rows, plan)

        def _dynamic_step_context_bookkeeping(self) -> Dict[str, Tensor]:
            """megatron-core's bookkeeping, then release finished requests' sampling state."""
            result = super()._dynamic_step_context_bookkeeping()
            finished = result.get("finished_request_ids")
            if finished is not None:
                # A host tensor on 0.19: no synchronisation.
                context = self.inference_wrapped_model.inference_context
                context.release_request_sampling_state(finished.tolist())
            return result


__all__ = ["REQUIRED_METADATA_LABELS", "SamplingPlan", "StaticSlicesTextGenerationController"]
