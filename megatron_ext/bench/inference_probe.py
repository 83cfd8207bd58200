# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The inference benchmark's step probe: host and GPU time, and synchronisations, of the parts of
one controller step (the model forward, ``update_requests``, the sampling region)."""

import functools
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["StepProbe"]

# method -> label of the part it runs, per class the probe derives from.
CONTEXT_PARTS = {"update_requests": "update"}
CONTROLLER_PARTS = {"_dynamic_step_forward_logits": "forward"}
# Only the extension's controller (it has a graph-safe step) runs these.
GRAPH_SAFE_PARTS = {"run_graph_safe_step": "region", "_capture": "capture"}


class StepProbe:
    """Times and counts the parts of a controller step.

    :meth:`instrument` derives subclasses of the context and controller classes whose timed
    methods mark the clock around the class's own method; a stack built from them (see
    ``build_synthetic_stack(instrument=...)``) is stepped by :meth:`run_step` once
    :meth:`attach` has named its controller. Neither megatron-core's classes nor the objects are
    written to.

    Args:
        cuda: whether to record CUDA events (GPU time) besides host time.
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.controller: Any = None
        self.context: Any = None
        self.marks: Dict[str, float] = {}
        self.events: Dict[str, Any] = {}
        self.sync_log: Optional[List[Any]] = None
        self.sync_marks: Dict[str, int] = {}

    def instrument(self, context_class: type, controller_class: type) -> Tuple[type, type]:
        """Subclasses of the two classes whose step parts this probe times.

        Args:
            context_class: the dynamic inference context class to build.
            controller_class: the text generation controller class to build.

        Returns:
            Tuple[type, type]: the timed context and controller classes.
        """
        controller_parts = dict(CONTROLLER_PARTS)
        if hasattr(controller_class, "graph_safe_step"):
            controller_parts.update(GRAPH_SAFE_PARTS)
        return (
            self._timed_subclass(context_class, CONTEXT_PARTS),
            self._timed_subclass(controller_class, controller_parts),
        )

    def attach(self, controller: Any) -> None:
        """Name the (timed) controller, and its context, that :meth:`run_step` steps.

        Args:
            controller: a controller built from :meth:`instrument`'s class.
        """
        self.controller = controller
        self.context = controller.inference_wrapped_model.inference_context

    def _timed_subclass(self, base: type, parts: Dict[str, str]) -> type:
        namespace = {"__module__": __name__, "__qualname__": f"Timed{base.__name__}"}
        for attr, label in parts.items():
            namespace[attr] = self._timed(getattr(base, attr), label)
        return type(f"Timed{base.__name__}", (base,), namespace)

    def _timed(self, method: Callable, label: str) -> Callable:
        @functools.wraps(method)
        def timed(obj: Any, *args: Any, **kwargs: Any) -> Any:
            self._mark(f"{label}_start")
            try:
                return method(obj, *args, **kwargs)
            finally:
                self._mark(f"{label}_end")

        return timed

    def _mark(self, name: str) -> None:
        self.marks[name] = time.perf_counter()
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events[name] = event
        if self.sync_log is not None:
            self.sync_marks[name] = len(self.sync_log)

    def run_step(self) -> Dict[str, float]:
        """One controller step; host and GPU milliseconds of its parts."""
        self.marks, self.events, self.sync_marks = {}, {}, {}
        self._mark("start")
        result = self.controller.generate_output_tokens_dynamic_batch()
        self._mark("end")
        if result is None:
            raise RuntimeError("the benchmark context ran out of active requests")
        m = self.marks
        host = {
            "step_host_ms": (m["end"] - m["start"]) * 1e3,
            "forward_host_ms": (m["forward_end"] - m["forward_start"]) * 1e3,
            "update_host_ms": (m["update_end"] - m["update_start"]) * 1e3,
        }
        host["bookkeeping_host_ms"] = (
            host["step_host_ms"] - host["forward_host_ms"] - host["update_host_ms"]
        )
        if "region_start" in m:
            host["region_host_ms"] = (m["region_end"] - m["region_start"]) * 1e3
        if self.cuda:
            torch.cuda.synchronize()
            e = self.events

            def gap(a: str, b: str) -> float:
                return e[a].elapsed_time(e[b])

            host["bookkeeping_gpu_ms"] = gap("start", "forward_start") + gap(
                "forward_end", "update_start"
            )
            host["update_gpu_ms"] = gap("update_start", "update_end")
        return host

    def count_syncs(self) -> Dict[str, int]:
        """One step under sync debug mode; synchronisations per part of the step."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.sync_log = caught
            torch.cuda.set_sync_debug_mode("warn")
            try:
                self.run_step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
                self.sync_log = None
        syncs = [i for i, w in enumerate(caught) if "synchroniz" in str(w.message)]
        marks = self.sync_marks

        def between(a: str, b: str) -> int:
            if a not in marks or b not in marks:
                return 0
            return sum(marks[a] <= i < marks[b] for i in syncs)

        update = between("update_start", "update_end")
        forward = between("forward_start", "forward_end")
        region = between("region_start", "region_end")
        return {
            "syncs_total": len(syncs),
            "syncs_update_requests": update,
            "syncs_forward": forward,
            "syncs_region": region,
            "syncs_bookkeeping": between("start", "end") - update - forward,
        }
