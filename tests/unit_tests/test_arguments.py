# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""megatron_ext's flags: parsing, applying, undoing, and every refusal."""

import argparse
import sys

import numpy as np
import pytest
import torch
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron.core.models.gpt import gpt_layer_specs as mcore_specs
from megatron.core.transformer import multi_latent_attention as mcore_mla
from megatron.core.transformer.transformer_config import TransformerConfig
from packaging.version import Version

import megatron_ext.inference
from megatron_ext import utils
from megatron_ext.arguments import (
    INFERENCE_STATIC_ACTIVE_SLICES_FLAG,
    MLA_ROPE_CONTIGUOUS_LOAD_FLAG,
    MegatronExtConfigError,
    add_megatron_ext_args,
    applied_megatron_ext,
    apply_megatron_ext,
    check_mla_rope_config,
    check_model_uses_megatron_ext,
    undo_megatron_ext,
)
from megatron_ext.transformer.multi_latent_attention import ExtMLASelfAttention


def megatron_lm_args(**overrides) -> argparse.Namespace:
    """A namespace with the fields Megatron-LM's parser gives an MLA run that can use the flag."""
    fields = dict(
        multi_latent_attention=True,
        rope_type=None,  # Megatron-LM's default: the MLA config class's yarn
        apply_rope_fusion=True,
        position_embedding_type="rope",
        cache_mla_latents=False,
        experimental_attention_variant=None,
        mla_rope_contiguous_load=True,
        inference_static_active_slices=False,
    )
    fields.update(overrides)
    return argparse.Namespace(**fields)


def latent_cache(**overrides) -> dict:
    """Overrides for megatron_lm_args: the dynamic-batching configuration the flag serves
    (``--cache-mla-latents --no-rope-fusion``, DeepSeek-V3's widths), then ``overrides``."""
    fields = dict(cache_mla_latents=True, apply_rope_fusion=False, num_attention_heads=16)
    fields.update(kv_lora_rank=512, qk_pos_emb_head_dim=64)
    fields.update(overrides)
    return fields


@pytest.fixture(autouse=True)
def _clean_state():
    undo_megatron_ext()
    yield
    undo_megatron_ext()


# ----------------------------------------------------------------------------------------------
# Parsing


class TestParser:
    def test_flags_default_off(self):
        args = add_megatron_ext_args(argparse.ArgumentParser()).parse_args([])
        assert args.mla_rope_contiguous_load is False
        assert args.inference_static_active_slices is False

    def test_flags_parse(self):
        parser = add_megatron_ext_args(argparse.ArgumentParser())
        args = parser.parse_args(
            [MLA_ROPE_CONTIGUOUS_LOAD_FLAG, INFERENCE_STATIC_ACTIVE_SLICES_FLAG]
        )
        assert args.mla_rope_contiguous_load is True
        assert args.inference_static_active_slices is True

    def test_help_text_names_the_requirements(self):
        parser = add_megatron_ext_args(argparse.ArgumentParser())
        mla_help = parser._option_string_actions[MLA_ROPE_CONTIGUOUS_LOAD_FLAG].help
        assert "--multi-latent-attention" in mla_help and "--no-rope-fusion" in mla_help
        assert "yarn" in mla_help
        # It also serves static-batching inference (not "training only").
        assert "static-batching inference" in mla_help and "training only" not in mla_help
        slices_help = parser._option_string_actions[INFERENCE_STATIC_ACTIVE_SLICES_FLAG].help
        assert "CUDA graphs" in slices_help
        assert "vocabulary" in slices_help and "alone" in slices_help
        assert "megatron_ext" in parser.format_help()

    def test_help_text_says_what_the_configuration_check_takes(self):
        """The help's two recipes are what the check accepts: RoPE fusion for training and
        static batching, and the README's serving recipe (--cache-mla-latents
        --no-rope-fusion) for dynamic batching; RoPE fusion off without the latent cache is
        refused."""
        parser = add_megatron_ext_args(argparse.ArgumentParser())
        mla_help = " ".join(
            parser._option_string_actions[MLA_ROPE_CONTIGUOUS_LOAD_FLAG].help.split()
        )
        assert (
            "Training and static-batching inference (StaticInferenceContext): needs RoPE fusion"
            in mla_help
        )
        assert (
            "Dynamic batching (DynamicInferenceEngine): needs --cache-mla-latents --no-rope-fusion"
            in mla_help
        )
        check_mla_rope_config(megatron_lm_args())
        check_mla_rope_config(megatron_lm_args(**latent_cache()))
        with pytest.raises(MegatronExtConfigError, match="apply_rope_fusion is off"):
            check_mla_rope_config(megatron_lm_args(apply_rope_fusion=False))
        # The limits the help lists are the ones the check names.
        for field, value in (
            ("kv_lora_rank", 384),
            ("qk_pos_emb_head_dim", 48),
            ("context_parallel_size", 2),
            ("sequence_parallel", True),
        ):
            with pytest.raises(MegatronExtConfigError, match=field):
                check_mla_rope_config(megatron_lm_args(**latent_cache(**{field: value})))
        assert "powers of two >= 16" in mla_help and "context parallel size 1" in mla_help
        assert "no sequence parallelism" in mla_help and "no FP8 KV cache" in mla_help

    def test_adding_twice_is_harmless(self):
        parser = argparse.ArgumentParser()
        assert add_megatron_ext_args(add_megatron_ext_args(parser)) is parser
        assert parser.parse_args([MLA_ROPE_CONTIGUOUS_LOAD_FLAG]).mla_rope_contiguous_load

    def test_rejects_non_parsers(self):
        with pytest.raises(TypeError, match="ArgumentParser"):
            add_megatron_ext_args(object())

    def test_megatron_lm_extra_args_provider(self, monkeypatch):
        """With megatron.training (megatron-core >= 0.19 wheels), as ``extra_args_provider``."""
        if not hasattr(__import__("typing"), "override"):
            pytest.skip("megatron.training needs Python >= 3.12 (typing.override)")
        training_args = pytest.importorskip(
            "megatron.training.arguments", reason="megatron.training is not in this megatron-core"
        )
        monkeypatch.setattr(
            sys,
            "argv",
            ["pretrain_gpt.py", "--multi-latent-attention", MLA_ROPE_CONTIGUOUS_LOAD_FLAG],
        )
        args = training_args.parse_args(extra_args_provider=add_megatron_ext_args)
        assert args.mla_rope_contiguous_load is True
        assert args.multi_latent_attention is True
        # Megatron-LM's default learned position embedding would switch RoPE fusion off.
        with pytest.raises(MegatronExtConfigError, match="position_embedding_type"):
            apply_megatron_ext(args)
        args.position_embedding_type = "rope"
        assert apply_megatron_ext(args)["mla_rope_contiguous_load"]

    def test_megatron_lm_dynamic_mla_serving_flags(self, monkeypatch):
        """The documented way to serve MLA with the dynamic engine, from a Megatron-LM command
        line: --cache-mla-latents --no-rope-fusion plus both flags."""
        if not hasattr(__import__("typing"), "override"):
            pytest.skip("megatron.training needs Python >= 3.12 (typing.override)")
        training_args = pytest.importorskip(
            "megatron.training.arguments", reason="megatron.training is not in this megatron-core"
        )
        argv = [
            "--multi-latent-attention", "--kv-lora-rank", "512", "--qk-pos-emb-head-dim", "64",
            "--num-attention-heads", "16", "--cache-mla-latents", "--no-rope-fusion",
            MLA_ROPE_CONTIGUOUS_LOAD_FLAG, "--inference-static-active-slices",
        ]  # fmt: skip
        monkeypatch.setattr(sys, "argv", ["text_generation_server.py", *argv])
        args = training_args.parse_args(extra_args_provider=add_megatron_ext_args)
        assert args.cache_mla_latents and not args.apply_rope_fusion
        assert apply_megatron_ext(args) == {
            "mla_rope_contiguous_load": True,
            "inference_static_active_slices": True,
        }
        undo_megatron_ext()
        args.kv_lora_rank = 384
        with pytest.raises(MegatronExtConfigError, match="kv_lora_rank=384"):
            apply_megatron_ext(args)


# ----------------------------------------------------------------------------------------------
# Apply and undo


class TestApplyUndo:
    def test_apply_from_args_and_undo(self):
        assert applied_megatron_ext() == {
            "mla_rope_contiguous_load": False,
            "inference_static_active_slices": False,
        }
        state = apply_megatron_ext(megatron_lm_args())
        assert state["mla_rope_contiguous_load"] is True
        assert mcore_specs.MLASelfAttention is ExtMLASelfAttention
        spec = mcore_specs.get_gpt_layer_local_spec(multi_latent_attention=True)
        assert spec.submodules.self_attention.module is ExtMLASelfAttention
        assert apply_megatron_ext(megatron_lm_args())["mla_rope_contiguous_load"]  # idempotent
        state = undo_megatron_ext()
        assert state["mla_rope_contiguous_load"] is False
        assert mcore_specs.MLASelfAttention is mcore_mla.MLASelfAttention
        assert undo_megatron_ext()["mla_rope_contiguous_load"] is False  # no-op

    def test_apply_from_keywords_and_config(self, make_mla_config):
        apply_megatron_ext(mla_rope_contiguous_load=True, config=make_mla_config())
        assert applied_megatron_ext()["mla_rope_contiguous_load"]

    def test_keywords_override_args(self):
        state = apply_megatron_ext(megatron_lm_args(), mla_rope_contiguous_load=False)
        assert state["mla_rope_contiguous_load"] is False
        assert mcore_specs.MLASelfAttention is mcore_mla.MLASelfAttention

    def test_nothing_requested_changes_nothing(self):
        state = apply_megatron_ext(megatron_lm_args(mla_rope_contiguous_load=False))
        assert not any(state.values())
        assert apply_megatron_ext() == state

    def test_flag_values_must_be_bools(self):
        with pytest.raises(TypeError, match="mla_rope_contiguous_load must be a bool"):
            apply_megatron_ext(megatron_lm_args(), mla_rope_contiguous_load="yes")
        with pytest.raises(TypeError, match="inference_static_active_slices must be a bool"):
            apply_megatron_ext(megatron_lm_args(inference_static_active_slices=1))

    def test_needs_args_or_config_to_check(self):
        with pytest.raises(TypeError, match="parsed args or the TransformerConfig"):
            apply_megatron_ext(mla_rope_contiguous_load=True)
        assert not applied_megatron_ext()["mla_rope_contiguous_load"]

    def test_config_preferred_over_args(self, make_mla_config):
        # args say MLA is off, the config (what the model is built from) says on: config wins.
        args = megatron_lm_args(multi_latent_attention=False)
        apply_megatron_ext(args, config=make_mla_config())
        assert applied_megatron_ext()["mla_rope_contiguous_load"]


# ----------------------------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize(
    "overrides,reason",
    [
        (dict(multi_latent_attention=False), "multi_latent_attention is off"),
        (dict(rope_type="rope"), "rope_type is 'rope'"),
        (dict(apply_rope_fusion=False), "apply_rope_fusion is off"),
        (dict(position_embedding_type="learned_absolute"), "position_embedding_type"),
        (
            dict(cache_mla_latents=True, kv_lora_rank=48, qk_pos_emb_head_dim=64),
            "kv_lora_rank=48",
        ),
        (
            dict(
                cache_mla_latents=True,
                kv_lora_rank=512,
                qk_pos_emb_head_dim=64,
                **{"context_parallel_size": 2},
            ),
            "context_parallel_size=2",
        ),
        (dict(experimental_attention_variant="dsa"), "experimental_attention_variant"),
        # Sizes that are no sizes were read as 1 (`or 1`), or let through.
        (latent_cache(tensor_model_parallel_size=0), r"tensor_model_parallel_size=0: must be an"),
        (latent_cache(context_parallel_size=0), r"context_parallel_size=0: must be an integer"),
        (latent_cache(context_parallel_size=-2), r"context_parallel_size=-2: must be an integer"),
        (latent_cache(num_attention_heads=0), r"num_attention_heads=0: must be an integer >= 1"),
        (latent_cache(num_attention_heads=16.0), r"num_attention_heads=16.0: must be an integer"),
        # A numpy integer is judged by its value, and the message says the value.
        (latent_cache(kv_lora_rank=np.int64(384)), r"kv_lora_rank=384: the paged latent-cache"),
        (latent_cache(kv_lora_rank=512.0), r"kv_lora_rank=512.0 is not an integer"),
        (latent_cache(qk_pos_emb_head_dim=True), r"qk_pos_emb_head_dim=True is not an integer"),
    ],
)
def test_configurations_the_flag_cannot_act_on(overrides, reason):
    with pytest.raises(MegatronExtConfigError, match=reason) as info:
        apply_megatron_ext(megatron_lm_args(**overrides))
    assert MLA_ROPE_CONTIGUOUS_LOAD_FLAG in str(info.value)
    assert isinstance(info.value, ValueError)
    # A refusal leaves megatron-core as it was.
    assert mcore_specs.MLASelfAttention is mcore_mla.MLASelfAttention
    assert not applied_megatron_ext()["mla_rope_contiguous_load"]


@pytest.mark.parametrize(
    "sizes",
    [
        dict(kv_lora_rank=np.int64(512), qk_pos_emb_head_dim=np.int32(64)),
        dict(tensor_model_parallel_size=np.int64(4), num_attention_heads=np.int64(16)),
        dict(tensor_model_parallel_size=None, context_parallel_size=None),
    ],
    ids=["numpy_widths", "numpy_sizes", "unset_sizes"],
)
def test_numpy_integers_and_unset_sizes_are_taken(sizes):
    """Configuration values from numpy (a checkpoint's metadata, say) are integers; an unset
    parallel size is 1."""
    apply_megatron_ext(megatron_lm_args(**latent_cache(**sizes)))
    assert applied_megatron_ext()["mla_rope_contiguous_load"]


def test_latent_caching_is_the_dynamic_batching_path():
    # megatron-core allows cache_mla_latents only with RoPE fusion off; the flag then serves
    # dynamic-batching steps with its own kernels.
    args = megatron_lm_args(
        cache_mla_latents=True,
        apply_rope_fusion=False,
        kv_lora_rank=512,
        qk_pos_emb_head_dim=64,
        num_attention_heads=16,
    )
    apply_megatron_ext(args)
    assert applied_megatron_ext()["mla_rope_contiguous_load"]


def test_every_problem_is_named():
    args = megatron_lm_args(apply_rope_fusion=False, rope_type="rope")
    with pytest.raises(MegatronExtConfigError) as info:
        apply_megatron_ext(args)
    assert "rope_type" in str(info.value) and "apply_rope_fusion" in str(info.value)


def test_config_objects_are_checked(make_mla_config):
    with pytest.raises(MegatronExtConfigError, match="multi_latent_attention is off"):
        check_mla_rope_config(
            config=TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
        )
    with pytest.raises(MegatronExtConfigError, match="apply_rope_fusion is off"):
        check_mla_rope_config(config=make_mla_config(apply_rope_fusion=False))
    with pytest.raises(MegatronExtConfigError, match="rope_type is 'rope'"):
        check_mla_rope_config(config=make_mla_config(rope_type="rope", apply_rope_fusion=False))
    check_mla_rope_config(config=make_mla_config())  # the supported configuration passes


def test_unsupported_megatron_core_version(monkeypatch):
    monkeypatch.setattr(utils, "get_megatron_core_version", lambda: Version("0.15.0"))
    with pytest.raises(utils.UnsupportedMegatronCoreVersionError, match="0.15.0"):
        apply_megatron_ext(megatron_lm_args())
    assert not applied_megatron_ext()["mla_rope_contiguous_load"]


# ----------------------------------------------------------------------------------------------
# The inference flag (its extension lives in megatron_ext.inference)


def test_inference_flag_enables_static_active_slices(make_mla_config):
    args = megatron_lm_args(mla_rope_contiguous_load=False, inference_static_active_slices=True)
    assert apply_megatron_ext(args, config=make_mla_config())["inference_static_active_slices"]
    assert megatron_ext.inference.is_static_active_slices_enabled()
    assert not undo_megatron_ext()["inference_static_active_slices"]
    assert not megatron_ext.inference.is_static_active_slices_enabled()


def test_a_failing_request_applies_nothing(monkeypatch):
    from megatron_ext import patches

    # A release without a target the flag must patch: the second extension fails part-way.
    broken = patches.PATCHES[patches.INFERENCE_STATIC_ACTIVE_SLICES] + (
        patches.Patch("megatron.core.utils", "no_such_attribute", "builtins:len", "test"),
    )
    monkeypatch.setitem(patches.PATCHES, patches.INFERENCE_STATIC_ACTIVE_SLICES, broken)
    init = vars(DynamicInferenceContext)["__init__"]
    with pytest.raises(AttributeError, match="no_such_attribute"):
        apply_megatron_ext(megatron_lm_args(inference_static_active_slices=True))
    assert vars(DynamicInferenceContext)["__init__"] is init
    # The MLA part was valid, but nothing is applied when any requested part fails.
    assert mcore_specs.MLASelfAttention is mcore_mla.MLASelfAttention
    assert not any(applied_megatron_ext().values())


# ----------------------------------------------------------------------------------------------
# One record of what is applied, whoever switched it on


def test_undo_undoes_switches_called_directly():
    from megatron_ext.models.gpt.gpt_layer_specs import (
        is_megatron_core_gpt_specs_patched,
        patch_megatron_core_gpt_specs,
    )

    patch_megatron_core_gpt_specs()
    megatron_ext.inference.enable_static_active_slices()
    assert applied_megatron_ext() == {
        "mla_rope_contiguous_load": True,
        "inference_static_active_slices": True,
    }
    assert undo_megatron_ext() == {
        "mla_rope_contiguous_load": False,
        "inference_static_active_slices": False,
    }
    assert not is_megatron_core_gpt_specs_patched()
    assert mcore_specs.MLASelfAttention is mcore_mla.MLASelfAttention
    assert not megatron_ext.inference.is_static_active_slices_enabled()


def test_applied_follows_switches_turned_off_directly():
    from megatron_ext.models.gpt.gpt_layer_specs import unpatch_megatron_core_gpt_specs

    apply_megatron_ext(megatron_lm_args(inference_static_active_slices=True))
    assert all(applied_megatron_ext().values())
    megatron_ext.inference.disable_static_active_slices()
    assert applied_megatron_ext()["inference_static_active_slices"] is False
    unpatch_megatron_core_gpt_specs()
    assert applied_megatron_ext()["mla_rope_contiguous_load"] is False


# ----------------------------------------------------------------------------------------------
# Arguments that would make a flag silently do nothing


@pytest.mark.parametrize(
    "args",
    [
        {"mla_rope_contiguous_load": True},
        "--mla-rope-contiguous-load",
        b"--mla-rope-contiguous-load",
        ["--mla-rope-contiguous-load"],
        ("mla_rope_contiguous_load",),
        True,
        1,
    ],
    ids=["dict", "str", "bytes", "list", "tuple", "bool", "int"],
)
def test_args_that_are_not_a_namespace_are_refused(args):
    with pytest.raises(TypeError, match="args must be a parsed namespace"):
        apply_megatron_ext(args)
    assert not any(applied_megatron_ext().values())


def test_config_that_is_not_a_config_is_refused():
    with pytest.raises(TypeError, match="config must be a megatron-core TransformerConfig"):
        apply_megatron_ext(mla_rope_contiguous_load=True, config={"multi_latent_attention": True})
    assert not any(applied_megatron_ext().values())


def test_args_without_the_flags_are_refused(make_mla_config):
    # A parser that add_megatron_ext_args did not extend, or a config passed where args go.
    with pytest.raises(TypeError, match="add_megatron_ext_args"):
        apply_megatron_ext(argparse.Namespace(multi_latent_attention=True))
    with pytest.raises(TypeError, match="add_megatron_ext_args"):
        apply_megatron_ext(make_mla_config())
    # With the flag as a keyword, such args are only read for the configuration check.
    state = apply_megatron_ext(
        argparse.Namespace(), mla_rope_contiguous_load=True, config=make_mla_config()
    )
    assert state["mla_rope_contiguous_load"]


# ----------------------------------------------------------------------------------------------
# A parser that defines one of the flags itself


@pytest.mark.parametrize(
    "own_flag,own_dest,named",
    [
        (MLA_ROPE_CONTIGUOUS_LOAD_FLAG, None, MLA_ROPE_CONTIGUOUS_LOAD_FLAG),
        (INFERENCE_STATIC_ACTIVE_SLICES_FLAG, None, INFERENCE_STATIC_ACTIVE_SLICES_FLAG),
        ("--static-slices", "inference_static_active_slices", "--static-slices"),
    ],
)
def test_parser_that_already_has_a_flag(own_flag, own_dest, named):
    parser = argparse.ArgumentParser()
    kwargs = {"dest": own_dest} if own_dest else {}
    parser.add_argument(own_flag, action="store_true", **kwargs)
    with pytest.raises(ValueError, match="already defines") as info:
        add_megatron_ext_args(parser)
    assert named in str(info.value)
    # Nothing was added: the script's own option is the only one.
    flags = [s for a in parser._actions for s in a.option_strings]
    assert flags == ["-h", "--help", own_flag]


# ----------------------------------------------------------------------------------------------
# Checking a built model


def test_check_model_uses_megatron_ext():
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert check_model_uses_megatron_ext(plain) == 0  # flag not applied: nothing to check
    apply_megatron_ext(megatron_lm_args())
    with pytest.raises(MegatronExtConfigError, match="no megatron_ext MLA module"):
        check_model_uses_megatron_ext([plain])
    fake_mla = ExtMLASelfAttention.__new__(ExtMLASelfAttention)
    torch.nn.Module.__init__(fake_mla)
    assert check_model_uses_megatron_ext([plain, torch.nn.Sequential(fake_mla)]) == 1
    with pytest.raises(TypeError, match="torch.nn.Module"):
        check_model_uses_megatron_ext("model")


def test_check_model_refuses_megatron_core_mla_left_in_place():
    """A spec built before apply_megatron_ext() leaves megatron-core's MLA: named, refused."""
    apply_megatron_ext(megatron_lm_args())
    ext_mla = ExtMLASelfAttention.__new__(ExtMLASelfAttention)
    torch.nn.Module.__init__(ext_mla)
    mcore_module = mcore_mla.MLASelfAttention.__new__(mcore_mla.MLASelfAttention)
    torch.nn.Module.__init__(mcore_module)
    model = torch.nn.ModuleDict({"ext": ext_mla, "stock": mcore_module})
    with pytest.raises(MegatronExtConfigError, match=r"stock \(MLASelfAttention\)"):
        check_model_uses_megatron_ext(model)
    undo_megatron_ext()
    assert check_model_uses_megatron_ext(model) == 1  # the flag is off: nothing to refuse
