# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Input checks that run before any launch (aliasing inputs, devices, context-parallel lengths)
and the launch plans of checked calls (every kernel argument named once, in signature order)."""

import pytest
import torch

from megatron_ext.fusions import fused_mla_yarn_rope_apply as rope
from megatron_ext.fusions import tensor_checks
from megatron_ext.fusions.mla_rope import checks, kernels, launch

HAVE_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAVE_CUDA else "cpu")
QK, EMB, K, V, HEADS = 8, 16, 8, 4, 3


def _tables(rows=8, emb=16):
    g = torch.Generator().manual_seed(0)
    return (
        torch.rand(rows, emb, generator=g).to(DEVICE),
        torch.rand(rows, emb, generator=g).to(DEVICE),
    )


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if anything reaches the launch preparation."""

    def refuse(*args, **kwargs):
        raise AssertionError("a launch was prepared")

    monkeypatch.setattr(launch, "configure", refuse)
    rope.clear_autotune_cache()
    yield
    rope.clear_autotune_cache()


def _aliasing_queries():
    base = torch.randn(4, 1, 3, 24, device=DEVICE)
    storage = torch.randn(4 * 2 * 3 * 24, device=DEVICE)
    return {
        "stride 0 in tokens": base[:1].expand(4, 1, 3, 24),
        "stride 0 in batch": base.expand(4, 2, 3, 24),
        "stride 0 in heads": base[:, :, :1].expand(4, 1, 3, 24),
        # Heads 12 elements apart with 24 elements each: every head overlaps the next.
        "overlapping heads": storage.as_strided((4, 2, 3, 24), (144, 72, 12, 1)),
        # Tokens overlapping the previous token's last head.
        "overlapping tokens": storage.as_strided((4, 1, 3, 24), (48, 72, 24, 1)),
    }


@pytest.mark.parametrize("what", list(_aliasing_queries()))
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_self_aliasing_query_is_refused_before_launch(what, backward, no_launch):
    t = _aliasing_queries()[what]
    cos, sin = _tables()
    fn = rope.mla_rope_q_bwd_ if backward else rope.mla_rope_q_fwd_
    before = t.clone()
    with pytest.raises(ValueError, match="share memory"):
        fn(t, cos, sin, 8, 16)
    assert torch.equal(t, before)


def test_self_aliasing_query_is_refused_by_the_drop_in(no_launch):
    t = _aliasing_queries()["stride 0 in heads"]
    cos, sin = _tables()
    with pytest.raises(ValueError, match="share memory"):
        rope.fused_apply_mla_rope_for_q(t, cos, sin, 8, 16)


def _query_inside_a_read_tensor(what):
    """A [4, 1, 3, 24] query whose memory ``what`` (cos, sin, position_ids or cu_seqlens) shares;
    returns the call's keyword arguments."""
    memory = torch.randn(4 * 3 * 24, device=DEVICE)
    t = memory.view(4, 1, 3, 24)
    cos, sin = _tables()
    kwargs = dict(t=t, cos=cos, sin=sin, qk_head_dim=8, emb_dim=16)
    if what in ("cos", "sin"):
        kwargs[what] = memory[: 8 * 16].view(8, 16)
    elif what == "position_ids":
        kwargs["position_ids"] = memory.view(torch.int32)[:4].view(4, 1)
    else:
        kwargs["t"] = t.view(4, 3, 24)
        kwargs["cu_seqlens_q"] = memory.view(torch.int32)[:2]
    return kwargs


@pytest.mark.parametrize("what", ["cos", "sin", "position_ids", "cu_seqlens_q"])
def test_query_sharing_memory_with_a_tensor_it_reads_is_refused_before_launch(what, no_launch):
    """The in-place query kernel would read what it rotates (a schedule-dependent answer): a
    query that shares memory with cos, sin, position_ids or cu_seqlens_q is refused, unchanged."""
    kwargs = _query_inside_a_read_tensor(what)
    before = kwargs["t"].clone()
    with pytest.raises(ValueError, match=f"t overlaps {what}"):
        rope.mla_rope_q_fwd_(**kwargs)
    assert torch.equal(kwargs["t"], before)


@pytest.mark.parametrize("what", ["cos", "sin", "position_ids", "cu_seqlens_q"])
def test_query_sharing_memory_with_a_read_tensor_is_refused_after_a_good_call_of_its_layout(
    what,
):
    """A cached call layout still refuses a query that shares memory with a tensor it reads
    (the layout cannot tell), before the query is changed."""
    rope.clear_autotune_cache()
    bad = _query_inside_a_read_tensor(what)
    good = {name: x.clone() if isinstance(x, torch.Tensor) else x for name, x in bad.items()}
    rope.mla_rope_q_fwd_(**good)
    before = bad["t"].clone()
    with pytest.raises(ValueError, match=f"t overlaps {what}"):
        rope.fused_apply_mla_rope_for_q(**bad)
    assert torch.equal(bad["t"], before)
    rope.clear_autotune_cache()


@pytest.mark.parametrize(
    "shape,strides",
    [
        ((4, 2, 3, 24), (144, 72, 24, 1)),  # contiguous
        ((4, 2, 3, 24), (400, 80, 25, 1)),  # gaps everywhere
        ((4, 2, 3, 24), (72, 288, 24, 1)),  # batch-major storage (a transposed view)
        ((4, 1, 3, 24), (72, 0, 24, 1)),  # stride 0 in a dim of size 1 aliases nothing
    ],
)
def test_views_that_do_not_alias_pass(shape, strides):
    storage = torch.zeros(2000)
    checks.check_no_self_overlap("t", storage.as_strided(shape, strides))


@pytest.mark.skipif(HAVE_CUDA, reason="checks the CPU error; a GPU machine runs CUDA tensors")
def test_cpu_tensor_without_the_interpreter_names_the_device_and_the_fix(monkeypatch, no_launch):
    monkeypatch.setattr(tensor_checks, "INTERPRETED", False)
    t = torch.randn(4, 2, 3, 24)
    cos, sin = _tables()
    with pytest.raises(ValueError, match="t is on the CPU") as err:
        rope.fused_apply_mla_rope_for_q(t, cos, sin, 8, 16)
    assert "TRITON_INTERPRET=1" in str(err.value) and ".cuda()" in str(err.value)
    kv, emb = torch.randn(4, 2, 3, 12), torch.randn(4, 2, 1, 16)
    with pytest.raises(ValueError, match="kv is on the CPU"):
        rope.fused_apply_mla_rope_for_kv(kv, emb, cos, sin, 16, 8, 4)


def test_other_devices_are_refused_with_the_supported_ones_named(no_launch):
    t = torch.empty(4, 2, 3, 24, device="meta")
    with pytest.raises(ValueError, match="meta.*CUDA devices"):
        checks.check_runnable(checks.KERNELS_NAME, "t", t)


def test_context_parallel_lengths():
    checks.check_cp_sequence_lengths([8, 4, 12], 2)
    checks.check_cp_sequence_lengths([3, 5], 1)  # no context parallelism: any length
    with pytest.raises(ValueError, match="multiple of 2 \\* cp_size = 4; sequence 1 has length 6"):
        checks.check_cp_sequence_lengths([8, 6, 4], 2)
    with pytest.raises(ValueError, match="2 of 3 sequences"):
        checks.check_cp_sequence_lengths([6, 8, 10], 2)


def test_odd_local_length_is_what_the_kernels_cannot_see():
    """cp 2, one sequence of 6: the kernels accept it and map positions wrongly (documented as
    unchecked); the host-side check refuses the same lengths."""
    cu = torch.tensor([0, 6], dtype=torch.int32, device=DEVICE)
    cos = torch.arange(8, dtype=torch.float32, device=DEVICE)[:, None].expand(8, 16).contiguous()
    sin = torch.zeros(8, 16, device=DEVICE)
    positions = []
    for rank in range(2):
        q = torch.zeros(3, 1, 16, device=DEVICE)
        q[..., 0::2] = 1.0  # x1 = 1, x2 = 0: the rotated left half is cos, the position
        with launch.pinned_kernel_config(1, 1):
            rope.mla_rope_q_fwd_(q, cos, sin, 0, 16, cu, rank, 2)
        positions.append(q[:, 0, 0].tolist())
    # Position 4 twice and 2 never: not a split of 0..5.
    assert positions == [[0.0, 4.0, 5.0], [1.0, 3.0, 4.0]]
    with pytest.raises(ValueError, match="multiple of 2 \\* cp_size"):
        checks.check_cp_sequence_lengths(torch.diff(cu).tolist(), 2)


# --------------------------------------------------------------------------------------------------
# Launch plans
# --------------------------------------------------------------------------------------------------


def _plan_tables(rows=6):
    g = torch.Generator().manual_seed(0)
    cos = torch.rand(rows, 1, 1, EMB, generator=g).to(DEVICE)
    sin = torch.rand(rows, 1, 1, EMB, generator=g).to(DEVICE)
    return cos, sin


def _every_plan():
    cos, sin = _plan_tables()
    q = torch.zeros(4, 2, HEADS, QK + EMB, device=DEVICE)
    kv = torch.zeros(4, 2, HEADS, K + V, device=DEVICE)
    emb = torch.zeros(4, 2, 1, EMB, device=DEVICE)
    dkey = torch.zeros(4, 2, HEADS, K + EMB, device=DEVICE)
    dvalue = torch.zeros(4, 2, HEADS, V, device=DEVICE)
    query = checks.QueryRope(cos, sin, None, None, QK, EMB, 0, 1, False, False)
    key_value = checks.KeyValueRope(cos, sin, None, None, EMB, K, V, 0, 1, False)
    return {
        "q fwd": checks.plan(kernels.mla_rope_q_fwd_kernel, q, None, query),
        "q bwd": checks.plan(kernels.mla_rope_q_bwd_kernel, q, None, query),
        "q bwd copy": checks.plan(kernels.mla_rope_q_bwd_copy_kernel, q, None, query),
        "kv fwd": checks.plan(kernels.mla_rope_kv_fwd_kernel, kv, emb, key_value),
        "kv bwd": checks.plan(kernels.mla_rope_kv_bwd_kernel, dkey, dvalue, key_value),
    }


@pytest.mark.parametrize("name", ["q fwd", "q bwd", "q bwd copy", "kv fwd", "kv bwd"])
def test_a_plan_names_every_argument_of_its_kernel(name):
    plan = _every_plan()[name]
    names = plan.kernel.arg_names
    assert set(plan.args) | {"BLOCK_H"} == set(names[plan.pointers :])
    assert set(plan.constexprs()) <= set(plan.args)
    assert "EMB_DIM" in plan.constexprs() and "head_num" not in plan.constexprs()
    assert plan.grid(2) == (8, 2, 1)


def test_plans_hold_the_outputs_and_whether_they_write_in_place():
    every = _every_plan()
    assert every["q fwd"].in_place and every["q bwd"].in_place
    assert not every["q bwd copy"].in_place and every["q bwd copy"].outputs == ((4, 2, 3, 24),)
    assert every["kv fwd"].outputs == ((4, 2, 3, K + EMB), (4, 2, 3, V))
    assert every["kv bwd"].outputs == ((4, 2, 3, K + V), (4, 2, 1, EMB))
    # Strides of the copy's output are its own (contiguous), whatever the gradient's are.
    assert every["q bwd copy"].args["stride_out_row"] == 3 * 24
    assert every["q bwd copy"].args["stride_out_h"] == 24


def test_an_empty_call_has_no_grid():
    cos, sin = _plan_tables()
    q = torch.zeros(0, 2, HEADS, QK + EMB, device=DEVICE)
    query = checks.QueryRope(cos, sin, None, None, QK, EMB, 0, 1, False, False)
    plan = checks.plan_query(kernels.mla_rope_q_fwd_kernel, q, query)
    assert plan.grid(4) is None


def test_a_plan_that_does_not_name_the_kernels_parameters_is_refused():
    names = kernels.mla_rope_q_fwd_kernel.arg_names[5:]
    args = {name: 1 for name in names if name != "BLOCK_H"}
    with pytest.raises(RuntimeError, match="names .*'extra'"):
        checks.RopePlan(kernels.mla_rope_q_fwd_kernel, 1, 1, 5, dict(args, extra=1), True)
    del args["stride_h"]
    with pytest.raises(RuntimeError, match="mla_rope_q_fwd_kernel"):
        checks.RopePlan(kernels.mla_rope_q_fwd_kernel, 1, 1, 5, args, True)
    with pytest.raises(RuntimeError, match="after its 4 pointers"):
        checks.RopePlan(kernels.mla_rope_q_fwd_kernel, 1, 1, 4, args, True)


def test_the_copying_backward_reads_an_expanded_gradient_the_in_place_one_refuses():
    cos, sin = _plan_tables()
    g = torch.zeros(4, 1, HEADS, QK + EMB, device=DEVICE).expand(4, 2, HEADS, QK + EMB)
    query = checks.QueryRope(cos, sin, None, None, QK, EMB, 0, 1, False, False)
    assert checks.plan_query(kernels.mla_rope_q_bwd_copy_kernel, g, query, "grad").rows == 8
    with pytest.raises(ValueError, match="share memory"):
        checks.plan_query(kernels.mla_rope_q_bwd_kernel, g, query, "grad")
