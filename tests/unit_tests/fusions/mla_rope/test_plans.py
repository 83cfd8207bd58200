# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Launch plans: every kernel argument named once, in the kernel's signature order."""

import pytest
import torch

from megatron_ext.fusions.mla_rope import kernels, plans

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
QK, EMB, K, V, HEADS = 8, 16, 8, 4, 3


def _tables(rows=6):
    g = torch.Generator().manual_seed(0)
    cos = torch.rand(rows, 1, 1, EMB, generator=g).to(DEVICE)
    sin = torch.rand(rows, 1, 1, EMB, generator=g).to(DEVICE)
    return cos, sin


def _every_plan():
    cos, sin = _tables()
    q = torch.zeros(4, 2, HEADS, QK + EMB, device=DEVICE)
    kv = torch.zeros(4, 2, HEADS, K + V, device=DEVICE)
    emb = torch.zeros(4, 2, 1, EMB, device=DEVICE)
    dkey = torch.zeros(4, 2, HEADS, K + EMB, device=DEVICE)
    dvalue = torch.zeros(4, 2, HEADS, V, device=DEVICE)
    q_args = (q, cos, sin, QK, EMB, None, 0, 1, False, False, None, "t")
    return {
        "q fwd": plans.plan_q(kernels.mla_rope_q_fwd_kernel, *q_args),
        "q bwd": plans.plan_q(kernels.mla_rope_q_bwd_kernel, *q_args),
        "q bwd copy": plans.plan_q(kernels.mla_rope_q_bwd_copy_kernel, *q_args),
        "kv fwd": plans.plan_kv_fwd(kv, emb, cos, sin, EMB, K, V, None, 0, 1, False, None),
        "kv bwd": plans.plan_kv_bwd(dkey, dvalue, cos, sin, EMB, K, V, None, 0, 1, False, None),
    }


@pytest.mark.parametrize("name", ["q fwd", "q bwd", "q bwd copy", "kv fwd", "kv bwd"])
def test_a_plan_names_every_argument_of_its_kernel(name):
    plan = _every_plan()[name]
    names = plan.kernel.arg_names
    tail = plan.tail(4)
    assert len(tail) == len(names) - plan.pointers
    for value, param in zip(tail, names[plan.pointers :]):
        assert value == (4 if param == "BLOCK_H" else plan.args[param]), param
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
    cos, sin = _tables()
    q = torch.zeros(0, 2, HEADS, QK + EMB, device=DEVICE)
    plan = plans.plan_q(
        kernels.mla_rope_q_fwd_kernel, q, cos, sin, QK, EMB, None, 0, 1, False, False, None, "t"
    )
    assert plan.grid(4) is None


def test_a_plan_that_does_not_name_the_kernels_parameters_is_refused():
    names = kernels.mla_rope_q_fwd_kernel.arg_names[5:]
    args = {name: 1 for name in names if name != "BLOCK_H"}
    with pytest.raises(RuntimeError, match="names .*'extra'"):
        plans.LaunchPlan(kernels.mla_rope_q_fwd_kernel, 1, 1, 5, dict(args, extra=1), True)
    del args["stride_h"]
    with pytest.raises(RuntimeError, match="mla_rope_q_fwd_kernel"):
        plans.LaunchPlan(kernels.mla_rope_q_fwd_kernel, 1, 1, 5, args, True)
    with pytest.raises(RuntimeError, match="after its 4 pointers"):
        plans.LaunchPlan(kernels.mla_rope_q_fwd_kernel, 1, 1, 4, args, True)


def test_the_copying_backward_reads_an_expanded_gradient_the_in_place_one_refuses():
    cos, sin = _tables()
    g = torch.zeros(4, 1, HEADS, QK + EMB, device=DEVICE).expand(4, 2, HEADS, QK + EMB)
    args = (g, cos, sin, QK, EMB, None, 0, 1, False, False, None, "grad")
    assert plans.plan_q(kernels.mla_rope_q_bwd_copy_kernel, *args).rows == 8
    with pytest.raises(ValueError, match="share memory"):
        plans.plan_q(kernels.mla_rope_q_bwd_kernel, *args)
