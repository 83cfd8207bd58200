# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The decode step's kernel breakdown (megatron_ext.bench.mla_engine_profile) over made-up
profiler events."""

from types import SimpleNamespace

import pytest

from megatron_ext.bench import mla_engine_profile as profile_lib


def _event(name, us):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(elapsed_us=lambda: us))


def _events(steps):
    per_step = [("_latent_attention_kernel", 300.0)] * 2 + [("CatArrayBatchedCopy", 200.0)]
    per_step += [("gemm", 100.0)] * 3 + [("copy", 10.0), ("memset", 5.0)]
    return [_event(name, us) for _ in range(steps) for name, us in per_step]


def test_kernels_are_ranked_by_time_per_step_with_their_share():
    breakdown = profile_lib.kernel_breakdown(_events(4), steps=4, wall_seconds=4 * 0.002, top=3)
    assert breakdown["gpu_ms_per_step"] == pytest.approx(1.115)
    assert breakdown["wall_ms_per_step"] == pytest.approx(2.0)
    assert breakdown["host_share"] == pytest.approx(1 - 1.115 / 2.0)
    assert breakdown["events_per_step"] == 8
    names = [k["name"] for k in breakdown["kernels"]]
    assert names == ["_latent_attention_kernel", "gemm", "CatArrayBatchedCopy"]
    attention = breakdown["kernels"][0]
    assert attention["ms_per_step"] == pytest.approx(0.6) and attention["calls_per_step"] == 2
    assert attention["share"] == pytest.approx(600 / 1115)
    assert breakdown["other_ms_per_step"] == pytest.approx(0.015)
    assert sum(k["share"] for k in breakdown["kernels"]) == pytest.approx(1100 / 1115)


def test_overlapping_streams_floor_the_host_share_and_bad_inputs_are_refused():
    breakdown = profile_lib.kernel_breakdown(_events(1), steps=1, wall_seconds=0.001)
    assert breakdown["host_share"] == 0.0  # 1.115 ms of GPU work in a 1 ms step
    for steps, wall in ((0, 1.0), (1, 0.0)):
        with pytest.raises(ValueError):
            profile_lib.kernel_breakdown([], steps, wall)


def test_the_printed_breakdown():
    breakdown = profile_lib.kernel_breakdown(_events(2), steps=2, wall_seconds=0.004, top=2)
    lines = profile_lib.breakdown_lines("small, 1024 requests, dynamic-graphed", breakdown, 20)
    assert lines[0] == (
        "kernels per decode step (small, 1024 requests, dynamic-graphed, 2 profiled): GPU "
        "1.115 ms of a 2.000 ms step, host share 44%, 8 GPU events per step"
    )
    assert lines[1].split() == ["53.8%", "0.600", "ms", "x2", "_latent_attention..."]
    assert lines[2].split()[:2] == ["26.9%", "0.300"] and lines[2].endswith("gemm")
    assert lines[3].split() == ["0.215", "ms", "(the", "others)"]
    # CatArrayBatchedCopy (200 us a step) and "copy" (10 us) are the copies.
    assert lines[4] == "  copies: 18.8% of the GPU time; the largest 17.9% x1: CatArrayBatchedCopy"


def test_copies_are_told_by_their_full_name():
    direct = (
        "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<"
        "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>>"
    )
    gelu = "void at::native::elementwise_kernel<128, 2, at::native::GeluCUDAKernelImpl>"
    events = [_event(direct, 40.0), _event(gelu, 100.0), _event("Memcpy HtoD (Pinned)", 10.0)]
    events += [_event("gemm", 850.0)]
    breakdown = profile_lib.kernel_breakdown(events, steps=1, wall_seconds=0.002, top=1)
    assert [profile_lib.is_copy_kernel(e.name) for e in events] == [True, False, True, False]
    assert breakdown["copy_share"] == pytest.approx(0.05)
    assert breakdown["largest_copy"]["name"] == direct
    assert breakdown["largest_copy"]["share"] == pytest.approx(0.04)
    none = profile_lib.kernel_breakdown([_event("gemm", 1.0)], steps=1, wall_seconds=0.001)
    assert none["largest_copy"] is None and none["copy_share"] == 0.0
    assert profile_lib.breakdown_lines("t", none)[-2] == "  copies: none"


def test_kernels_are_sorted_into_kinds_by_their_names():
    names = {
        "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64": "matmul",
        "cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2>": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128": "attention",
        "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<192, cutlass::bfloat16_t>>": (
            "attention"
        ),
        "void flashinfer::mla::hopper::BatchMLAPageAttentionHopperKernel<...>": "attention",
        "_latent_attention_kernel": "attention",
        "_gluon_decode_kernel": "attention",
        "_combine_splits_kernel": "attention",
        "_merge_partials_kernel": "attention",
        "CatArrayBatchedCopy<c10::BFloat16, unsigned int, 3, 64, 64>": "copy",
        "Memcpy HtoD (Pinned -> Device)": "copy",
        "_rope_cache_append_kernel": "other",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": (
            "other"
        ),
    }
    assert {name: profile_lib.kernel_kind(name) for name in names} == names


def test_the_kinds_sum_to_the_gpu_time_and_are_printed_last():
    events = [_event("nvjet_tst_gemm", 600.0), _event("cudnn_generated_sdpa", 300.0)]
    events += [_event("CatArrayBatchedCopy", 60.0), _event("_rope_cache_append_kernel", 40.0)]
    breakdown = profile_lib.kernel_breakdown(events * 2, steps=2, wall_seconds=0.004)
    kinds = breakdown["kinds"]
    assert list(kinds) == list(profile_lib.KERNEL_KINDS)
    assert [kinds[k]["ms_per_step"] for k in kinds] == pytest.approx([0.6, 0.3, 0.06, 0.04])
    assert sum(kinds[k]["ms_per_step"] for k in kinds) == pytest.approx(
        breakdown["gpu_ms_per_step"]
    )
    assert [kinds[k]["share"] for k in kinds] == pytest.approx([0.6, 0.3, 0.06, 0.04])
    assert profile_lib.breakdown_lines("t", breakdown)[-1] == (
        "  by kind: matmul 0.600 ms (60.0%), attention 0.300 ms (30.0%), copy 0.060 ms (6.0%), "
        "other 0.040 ms (4.0%)"
    )


def test_a_prefill_breakdown_is_titled_as_one():
    breakdown = profile_lib.kernel_breakdown(
        [_event("gemm", 300.0), _event("attn", 100.0)], 1, 1e-3
    )
    head = profile_lib.breakdown_lines("t", breakdown, step="prefill (MHA form auto)")[0]
    assert head.startswith("kernels per prefill (MHA form auto) (t, 1 profiled): GPU 0.400 ms")
