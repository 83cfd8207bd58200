# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The probe finds the pairing whose bits are megatron-core's kernel's, as compiled here.

On the CPU the probe runs both kernels in the Triton interpreter, which never contracts products
into FMAs: there it must find the unfused pairing (where the interpreter's ``tl.fma`` rounds once).
On the GPU it must find a pairing for every kernel kind and dtype pair, and that pairing must have
megatron-core's bits on a fresh input too (what the bitwise tests then rely on).
"""

import pytest
import torch
import triton

from megatron_ext.fusions.fused_mla_yarn_rope_apply import (
    mla_rope_kv_bwd,
    mla_rope_kv_fwd,
    mla_rope_q_bwd_,
    mla_rope_q_fwd_,
    pinned_kernel_config,
)
from megatron_ext.fusions.mla_rope import pairing
from megatron_ext.fusions.mla_rope.probe import pairing_for, probe_pairing
from tests.unit_tests.fusions.mla_rope_testlib import (
    DTYPES,
    INTERPRETED,
    assert_bitwise_equal,
    interpreter_fma_is_fused,
    make_case,
    make_tables,
    randn,
    run_mcore_kv_bwd,
    run_mcore_kv_fwd,
    run_mcore_q,
)

HAVE_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAVE_CUDA else "cpu")
HEADS, NOPE, EMB, K, V = 4, 16, 64, 16, 16


def _run_both(kind, x_dtype, table_dtype, fma, seed):
    """(ours at ``fma``, megatron-core at BLOCK_H=1) on a fresh input of another shape."""
    g = torch.Generator().manual_seed(seed)
    seq_len, batch = (64, 4) if HAVE_CUDA else (5, 3)  # the interpreter is slow
    case = make_case("sbhd", HEADS, DEVICE, NOPE, EMB, seq_len=seq_len, batch=batch, generator=g)
    cos, sin = make_tables(case.table_rows, EMB, DTYPES[table_dtype], DEVICE, generator=g)
    x_dt = DTYPES[x_dtype]
    with pairing.forced_pairing(fma), pinned_kernel_config(4, 1):
        if kind in ("q_fwd", "q_bwd"):
            t = randn(case.lead + (HEADS, NOPE + EMB), x_dt, DEVICE, g)
            fn = mla_rope_q_fwd_ if kind == "q_fwd" else mla_rope_q_bwd_
            ours = fn(t.clone(), cos, sin, NOPE, EMB)
            theirs = run_mcore_q(kind == "q_bwd", case, t.clone(), cos, sin, 1)
        elif kind == "kv_fwd":
            kv = randn(case.lead + (HEADS, K + V), x_dt, DEVICE, g)
            emb = randn(case.lead + (1, EMB), x_dt, DEVICE, g)
            ours = mla_rope_kv_fwd(kv, emb, cos, sin, EMB, K, V)[0]
            theirs = run_mcore_kv_fwd(case, kv, emb, cos, sin, K, V, 1)[0]
        else:
            dkey = randn(case.lead + (HEADS, K + EMB), x_dt, DEVICE, g)
            dvalue = randn(case.lead + (HEADS, V), x_dt, DEVICE, g)
            ours = mla_rope_kv_bwd(dkey, dvalue, cos, sin, EMB, K, V)[1]
            theirs = run_mcore_kv_bwd(case, dkey, dvalue, cos, sin, K, V, 1)[1]
    return ours.reshape(theirs.shape), theirs


@pytest.mark.skipif(not INTERPRETED, reason="the probe under the Triton interpreter (CPU)")
@pytest.mark.parametrize("kind", pairing.KINDS)
def test_probe_in_the_interpreter_finds_megatron_cores_arithmetic(kind):
    found = probe_pairing(kind, torch.float32, torch.float32, torch.device("cpu"))
    assert found is not None, "no candidate reproduced megatron-core's kernel in the interpreter"
    if interpreter_fma_is_fused():
        assert found == pairing.UNFUSED_PAIRING, "the interpreter does not contract products"
    ours, theirs = _run_both(kind, "fp32", "fp32", found, seed=51)
    assert_bitwise_equal(ours, theirs, f"{kind} at the probed pairing {found} vs megatron-core")


def test_no_probe_under_the_interpreter_or_on_cpu():
    pairing.clear_chosen_pairings()
    got = pairing_for("q_bwd", torch.float32, torch.float32, torch.device("cpu"), False)
    assert got == pairing.DEFAULTS["q_bwd"]
    ((_, how),) = pairing.chosen_pairings().values()
    assert how == "default (no probe here)"
    pairing.clear_chosen_pairings()


def test_the_inverse_rotation_keeps_its_fixed_pairing():
    fwd = pairing_for("q_fwd", torch.float32, torch.bfloat16, DEVICE, True)
    assert fwd == pairing.Pairing(pairing.FUSE_FIRST, pairing.FUSE_FIRST)
    assert (
        pairing_for("q_fwd", torch.float16, torch.float16, DEVICE, True)
        == pairing.DEFAULTS["q_fwd"]
    )
    assert (
        pairing_for("q_bwd", torch.float32, torch.bfloat16, DEVICE, True)
        == pairing.DEFAULTS["q_bwd"]
    )


GPU_DTYPE_PAIRS = [("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32"), ("bf16", "fp32")]
GPU_DTYPE_PAIRS += [("fp16", "fp32"), ("fp32", "bf16")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", GPU_DTYPE_PAIRS, ids=lambda d: f"x{d[0]}-cs{d[1]}")
@pytest.mark.parametrize("kind", pairing.KINDS)
def test_gpu_probe_finds_a_pairing_with_megatron_cores_bits(kind, dtypes, capsys):
    x_dtype, table_dtype = (DTYPES[d] for d in dtypes)
    found = probe_pairing(kind, x_dtype, table_dtype, DEVICE)
    assert found is not None, (
        f"megatron-core's {kind} kernel, as Triton {triton.__version__} compiles it, matches no "
        "candidate pairing: its arithmetic changed beyond FMA pairing (megatron-core's bits moved)"
    )
    assert pairing_for(kind, x_dtype, table_dtype, DEVICE, False) == found
    matching = []
    for candidate in pairing.CANDIDATES[kind]:
        ours, theirs = _run_both(kind, *dtypes, candidate, seed=52)
        if torch.equal(
            ours.view(torch.int16 if ours.element_size() == 2 else torch.int32),
            theirs.view(torch.int16 if theirs.element_size() == 2 else torch.int32),
        ):
            matching.append(candidate)
    # Where the output dtype rounds the candidates' differences away (bf16 output of fp32
    # arithmetic, say) several candidates have megatron-core's bits; the probe's must be one.
    assert (
        found in matching
    ), f"on a fresh input megatron-core's bits are those of {matching}, the probe chose {found}"
    with capsys.disabled():
        print(
            f"\n[pairing] triton {triton.__version__} {kind} {dtypes}: {found}; "
            f"candidates with megatron-core's bits on a fresh input: {matching}"
        )
