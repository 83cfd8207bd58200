# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Test-wide set-up: the Triton interpreter on CPU-only machines, the ``gpu`` marker, and
``--repeat-test NAME:N`` (one test run N times among the others: how a rare race is shown gone)."""

import os
import sys

import pytest
import torch

HAVE_CUDA = torch.cuda.is_available()

# Triton decides at decoration time whether a kernel runs in the interpreter, so this must happen
# before megatron-core's or megatron_ext's kernel modules are imported by any test module.
if not HAVE_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    """``--repeat-test NAME:N``: collect the test function NAME N times (ids ``[...-rep0]`` on)."""
    parser.addoption(
        "--repeat-test",
        default=None,
        metavar="NAME:N",
        help="run the test function NAME N times, among the other tests collected",
    )


def pytest_generate_tests(metafunc):
    """Parametrize the test named by ``--repeat-test`` over its repetitions."""
    option = metafunc.config.getoption("--repeat-test")
    if not option:
        return
    name, _, count = option.rpartition(":")
    if not name or not count.isdigit() or int(count) < 1:
        raise pytest.UsageError(f"--repeat-test takes NAME:N with N >= 1; got {option!r}")
    if metafunc.function.__name__ == name:
        metafunc.fixturenames.append("repetition")
        metafunc.parametrize("repetition", range(int(count)), ids=lambda i: f"rep{i}")


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` when no CUDA device is present, and say why."""
    if HAVE_CUDA:
        return
    skip_gpu = pytest.mark.skip(
        reason="needs a CUDA GPU; run scripts/run_gpu_suite.sh on a GPU machine"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def no_patch_outlives_its_test(request):
    """Fail the test that leaves one of megatron_ext's patches applied, and undo it there.

    A leaked patch changes what later tests in the same process run (under pytest-xdist, which
    tests those are depends on the worker), so the failure would otherwise show up elsewhere.
    """
    patches = sys.modules.get("megatron_ext.patches")
    before = set(patches.applied_extensions()) if patches else set()
    yield
    patches = sys.modules.get("megatron_ext.patches")
    leaked = sorted(set(patches.applied_extensions()) - before) if patches else []
    for extension in leaked:
        patches.undo_patches(extension)
    # The spec builders apply te_free_mla by design (to_megatron_ext_spec); undone above so that
    # later tests start without it, but not a failure.
    leaked = [extension for extension in leaked if extension != patches.TE_FREE_MLA]
    if leaked:
        pytest.fail(
            f"{request.node.nodeid} left megatron_ext's {leaked} applied: undo what a test "
            "applies (undo_megatron_ext() in a finally block or a fixture)"
        )


@pytest.fixture(scope="session")
def mcore_parallel_state():
    """torch.distributed (gloo, world size 1) and megatron's parallel state, once per session.

    For tests that build megatron-core modules. Tensor parallel size 1 never communicates, so gloo
    serves CPU and CUDA tensors alike. Reuses a process group or parallel state set up elsewhere.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_ext.testing.network import free_port

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    if HAVE_CUDA:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    yield parallel_state


# A small MLA model the --mla-rope-contiguous-load flag can act on: yarn RoPE, RoPE fusion on.
SMALL_MLA_CONFIG = dict(
    num_layers=1,
    hidden_size=64,
    num_attention_heads=4,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_head_dim=16,
    qk_pos_emb_head_dim=8,
    v_head_dim=16,
    rope_type="yarn",
    apply_rope_fusion=True,
)


@pytest.fixture
def make_mla_config():
    """A factory of small ``MLATransformerConfig`` objects (:data:`SMALL_MLA_CONFIG`).

    Returns:
        Callable[..., MLATransformerConfig]: called with the fields to change.
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    def make(**overrides):
        return MLATransformerConfig(**{**SMALL_MLA_CONFIG, **overrides})

    return make
