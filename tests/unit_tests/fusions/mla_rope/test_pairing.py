# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The FMA pairing: how it is chosen (forced, cached, probed, default with a warning), and that
every candidate pairing's kernels compute exactly the arithmetic the pairing names."""

import warnings

import pytest
import torch

from megatron_ext.fusions.fused_mla_yarn_rope_apply import (
    mla_rope_kv_bwd,
    mla_rope_kv_fwd,
    mla_rope_q_bwd_,
    mla_rope_q_fwd_,
    pinned_kernel_config,
)
from megatron_ext.fusions.mla_rope import pairing
from megatron_ext.fusions.mla_rope.pairing import (
    CANDIDATES,
    DEFAULTS,
    FUSE_FIRST,
    FUSE_SECOND,
    UNFUSED,
    MLARoPEPairingWarning,
    Pairing,
    choose,
    forced_pairing,
)
from tests.unit_tests.fusions.mla_rope_testlib import (
    DTYPES,
    INTERPRETED,
    assert_bitwise_equal,
    interpreter_fma_is_fused,
    kv_backward_reference,
    kv_forward_reference,
    make_case,
    make_tables,
    q_backward_reference,
    q_forward_reference,
    randn,
)

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_choices():
    saved = pairing.chosen_pairings()
    pairing.clear_chosen_pairings()
    yield
    pairing.clear_chosen_pairings()
    pairing.CHOSEN.update(saved)


def _probe_matching(target):
    calls = []

    def probe(candidate):
        calls.append(candidate)
        return candidate == target

    return probe, calls


@pytest.mark.parametrize("kind", pairing.KINDS)
def test_candidates_start_with_the_default_and_cover_every_pairing(kind):
    candidates = CANDIDATES[kind]
    assert candidates[0] == DEFAULTS[kind]
    assert len(set(candidates)) == len(candidates) == 5
    fused = {Pairing(a, b) for a in (FUSE_FIRST, FUSE_SECOND) for b in (FUSE_FIRST, FUSE_SECOND)}
    assert set(candidates) == fused | {Pairing(UNFUSED, UNFUSED)}


def test_pairing_refuses_half_unfused_and_unknown_values():
    with pytest.raises(ValueError, match="unfused in both"):
        Pairing(UNFUSED, FUSE_FIRST)
    with pytest.raises(ValueError, match="unknown FMA pairing"):
        Pairing(3, 3)
    assert Pairing(UNFUSED, UNFUSED).options() == {"enable_fp_fusion": False}
    assert Pairing(FUSE_FIRST, FUSE_SECOND).options() == {}
    assert Pairing(FUSE_SECOND, FUSE_FIRST).constexprs() == {"FMA_1": 1, "FMA_2": 0}


def test_choose_probes_in_order_once_and_caches_the_match():
    target = CANDIDATES["q_bwd"][2]
    probe, calls = _probe_matching(target)
    args = ("q_bwd", torch.bfloat16, torch.bfloat16, CPU)
    assert choose(*args, probe) == target
    assert calls == list(CANDIDATES["q_bwd"][:3])
    probe2, calls2 = _probe_matching(None)
    assert choose(*args, probe2) == target, "a second launch re-probed"
    assert calls2 == []
    (how,) = [how for key, (p, how) in pairing.chosen_pairings().items() if key[0] == "q_bwd"]
    assert how == "probed"


def test_choose_keys_by_kind_dtypes_and_device():
    probe, _ = _probe_matching(CANDIDATES["q_fwd"][1])
    choose("q_fwd", torch.float32, torch.float32, CPU, probe)
    other, calls = _probe_matching(CANDIDATES["q_fwd"][3])
    assert choose("q_fwd", torch.float32, torch.bfloat16, CPU, other) == CANDIDATES["q_fwd"][3]
    assert calls, "another table dtype reused the first choice"


def test_no_match_warns_and_uses_the_default():
    probe, calls = _probe_matching(None)
    with pytest.warns(MLARoPEPairingWarning, match="no candidate pairing reproduced it"):
        got = choose("kv_bwd", torch.float16, torch.float32, CPU, probe)
    assert got == DEFAULTS["kv_bwd"]
    assert calls == list(CANDIDATES["kv_bwd"])
    ((_, how),) = pairing.chosen_pairings().values()
    assert how.startswith("default (no candidate")


def test_a_probe_that_cannot_run_megatron_core_warns_with_the_reason():
    def probe(candidate):
        raise TypeError("rotary_fwd_q_kernel() got an unexpected keyword argument 'emb_dim'")

    with pytest.warns(MLARoPEPairingWarning, match="could not be run .*TypeError.*emb_dim"):
        assert choose("q_fwd", torch.bfloat16, torch.bfloat16, CPU, probe) == DEFAULTS["q_fwd"]


def test_no_probe_means_the_default_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose("kv_fwd", torch.float32, torch.float32, CPU, None) == DEFAULTS["kv_fwd"]


def test_a_choice_during_capture_is_not_kept():
    probe, _ = _probe_matching(CANDIDATES["q_fwd"][0])
    choose("q_fwd", torch.float32, torch.float32, CPU, None, cacheable=False)
    assert pairing.chosen_pairings() == {}
    assert choose("q_fwd", torch.float32, torch.float32, CPU, probe) == CANDIDATES["q_fwd"][0]


def test_forced_wins_over_everything_and_is_undone():
    probe, calls = _probe_matching(DEFAULTS["q_fwd"])
    chosen = Pairing(FUSE_SECOND, FUSE_SECOND)
    with forced_pairing(chosen):
        assert choose("q_fwd", torch.float32, torch.float32, CPU, probe) == chosen
    assert calls == [] and pairing.forced() is None
    with pytest.raises(TypeError, match="Pairing"):
        with forced_pairing((0, 1)):
            pass


# --------------------------------------------------------------------------------------------------
# Every candidate's kernels compute the arithmetic it names (interpreter, fp32)
# --------------------------------------------------------------------------------------------------

ALL_PAIRINGS = sorted({p for candidates in CANDIDATES.values() for p in candidates}, key=str)


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    case = make_case("sbhd", 3, CPU, qk_head_dim=8, emb_dim=16, generator=g)
    t = randn(case.lead + (3, 24), DTYPES["fp32"], CPU, g)
    cos, sin = make_tables(case.table_rows, 16, DTYPES["fp32"], CPU, generator=g)
    return g, case, t, cos, sin


@pytest.mark.skipif(not INTERPRETED, reason="CPU check of the kernels' arithmetic (interpreter)")
@pytest.mark.parametrize("inverse", [False, True], ids=["rot", "inv"])
@pytest.mark.parametrize("fma", ALL_PAIRINGS, ids=str)
def test_every_pairing_computes_its_arithmetic_q(fma, inverse):
    _, case, t, cos, sin = _inputs(41)
    with forced_pairing(fma), pinned_kernel_config(2, 1):
        fwd = mla_rope_q_fwd_(t.clone(), cos, sin, 8, 16, inverse=inverse)
        bwd = mla_rope_q_bwd_(t.clone(), cos, sin, 8, 16, inverse=inverse)
        want_fwd = q_forward_reference(case, t, cos, sin, inverse, exact_model=True)
        want_bwd = q_backward_reference(case, t, cos, sin, inverse, exact_model=True)
    assert_bitwise_equal(fwd.reshape(want_fwd.shape), want_fwd, f"forward at {fma}")
    assert_bitwise_equal(bwd.reshape(want_bwd.shape), want_bwd, f"backward at {fma}")


@pytest.mark.skipif(not INTERPRETED, reason="CPU check of the kernels' arithmetic (interpreter)")
@pytest.mark.parametrize("fma", ALL_PAIRINGS, ids=str)
def test_every_pairing_computes_its_arithmetic_kv(fma):
    g, case, _, cos, sin = _inputs(42)
    kv = randn(case.lead + (3, 16), DTYPES["fp32"], CPU, g)
    emb = randn(case.lead + (1, 16), DTYPES["fp32"], CPU, g)
    dkey = randn(case.lead + (3, 24), DTYPES["fp32"], CPU, g)
    dvalue = randn(case.lead + (3, 8), DTYPES["fp32"], CPU, g)
    with forced_pairing(fma), pinned_kernel_config(2, 1):
        key, _ = mla_rope_kv_fwd(kv, emb, cos, sin, 16, 8, 8)
        _, d_emb = mla_rope_kv_bwd(dkey, dvalue, cos, sin, 16, 8, 8)
        want_key, _ = kv_forward_reference(case, kv, emb, cos, sin, 8, exact_model=True)
        _, want_demb = kv_backward_reference(case, dkey, dvalue, cos, sin, 8, exact_model=True)
    assert_bitwise_equal(key.reshape(want_key.shape), want_key, f"key at {fma}")
    assert_bitwise_equal(d_emb.reshape(want_demb.shape), want_demb, f"d_emb at {fma}")


@pytest.mark.skipif(not INTERPRETED, reason="CPU check of the kernels' arithmetic (interpreter)")
def test_pairings_differ_somewhere():
    """The probe can only tell pairings apart if they give other bits on real inputs: in fp32 each
    pair of fused pairings differs on some element of a 3-head input."""
    if not interpreter_fma_is_fused():
        pytest.skip("this Triton's interpreter rounds tl.fma twice: every fused pairing is unfused")
    _, case, t, cos, sin = _inputs(43)
    outs = {}
    for fma in [p for p in ALL_PAIRINGS if p.first != UNFUSED]:
        with forced_pairing(fma), pinned_kernel_config(2, 1):
            outs[fma] = mla_rope_q_bwd_(t.clone(), cos, sin, 8, 16).view(torch.int32)
    for a in outs:
        for b in outs:
            if a != b:
                assert not torch.equal(outs[a], outs[b]), f"{a} and {b} gave the same bits"
