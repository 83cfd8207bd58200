# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Launch configs, the tuner, and the cached plans (direct C launch and its JIT fallback)."""

import pytest
import torch

from megatron_ext import internals
from megatron_ext.fusions import direct_launch
from megatron_ext.fusions import fused_mla_yarn_rope_apply as rope
from megatron_ext.fusions import tensor_checks
from megatron_ext.fusions.launch_plans import PlanCache
from megatron_ext.fusions.mla_rope import checks, kernels, launch
from megatron_ext.fusions.mla_rope.launch import KernelConfig, pinned_kernel_config

HAVE_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAVE_CUDA else "cpu")


def _q_inputs(heads=3, seq=4, batch=2, qk=8, emb=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(seq, batch, heads, qk + emb, generator=g).to(dtype).to(DEVICE)
    cos = torch.rand(seq + 2, 1, 1, emb, generator=g).to(dtype).to(DEVICE)
    sin = torch.rand(seq + 2, 1, 1, emb, generator=g).to(dtype).to(DEVICE)
    return t, cos, sin


def _kv_inputs(heads=3, seq=4, batch=2, k=8, v=4, emb=16, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(seq, batch, heads, k + v, generator=g).to(dtype).to(DEVICE)
    emb_t = torch.randn(seq, batch, 1, emb, generator=g).to(dtype).to(DEVICE)
    cos = torch.rand(seq + 2, 1, 1, emb, generator=g).to(dtype).to(DEVICE)
    sin = torch.rand(seq + 2, 1, 1, emb, generator=g).to(dtype).to(DEVICE)
    return kv, emb_t, cos, sin


@pytest.fixture(autouse=True)
def _fresh_cache():
    rope.clear_autotune_cache()
    yield
    rope.clear_autotune_cache()


# ----------------------------------------------------------------------------------------------
# Configs, pinning, tuning


def test_kernel_config_validation_and_pinning():
    with pytest.raises(ValueError, match="block_h"):
        KernelConfig(3)
    with pytest.raises(ValueError, match="num_warps"):
        KernelConfig(4, 3)
    assert launch.PINNED.get() is None
    with pinned_kernel_config(8, 2) as config:
        assert config == KernelConfig(8, 2) and launch.current_config() == config
    assert launch.PINNED.get() is None


def test_facade_reexports_the_launch_names():
    for name in (
        "KernelConfig",
        "AUTOTUNE_CONFIGS",
        "BLOCK_H_CHOICES",
        "pinned_kernel_config",
        "clear_autotune_cache",
        "autotuned_configs",
    ):
        assert getattr(rope, name) is getattr(launch, name)


def test_backward_uses_config_pinned_in_forward(monkeypatch):
    t, cos, sin = _q_inputs()
    seen = []
    configure = launch.configure

    def spy(key, plan, *args, **kwargs):
        seen.append((plan.kernel, launch.current_config()))
        return configure(key, plan, *args, **kwargs)

    monkeypatch.setattr(launch, "configure", spy)
    q = t.clone().requires_grad_(True) * 1.0
    with pinned_kernel_config(2, 1):
        out = rope.fused_apply_mla_rope_for_q(q, cos, sin, 8, 16)
    (out * 2).sum().backward()
    assert seen == [
        (kernels.mla_rope_q_fwd_kernel, KernelConfig(2, 1)),
        (kernels.mla_rope_q_bwd_kernel, KernelConfig(2, 1)),
    ]


def test_autotuner_times_on_scratch_and_caches(monkeypatch):
    """The tuner times every config on a scratch copy, keeps the fastest, and caches it per size."""
    monkeypatch.setattr(launch, "INTERPRETED", False)
    monkeypatch.setattr(tensor_checks, "INTERPRETED", True)  # CPU tensors stay allowed
    calls = []

    def fake_benchmark(run):
        run()  # runs on the scratch tensor
        calls.append(run.__defaults__[0])
        return 100.0 - len(calls)  # each later candidate is "faster": the last one wins

    monkeypatch.setattr(launch, "benchmark_us", fake_benchmark)
    t, cos, sin = _q_inputs()
    x = t.clone()
    rope.mla_rope_q_fwd_(x, cos, sin, 8, 16)
    # 3 heads: only blocks of up to 4 heads are candidates.
    expected = [c for c in rope.AUTOTUNE_CONFIGS if c.block_h <= 4]
    assert calls == expected
    assert list(rope.autotuned_configs().values()) == [expected[-1]]
    # The input was rotated exactly once, by the final launch.
    once = t.clone()
    with pinned_kernel_config(1, 1):
        rope.mla_rope_q_fwd_(once, cos, sin, 8, 16)
    assert torch.equal(x, once)
    # Same variant and size: cached, no timing. Another token bucket: tuned again.
    rope.mla_rope_q_fwd_(t.clone(), cos, sin, 8, 16)
    assert len(calls) == len(expected)
    rope.mla_rope_q_fwd_(t[:1].clone(), cos, sin, 8, 16)
    assert len(calls) == 2 * len(expected) and len(rope.autotuned_configs()) == 2
    rope.clear_autotune_cache()
    assert rope.autotuned_configs() == {} and len(launch.PLANS) == 0


# ----------------------------------------------------------------------------------------------
# The cache


def _count_prepares(monkeypatch):
    calls = []
    configure = launch.configure

    def spy(*args, **kwargs):
        calls.append(args[1].kernel)
        return configure(*args, **kwargs)

    monkeypatch.setattr(launch, "configure", spy)
    return calls


def test_second_call_is_a_cache_hit_and_gives_the_same_bits(monkeypatch):
    prepares = _count_prepares(monkeypatch)
    t, cos, sin = _q_inputs()
    kv, emb, kcos, ksin = _kv_inputs()
    with pinned_kernel_config(2, 1):
        outs = []
        for _ in range(3):
            x = t.clone()
            rope.mla_rope_q_fwd_(x, cos, sin, 8, 16)
            key, value = rope.mla_rope_kv_fwd(kv, emb, kcos, ksin, 16, 8, 4)
            d_kv, d_emb = rope.mla_rope_kv_bwd(key, value, kcos, ksin, 16, 8, 4)
            outs.append((x, key, value, d_kv, d_emb))
    assert len(prepares) == 3  # one per kernel, on the first round only
    for later in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(later, outs[0]))


def test_what_changes_a_launch_misses_the_cache(monkeypatch):
    prepares = _count_prepares(monkeypatch)
    t, cos, sin = _q_inputs(heads=4)
    with pinned_kernel_config(2, 1):
        rope.mla_rope_q_fwd_(t.clone(), cos, sin, 8, 16)
        rope.mla_rope_q_fwd_(t.clone(), cos, sin, 8, 16)
        assert len(prepares) == 1
        rope.mla_rope_q_fwd_(t.double().float().clone()[:, :1], cos, sin, 8, 16)  # shape
        rope.mla_rope_q_fwd_(t.clone().half(), cos, sin, 8, 16)  # dtype
        rope.mla_rope_q_fwd_(t.clone()[:, :, ::2], cos, sin, 8, 16)  # strides
        rope.mla_rope_q_fwd_(t.clone(), cos, sin, 8, 16, inverse=True)  # flag
        # A 4-byte offset: another pointer alignment, which Triton specialises on.
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        shifted = buf[1:].view(t.shape).copy_(t)
        rope.mla_rope_q_fwd_(shifted, cos, sin, 8, 16)
    with pinned_kernel_config(4, 1):  # another pinned config
        rope.mla_rope_q_fwd_(t.clone(), cos, sin, 8, 16)
    assert len(prepares) == 7


def test_a_float_argument_is_refused_even_after_the_int_was_cached():
    t, cos, sin = _q_inputs()
    with pinned_kernel_config(2, 1):
        rope.mla_rope_q_fwd_(t.clone(), cos, sin, 8, 16)
        with pytest.raises(TypeError, match="qk_head_dim must be an int"):
            rope.mla_rope_q_fwd_(t.clone(), cos, sin, 8.0, 16)
        with pytest.raises(TypeError, match="inverse must be a bool"):
            rope.mla_rope_q_fwd_(t.clone(), cos, sin, 8, 16, inverse=0)


def test_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(launch, "PLANS", PlanCache(max_entries=2))
    t, cos, sin = _q_inputs(seq=4)
    with pinned_kernel_config(2, 1):
        for rows in (1, 2, 3, 4):
            rope.mla_rope_q_fwd_(t[:rows].clone(), cos, sin, 8, 16)
    assert 1 <= len(launch.PLANS) <= 2


# ----------------------------------------------------------------------------------------------
# Direct launch and fallback


def test_interpreter_and_disabled_direct_launch_take_the_jit_path(monkeypatch):
    """With the direct launch off (always under the interpreter) every launch goes through JIT."""
    monkeypatch.setattr(direct_launch, "ENABLED", False)
    jit_calls = []
    launch_jit = direct_launch.PreparedLaunch.launch_jit

    def spy(self, *tensors):
        jit_calls.append(self.launches.kernel)
        return launch_jit(self, *tensors)

    monkeypatch.setattr(direct_launch.PreparedLaunch, "launch_jit", spy)
    t, cos, sin = _q_inputs()
    with pinned_kernel_config(2, 1):
        for _ in range(2):
            rope.mla_rope_q_fwd_(t.clone(), cos, sin, 8, 16)
    assert jit_calls == [kernels.mla_rope_q_fwd_kernel] * 2
    assert all(not plan.launch.direct for plan in launch.PLANS.plans())


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on cuda:0: prepares a launch for a CUDA device on the CPU."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_a_configured_plan_hands_every_argument_in_signature_order(monkeypatch):
    """Pointers as ints (None stays None), then the scalars, then the constexprs."""
    monkeypatch.setattr(internals, "cuda_current_device", lambda: 0)
    monkeypatch.setattr(internals, "cuda_current_raw_stream", lambda i: 777)
    monkeypatch.setattr(direct_launch, "hooks_set", lambda: False)
    names = kernels.mla_rope_q_fwd_kernel.arg_names[5:]
    # Handed over out of order: the plan names them, the kernel's signature orders them.
    args = {name: 100 + i for i, name in enumerate(names) if name != "BLOCK_H"}
    args = dict(reversed(list(args.items())))
    plan = checks.RopePlan(kernels.mla_rope_q_fwd_kernel, 6, 5, 5, args, True)
    t = torch.zeros(4).as_subclass(_OnCuda)
    with pinned_kernel_config(2, 4):
        plan = launch.configure(None, plan, (t, t, t, None, None), t.device)
    calls = []
    plan.launch.direct = lambda *args: calls.append(args)
    plan(t, t, t, None, None)
    ((gx, gy, gz, stream, args),) = calls
    assert (gx, gy, gz, stream) == (6, 3, 1, 777)
    ptr = t.data_ptr()
    expected = tuple(2 if name == "BLOCK_H" else 100 + i for i, name in enumerate(names))
    assert args == (ptr, ptr, ptr, None, None) + expected
    assert len(args) == len(kernels.mla_rope_q_fwd_kernel.arg_names)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_direct_launch_bitwise_equals_jit(dtype, monkeypatch):
    """Every kernel, launched directly from the cache, writes exactly what the JIT path writes."""
    heads, qk, emb, k, v = 24, 128, 64, 128, 128
    g = torch.Generator().manual_seed(5)
    t = torch.randn(16, 2, heads, qk + emb, generator=g).to(dtype).cuda()
    cos = torch.rand(20, 1, 1, emb, generator=g).to(dtype).cuda()
    sin = torch.rand(20, 1, 1, emb, generator=g).to(dtype).cuda()
    kv = torch.randn(16, 2, heads, k + v, generator=g).to(dtype).cuda()
    k_pe = torch.randn(16, 2, 1, emb, generator=g).to(dtype).cuda()
    cu = torch.tensor([0, 10, 32], dtype=torch.int32).cuda()

    def run_all():
        x = t.clone()
        rope.mla_rope_q_fwd_(x, cos, sin, qk, emb)
        y = t.clone()
        rope.mla_rope_q_bwd_(y, cos, sin, qk, emb, remove_interleaving=True)
        z = t.view(32, heads, -1).clone()
        rope.mla_rope_q_fwd_(z, cos, sin, qk, emb, cu, 1, 2)
        key, value = rope.mla_rope_kv_fwd(kv, k_pe, cos, sin, emb, k, v)
        d_kv, d_emb = rope.mla_rope_kv_bwd(key, value, cos, sin, emb, k, v)
        return x, y, z, key, value, d_kv, d_emb

    for config in (KernelConfig(1, 1), KernelConfig(16, 4), KernelConfig(128, 8)):
        with pinned_kernel_config(config.block_h, config.num_warps):
            first = run_all()  # misses: JIT launches, direct launchers bound
            plans = launch.PLANS.plans()
            assert plans and all(plan.launch.direct for plan in plans)
            direct = run_all()
            torch.cuda.synchronize()
            prepared = direct_launch.PreparedLaunch
            monkeypatch.setattr(prepared, "__call__", prepared.launch_jit)
            jit = run_all()
            monkeypatch.undo()
        for a, b, c in zip(first, direct, jit):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), config
            assert torch.equal(a.view(torch.uint8), c.view(torch.uint8)), config


@pytest.mark.gpu
def test_gpu_direct_launch_on_a_side_stream_and_in_a_graph():
    t, cos, sin = (x.cuda() for x in _q_inputs(heads=8, qk=128, emb=64, dtype=torch.bfloat16))
    expected = t.clone()
    with pinned_kernel_config(4, 1):
        rope.mla_rope_q_fwd_(expected, cos, sin, 128, 64)
        plans = launch.PLANS.plans()
        assert all(plan.launch.direct for plan in plans), "no direct launch was bound"
        side = torch.cuda.Stream()
        x = t.clone()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            rope.mla_rope_q_fwd_(x, cos, sin, 128, 64)
        torch.cuda.current_stream().wait_stream(side)
        y = t.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            rope.mla_rope_q_fwd_(y, cos, sin, 128, 64)
        y.copy_(t)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(x.view(torch.int16), expected.view(torch.int16))
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))


def test_both_argument_records_hold_four_tensors_then_six_scalars():
    """launch.run unpacks either record the same way, to build its plan key without a call."""
    tensors = ("cos", "sin", "cu_seqlens", "position_ids")
    for record in (checks.QueryRope, checks.KeyValueRope):
        assert record._fields[:4] == tensors and len(record._fields) == 10, record
    assert checks.RECORD_TENSORS == len(tensors)


def test_a_cached_call_with_other_scalar_types_is_checked_again():
    """8.0 == 8 and True == 1: the key tells them apart, so the checks refuse the odd one."""
    t, cos, sin = _q_inputs()
    with pinned_kernel_config(2, 1):
        rope.mla_rope_q_fwd_(t.clone(), cos, sin, 8, 16, remove_interleaving=True)
        with pytest.raises(TypeError, match="remove_interleaving must be a bool"):
            rope.mla_rope_q_fwd_(t.clone(), cos, sin, 8, 16, remove_interleaving=1)
        kv, emb, cos, sin = _kv_inputs()
        rope.mla_rope_kv_fwd(kv, emb, cos, sin, 16, 8, 4)
        with pytest.raises(TypeError, match="v_dim must be an int"):
            rope.mla_rope_kv_fwd(kv, emb, cos, sin, 16, 8, 4.0)
