# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""``scripts/compare_latent_attention.py``: it loads a copy of the package beside this checkout's,
refuses to run without a GPU and, on one, finds this checkout's kernels bitwise equal to a copy of
themselves."""

import shutil
import sys

import pytest
import torch

from megatron_ext.fusions import mla_latent
from tests.unit_tests.fusions.mla_latent_cache_testlib import REPO_ROOT, build_step, load_script

# A copy of the package is what an A/B of another revision loads (--old DIR).
MODULE = REPO_ROOT / "megatron_ext" / "fusions" / "mla_latent"


def _load():
    return load_script("compare_latent_attention")


def test_a_copy_of_the_package_loads_beside_this_one_with_its_own_kernels(tmp_path):
    copy = tmp_path / "mla_latent"
    shutil.copytree(MODULE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    modules = {n: m for n, m in sys.modules.items() if n.startswith(mla_latent.__name__)}
    other = _load().load_module(str(copy))
    assert {n: m for n, m in sys.modules.items() if n.startswith(mla_latent.__name__)} == modules
    assert other is not mla_latent
    assert other.STAGE1_LAUNCHES.kernel is not mla_latent.STAGE1_LAUNCHES.kernel
    assert other.ATTENTION_PLANS is not mla_latent.ATTENTION_PLANS
    step = build_step([(5, 1), (0, 3)], heads=2, seed=1, device=torch.device("cpu"))
    args = (step.query, step.kv_cache, step.block_table, step.cu_query_lengths, step.kv_lengths)
    ours = mla_latent.mla_paged_latent_attention(*args, 0.125, rope_dim=step.rope_dim)
    theirs = other.mla_paged_latent_attention(*args, 0.125, rope_dim=step.rope_dim)
    assert torch.equal(ours, theirs)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the no-GPU refusal, on a machine without one"
)
def test_without_a_gpu_it_says_so_and_exits_2(capsys):
    assert _load().main(["--old", str(MODULE)]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_a_copy_of_the_module_gives_the_same_bits(capsys, tmp_path):
    out = tmp_path / "rows.json"
    argv = ["--old", str(MODULE), "--shapes", "2,512,16", "--quick", "--page-tiles-everywhere"]
    assert _load().main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "bits moved in 0 rows" in printed and "| equal" in printed
    assert out.read_text().count('"bits_equal": true') == 1
