# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Registry of kernels with a bit-exact determinism test (test_determinism.py runs them all).

Each entry maps a kernel name to a :class:`KernelCase`: a callable that builds fresh inputs from a
fixed seed and runs the kernel once at a given launch config, returning its outputs. The test
asserts identical bits across repeated runs and, where ``configs`` lists several, across configs.
Register every new or changed kernel here.

Race-freedom: two runs agreeing does not show that a kernel never races (megatron-core's in-place
query RoPE backward agrees with itself most of the time and races at BLOCK_H=2; see
docs/perf_notes/mcore_rope_races.md). Each entry therefore also names, in ``race_test``, the GPU
test that relaunches the kernel many times on fresh copies of one input at every launch config
its autotuner tries or a user can pin, and requires identical bits every time.
"""

import itertools
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from megatron_ext.fusions import fused_mla_yarn_rope_apply as mla_rope
from megatron_ext.fusions.mla_latent import fused_mla_rope_cache_append, mla_paged_latent_attention

Outputs = Tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class KernelCase:
    """How to run one kernel for the determinism test.

    Args:
        run: ``run(device, dtype, config)`` builds inputs from a fixed seed and returns the
            outputs; ``config`` None means the kernel's own choice (autotuning on a GPU).
        configs: launch configs whose outputs must all be bit-identical.
        gpu_dtypes: dtypes tested on a GPU.
        cpu_dtypes: dtypes tested in the Triton interpreter (it cannot do bf16 arithmetic).
        race_test: the pytest node id of the GPU test that holds the kernel race-free (relaunched
            at every config, identical bits required); ``race_kernel``: the kernel's name there,
            where that test serves several kernels (the MLA RoPE relaunch test), else empty.
    """

    run: Callable[[torch.device, torch.dtype, Optional[object]], Outputs]
    configs: Sequence[object] = field(default_factory=tuple)
    race_test: str = ""
    race_kernel: str = ""
    gpu_dtypes: Sequence[torch.dtype] = (torch.bfloat16, torch.float16, torch.float32)
    cpu_dtypes: Sequence[torch.dtype] = (torch.float32,)


def _inputs(device, dtype, lead, heads, dims, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*lead, heads, d, generator=g).to(dtype).to(device) for d in dims]


def _tables(device, dtype, rows, emb_dim, seed):
    g = torch.Generator().manual_seed(seed)
    cos = torch.rand(rows, 1, 1, emb_dim, generator=g) * 2 - 1
    sin = torch.rand(rows, 1, 1, emb_dim, generator=g) * 2 - 1
    return cos.to(dtype).to(device), sin.to(dtype).to(device)


def _pinned(config):
    if config is None:
        import contextlib

        return contextlib.nullcontext()
    return mla_rope.pinned_kernel_config(config.block_h, config.num_warps)


def _small(device) -> bool:
    return device.type != "cuda"


def _q_case(
    backward: bool, thd: bool, inverse: bool, remove_interleaving: bool, copy: bool = False
):
    def run(device, dtype, config) -> Outputs:
        heads = 5 if _small(device) else 129  # not a multiple of any head block but 1
        qk, emb = (8, 16) if _small(device) else (128, 64)
        lead = (7,) if thd else (4, 2)
        (t,) = _inputs(device, dtype, lead, heads, [qk + emb], seed=1)
        cos, sin = _tables(device, dtype, 8, emb, seed=2)
        cu = torch.tensor([0, 3, 6], dtype=torch.int32, device=device) if thd else None
        fn = mla_rope.mla_rope_q_bwd_ if backward else mla_rope.mla_rope_q_fwd_
        with _pinned(config):
            if copy:
                return (mla_rope.mla_rope_q_bwd(t, cos, sin, qk, emb, cu, inverse=inverse),)
            fn(t, cos, sin, qk, emb, cu, inverse=inverse, remove_interleaving=remove_interleaving)
        return (t,)

    return run


def _kv_case(backward: bool):
    def run(device, dtype, config) -> Outputs:
        heads = 5 if _small(device) else 129
        k_dim, v_dim, emb = (8, 4, 16) if _small(device) else (128, 128, 64)
        lead = (4, 2)
        kv, emb_t = _inputs(device, dtype, lead, heads, [k_dim + v_dim, emb], seed=3)
        emb_t = emb_t[:, :, :1]
        cos, sin = _tables(device, dtype, 4, emb, seed=4)
        with _pinned(config):
            if not backward:
                return mla_rope.mla_rope_kv_fwd(kv, emb_t, cos, sin, emb, k_dim, v_dim)
            dkey, dvalue = _inputs(device, dtype, lead, heads, [k_dim + emb, v_dim], seed=5)
            return mla_rope.mla_rope_kv_bwd(dkey, dvalue, cos, sin, emb, k_dim, v_dim)

    return run


# Spread over the autotuner's range (its choice is one of these shapes); the same configs as the
# fusion tests, so one GPU test run compiles each only once.
_CONFIGS = (
    mla_rope.KernelConfig(1, 1),
    mla_rope.KernelConfig(16, 4),
    mla_rope.KernelConfig(128, 8),
)

# The MLA RoPE kernels are race-free. The query kernels rotate in place; this test relaunches each
# of the five kernels 100 (in-place query) or 25 (the others) times per config on fresh copies of
# one input, at every config pinned_kernel_config accepts (the autotuner's among them), with 1, 3,
# 16, 40 and 128 heads, in bf16, fp16 and fp32, and requires one set of bits.
_RACE_TEST = "tests/unit_tests/fusions/mla_rope/test_kernels.py::test_relaunch_gives_identical_bits"


def _rope(run, kernel: str) -> KernelCase:
    return KernelCase(run, _CONFIGS, race_test=_RACE_TEST, race_kernel=kernel)


def _latent_step(device, dtype, seed):
    """One mixed dynamic-batching step over a paged latent cache (shuffled blocks), as the
    latent-cache kernels take it: (query, cache, block table, cu query lengths, kv lengths,
    rope width)."""
    heads, latent, rope, block = (3, 32, 16, 16) if _small(device) else (16, 512, 64, 64)
    g = torch.Generator().manual_seed(seed)
    requests = [(40, 1), (0, 19), (17, 9), (63, 1)]  # (cached tokens, new tokens)
    counts = [-(-(cached + new) // block) for cached, new in requests]
    order = torch.randperm(sum(counts) + 2, generator=g).to(torch.int32)
    table = torch.full((len(requests), max(counts)), -1, dtype=torch.int32)
    for row, (start, count) in enumerate(zip([0, *itertools.accumulate(counts)], counts)):
        table[row, :count] = order[start : start + count]
    cu = torch.tensor([0, *itertools.accumulate(new for _, new in requests)], dtype=torch.int32)
    kv_lengths = torch.tensor([cached + new for cached, new in requests], dtype=torch.int32)
    cache = torch.randn(len(order), block, latent + rope, generator=g).to(dtype)
    query = torch.randn(int(cu[-1]), heads, latent + rope, generator=g).to(dtype)
    return [x.to(device) for x in (query, cache, table, cu, kv_lengths)] + [rope]


def _latent_attention_case(device, dtype, config) -> Outputs:
    query, cache, table, cu, kv_lengths, rope = _latent_step(device, dtype, seed=6)
    scale = 1 / (query.shape[-1] - rope + 128) ** 0.5
    return (
        mla_paged_latent_attention(
            query, cache, table, cu, kv_lengths, scale, rope_dim=rope, num_kv_splits=config
        ),
    )


def _latent_append_case(device, dtype, config) -> Outputs:
    """Every row of the cache after one append of 19 tokens at distinct rows (megatron-core never
    gives two real tokens one row); ``config`` is unused: the kernel has one launch shape."""
    _, cache, _, _, _, rope = _latent_step(device, dtype, seed=7)
    latent = cache.shape[-1] - rope
    g = torch.Generator().manual_seed(8)
    tokens = 19
    rows = torch.randperm(cache.shape[0] * cache.shape[1], generator=g)[:tokens].to(device)
    positions = torch.randint(0, 8, (tokens,), generator=g).to(device)
    kv_latent = torch.randn(tokens, latent, generator=g).to(dtype).to(device)
    k_pos_emb = torch.randn(tokens, rope, generator=g).to(dtype).to(device)
    cos, sin = _tables(device, dtype, 8, rope, seed=9)
    block_size = cache.shape[1]
    fused_mla_rope_cache_append(
        kv_latent, k_pos_emb, cos, sin, positions, cache, rows // block_size, rows % block_size
    )
    return (cache,)


_LATENT_TESTS = (
    "tests/unit_tests/fusions/mla_latent/test_{}.py::test_gpu_relaunch_gives_identical_bits"
)

KERNELS: Dict[str, KernelCase] = {
    "mla_rope_q_fwd_sbhd": _rope(_q_case(False, False, False, False), "q_fwd"),
    "mla_rope_q_fwd_thd_inverse_keep": _rope(_q_case(False, True, True, True), "q_fwd"),
    "mla_rope_q_bwd_sbhd": _rope(_q_case(True, False, False, False), "q_bwd"),
    "mla_rope_q_bwd_thd_inverse_keep": _rope(_q_case(True, True, True, True), "q_bwd"),
    "mla_rope_q_bwd_copy_thd_inverse": _rope(_q_case(True, True, True, False, True), "q_bwd_copy"),
    "mla_rope_kv_fwd": _rope(_kv_case(False), "kv_fwd"),
    "mla_rope_kv_bwd": _rope(_kv_case(True), "kv_bwd"),
    # Split-KV changes the order of the softmax sums, so each split count has its own bits: one
    # config, the determinism across launches at it (the race test covers 1, 4 and the default).
    "mla_paged_latent_attention_mixed": KernelCase(
        _latent_attention_case,
        configs=(3,),
        race_test=_LATENT_TESTS.format("attention"),
    ),
    "fused_mla_rope_cache_append": KernelCase(
        _latent_append_case,
        configs=(None,),
        race_test=_LATENT_TESTS.format("rope_cache_append"),
    ),
}
