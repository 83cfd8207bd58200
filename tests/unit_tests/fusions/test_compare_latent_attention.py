# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""``scripts/compare_latent_attention.py``: it refuses to run without a GPU and, on one, finds
this checkout's kernels bitwise equal to a copy of themselves."""

import pytest
import torch

from tests.unit_tests.fusions.mla_latent_cache_testlib import REPO_ROOT, load_script

MODULE = REPO_ROOT / "megatron_ext" / "fusions" / "mla_paged_latent_attention.py"


def _load():
    return load_script("compare_latent_attention")


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
