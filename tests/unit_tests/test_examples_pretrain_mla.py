# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The CPU-checkable parts of examples/pretrain_mla.py: arguments, data packing, comparisons."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pretrain_mla.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("pretrain_mla_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_defaults_follow_the_preset_and_flag(example):
    args = example.parse_args([])
    assert args.modes == ["off"]
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (2, 512, 8)
    assert (args.qk_head_dim, args.qk_pos_emb_head_dim, args.v_head_dim) == (128, 64, 128)
    assert args.apply_rope_fusion and args.rope_type == "yarn"
    args = example.parse_args(
        ["--mla-rope-contiguous-load", "--preset", "dsv3-layer", "--num-layers", "2"]
    )
    assert args.modes == ["on"]
    assert (args.hidden_size, args.num_attention_heads, args.num_layers) == (7168, 128, 2)


def test_megatron_core_rope_pinned_only_when_deterministic(example):
    assert example.parse_args([]).mcore_rope_block_h == 0
    assert example.parse_args(["--deterministic"]).mcore_rope_block_h == 1
    assert (
        example.parse_args(["--deterministic", "--mcore-rope-block-h", "0"]).mcore_rope_block_h == 0
    )
    with pytest.raises(SystemExit):
        example.parse_args(["--mcore-rope-block-h", "3"])
    with pytest.raises(SystemExit):
        example.parse_args(["--ext-rope-block-h", "256"])


def test_pin_megatron_core_rope(example, monkeypatch):
    from megatron.core.fusions import fused_mla_yarn_rope_apply as kernels

    names = (
        "rotary_fwd_q_kernel",
        "rotary_bwd_q_kernel",
        "rotary_fwd_kv_kernel",
        "rotary_bwd_kv_kernel",
    )
    for name in names:  # restored after the test
        tuner = getattr(kernels, name)
        monkeypatch.setattr(tuner, "configs", list(tuner.configs))
        monkeypatch.setattr(tuner, "cache", dict(tuner.cache))
    example.pin_megatron_core_rope(0)
    assert all(len(getattr(kernels, n).configs) == 8 for n in names)
    example.pin_megatron_core_rope(1)
    for name in names:
        (config,) = getattr(kernels, name).configs
        assert config.kwargs == {"BLOCK_H": 1}


def test_context_parallel_thd_padding_must_split_into_2cp_chunks(example):
    ok = ["--qkv-format", "thd", "--context-parallel-size", "2", "--thd-pad-multiple", "8"]
    assert example.parse_args(ok).thd_pad_multiple == 8
    with pytest.raises(SystemExit):  # local length 3 of a padded 6: the kernels map it wrongly
        example.parse_args(ok[:-1] + ["6"])
    assert example.parse_args(ok[:-1] + ["6"] + ["--context-parallel-size", "1"])


def test_argument_errors(example):
    with pytest.raises(SystemExit):
        example.parse_args(["--inference-static-active-slices"])
    with pytest.raises(SystemExit):
        example.parse_args(["--train-iters", "0"])
    with pytest.raises(SystemExit):
        example.parse_args(["--modes", "maybe"])


def test_config_matches_the_arguments(example):
    args = example.parse_args(["--precision", "fp32", "--recompute-mla-up-proj"])
    config = example.build_config(args)
    assert config.multi_latent_attention and config.apply_rope_fusion
    assert config.rope_type == "yarn" and config.qk_layernorm
    assert config.params_dtype == torch.float32 and not config.bf16
    assert config.recompute_modules == ["mla_up_proj"]


def test_packed_lengths(example):
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        lengths = example._split_lengths(gen, 1024, 16, 32)
        assert sum(lengths) == 1024
        assert all(n % 16 == 0 and n >= 32 for n in lengths)
    with pytest.raises(SystemExit):
        example._split_lengths(gen, 1000, 16, 32)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_context_parallel_slices_partition_the_sequence(example, cp):
    pieces = [example.cp_slice_index(32, cp, rank) for rank in range(cp)]
    assert sorted(torch.cat(pieces).tolist()) == list(range(32))
    # Rank r holds chunks r and 2*cp-1-r: the load-balanced causal layout.
    chunk = 32 // (2 * cp)
    assert pieces[0][:chunk].tolist() == list(range(chunk))
    assert pieces[0][chunk:].tolist() == list(range(32 - chunk, 32))
    with pytest.raises(SystemExit):
        example.cp_slice_index(30, 4, 0)


def test_synthetic_sequences_are_learnable(example):
    seq = example._sequence(torch.Generator().manual_seed(0), 200, 1024)
    steps = (seq[1:] - seq[:-1]) % 1024
    assert (steps == steps.mode().values).float().mean() > 0.7  # mostly one stride


def test_compare_modes(example):
    def run(mode, losses, checksum="a"):
        return {
            "mode": mode,
            "init_param_checksum": checksum,
            "lm loss hex": [v.hex() for v in losses],
            "grad norm hex": ["0x1p+0"] * 3,
        }

    same = [run("off", [1.0, 0.5, 0.25]), run("on", [1.0, 0.5, 0.25])]
    assert example.compare_modes(same) == []
    differ = [run("off", [1.0, 0.5, 0.25]), run("on", [1.0, 0.5000000001, 0.25], "b")]
    problems = example.compare_modes(differ)
    assert any("initial parameters differ" in p for p in problems)
    assert any("lm loss differs first at step 2" in p for p in problems)


@pytest.mark.parametrize("mode", ["off", "on"])
def test_local_block_is_megatron_cores_own_where_te_is_absent(example, mode, mcore_parallel_state):
    """The local run's block spec: what megatron-core's block builds from the layer spec in an
    environment without Transformer Engine or Apex (the one the golden values come from), and
    torch's final norm wherever TE is installed."""
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    args = example.parse_args(["--transformer-impl", "local", "--num-layers", "3"])
    config = example.build_config(args)
    try:
        block = example.build_layer_spec(args, mode, config)
    finally:
        example.undo_megatron_ext()
    assert block.layer_norm is WrappedTorchNorm
    assert len(block.layer_specs) == 3 and all(s is block.layer_specs[0] for s in block.layer_specs)
    if transformer_block.LayerNormImpl is WrappedTorchNorm:  # neither TE nor Apex here
        stock = transformer_block._get_block_submodules(config, block.layer_specs[0])
        assert stock == block
