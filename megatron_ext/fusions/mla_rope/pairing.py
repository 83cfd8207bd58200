# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Which product of each rotated element the MLA RoPE kernels contract into an FMA.

megatron-core's kernels write each rotated element as an unfused sum of two products
(``x1 * cos_l - x2 * sin_l``) and leave the compiler to contract one of them into an FMA whose
addend is the other, rounded. Which one it contracts decides the result's bits, and it is the
compiler's choice: Triton 3.8 lowers a float's unary minus to ``fneg`` where 3.6 and 3.7 emit
``0 - x`` (``triton.language.semantic.minus``), and with that LLVM contracts the backward's
``-x_left * sin_left + x_right * cos_right`` on its second product instead of its first. A
Triton release may also stop contracting altogether (Triton 3.9 warns that FP fusion will be off by
default in 3.10; ``TRITON_DEFAULT_FP_FUSION=0`` does it today).

megatron_ext's kernels write their FMAs out, so their bits depend on neither the compiler nor the
block shape. To give the bits megatron-core's kernels have under the installed Triton, the pairing
is chosen once per (kernel kind, dtypes, device) at first use: each candidate runs on a probe input
beside megatron-core's own kernel at ``BLOCK_H=1`` (its one config whose output is always defined)
and the first candidate whose output matches bitwise is kept
(:mod:`megatron_ext.fusions.mla_rope.probe`). When none matches, :class:`MLARoPEPairingWarning`
says so and the default pairing (what megatron-core compiles to under Triton 3.6 and 3.7) is used;
the output is then as accurate, but not megatron-core's bits.

No probe runs, and the default is used, under the Triton interpreter, on CPU tensors, and while a
CUDA graph is being captured (a choice made then is not kept). The inverse rotation (upstream
Megatron-LM main's ``inverse=True``, in no megatron-core release) has no megatron-core kernel to
probe: it keeps the pairing that upstream's kernel compiles to under Triton 3.6 and 3.7.
:func:`chosen_pairings` reports every choice and how it was made.
"""

import contextlib
import contextvars
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch

# Which product of ``a * b -/+ c * d`` the FMA contracts (the kernels' ``_pair``).
FUSE_FIRST = 0
FUSE_SECOND = 1
UNFUSED = 2

KINDS = ("q_fwd", "q_bwd", "kv_fwd", "kv_bwd")


class MLARoPEPairingWarning(UserWarning):
    """No FMA pairing reproduced megatron-core's kernel: outputs are not its bits."""


@dataclass(frozen=True)
class Pairing:
    """The FMA pairing of the two rotated outputs of a kernel.

    Args:
        first: for the left half (forward) or the even element (backward): FUSE_FIRST,
            FUSE_SECOND or UNFUSED.
        second: the same for the right half (forward) or the odd element (backward).
    """

    first: int
    second: int
    # Derived once, so that a launch plan reads them without a call (see __post_init__).
    kernel_args: Dict[str, int] = field(init=False, repr=False, compare=False)
    compile_options: Dict[str, bool] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if (UNFUSED in (self.first, self.second)) and self.first != self.second:
            # Unfused arithmetic needs FP fusion off for the whole kernel.
            raise ValueError(f"an unfused pairing must be unfused in both outputs, got {self}")
        if not {self.first, self.second} <= {FUSE_FIRST, FUSE_SECOND, UNFUSED}:
            raise ValueError(f"unknown FMA pairing {self}")
        object.__setattr__(self, "kernel_args", {"FMA_1": self.first, "FMA_2": self.second})
        # FP fusion off for unfused arithmetic (the compiler would contract the products itself).
        options = {"enable_fp_fusion": False} if self.first == UNFUSED else {}
        object.__setattr__(self, "compile_options", options)

    def constexprs(self) -> Dict[str, int]:
        """The kernels' FMA_1 / FMA_2 arguments (a copy of :attr:`kernel_args`)."""
        return dict(self.kernel_args)

    def options(self) -> Dict[str, bool]:
        """Triton compile options this pairing needs (a copy of :attr:`compile_options`)."""
        return dict(self.compile_options)


UNFUSED_PAIRING = Pairing(UNFUSED, UNFUSED)
# What megatron-core's kernels compile to under Triton 3.6 and 3.7 (read from their PTX and
# measured bitwise on an H200).
DEFAULTS = {
    "q_fwd": Pairing(FUSE_FIRST, FUSE_SECOND),
    "kv_fwd": Pairing(FUSE_FIRST, FUSE_SECOND),
    "q_bwd": Pairing(FUSE_FIRST, FUSE_FIRST),
    "kv_bwd": Pairing(FUSE_FIRST, FUSE_FIRST),
}
# The order candidates are probed in: the default first, then every other pairing.
_ALL = tuple(Pairing(a, b) for a in (FUSE_FIRST, FUSE_SECOND) for b in (FUSE_FIRST, FUSE_SECOND))
CANDIDATES = {
    kind: (default,) + tuple(p for p in _ALL if p != default) + (UNFUSED_PAIRING,)
    for kind, default in DEFAULTS.items()
}

# (q dtype, cos/sin dtype) pairs whose inverse forward the two-load kernel of upstream main pairs
# on x2 * cos in its right half (H200, Triton 3.6; fp32 q at BLOCK_H 1-4, bf16 q with fp32 tables
# at every BLOCK_H). Equal dtypes and fp16 q with fp32 tables pair it as the non-inverse rotation.
INVERSE_RIGHT_ON_COS = {
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.float32),
}

# The pairing forced by forced_pairing (read directly by the launch cache key and plans).
FORCED: contextvars.ContextVar[Optional[Pairing]] = contextvars.ContextVar(
    "megatron_ext_mla_rope_forced_pairing", default=None
)
# (kind, x dtype, table dtype, str(device)) -> (pairing, how it was chosen); a new launch plan
# looks its pairing up here before asking the probe.
CHOSEN: Dict[Tuple[str, torch.dtype, torch.dtype, str], Tuple[Pairing, str]] = {}


@contextlib.contextmanager
def forced_pairing(pairing: Pairing) -> Iterator[Pairing]:
    """Launch every MLA RoPE kernel with ``pairing`` instead of the chosen one (probes, tests).

    Args:
        pairing: the pairing to use.

    Returns:
        A context manager yielding ``pairing``.
    """
    if not isinstance(pairing, Pairing):
        raise TypeError(f"pairing must be a Pairing, got {type(pairing).__name__}")
    token = FORCED.set(pairing)
    try:
        yield pairing
    finally:
        FORCED.reset(token)


def forced() -> Optional[Pairing]:
    """The pairing forced by :func:`forced_pairing`, or None."""
    return FORCED.get()


def inverse_pairing(x_dtype: torch.dtype, table_dtype: torch.dtype, backward: bool) -> Pairing:
    """The fixed pairing of the inverse rotation (see the module docstring)."""
    if backward:
        return DEFAULTS["q_bwd"]
    right = FUSE_FIRST if (x_dtype, table_dtype) in INVERSE_RIGHT_ON_COS else FUSE_SECOND
    return Pairing(FUSE_FIRST, right)


def choose(
    kind: str,
    x_dtype: torch.dtype,
    table_dtype: torch.dtype,
    device: torch.device,
    probe: Optional[Callable[[Pairing], bool]],
    cacheable: bool = True,
) -> Pairing:
    """The pairing for ``kind`` with these dtypes on ``device``: forced, chosen before, or probed.

    Args:
        kind: one of :data:`KINDS`.
        x_dtype: dtype of the rotated input (q, k_pos_emb or the gradient).
        table_dtype: dtype of cos/sin.
        device: the device the kernels run on.
        probe: runs a candidate on the probe input and says whether it matched megatron-core's
            kernel bitwise; None where no probe can run (the default is used).
        cacheable: whether the choice may be kept (False during CUDA-graph capture).

    Returns:
        Pairing: the pairing to launch with.
    """
    pinned = FORCED.get()
    if pinned is not None:
        return pinned
    key = (kind, x_dtype, table_dtype, str(device))
    known = CHOSEN.get(key)
    if known is not None:
        return known[0]
    if probe is None:
        pairing, how = DEFAULTS[kind], "default (no probe here)"
    else:
        pairing, how = _probe_candidates(kind, x_dtype, table_dtype, probe)
    if cacheable:
        CHOSEN[key] = (pairing, how)
    return pairing


def _probe_candidates(kind, x_dtype, table_dtype, probe) -> Tuple[Pairing, str]:
    try:
        for candidate in CANDIDATES[kind]:
            if probe(candidate):
                return candidate, "probed"
        reason = "no candidate pairing reproduced it"
    except Exception as e:  # a megatron-core release whose kernel cannot be called this way
        reason = f"its kernel could not be run ({type(e).__name__}: {e})"
    warnings.warn(
        f"megatron_ext's MLA RoPE ({kind}, {x_dtype} with {table_dtype} tables) could not match "
        f"megatron-core's kernel under this Triton: {reason}. It uses its default FMA pairing "
        f"{DEFAULTS[kind]}: as accurate, but not megatron-core's bits.",
        MLARoPEPairingWarning,
        stacklevel=3,
    )
    return DEFAULTS[kind], f"default ({reason})"


def chosen_pairings() -> Dict[Tuple[str, torch.dtype, torch.dtype, str], Tuple[Pairing, str]]:
    """Every pairing chosen so far: {(kind, x dtype, table dtype, device): (pairing, how)}."""
    return dict(CHOSEN)


def clear_chosen_pairings() -> None:
    """Forget every choice (the next launch of each kind probes again)."""
    CHOSEN.clear()
