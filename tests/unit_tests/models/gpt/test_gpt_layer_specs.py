# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Swapping megatron_ext's classes into megatron-core GPT layer specs and back."""

import dataclasses
import functools
import importlib
import re
from pathlib import Path

import pytest
import torch
from megatron.core.models.gpt import gpt_layer_specs as mcore_specs
from megatron.core.transformer import multi_latent_attention as mcore_mla
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_ext import patches
from megatron_ext.models.gpt.gpt_layer_specs import (
    count_mla_attention_specs,
    get_gpt_layer_local_mla_spec,
    is_megatron_core_gpt_specs_patched,
    patch_megatron_core_gpt_specs,
    to_megatron_core_spec,
    to_megatron_ext_spec,
    unpatch_megatron_core_gpt_specs,
)
from megatron_ext.transformer.multi_latent_attention import (
    ExtFusedMLASelfAttention,
    ExtMLASelfAttention,
)
from megatron_ext.transformer.sdpa_attention import SDPADotProductAttention


def snapshot(obj, path="spec"):
    """Every node of a spec tree as (path, id, value-if-leaf): detects any in-place change."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = [(path, id(obj), None)]
        for f in dataclasses.fields(obj):
            out += snapshot(getattr(obj, f.name), f"{path}.{f.name}")
        return out
    if isinstance(obj, (list, tuple)):
        out = [(path, id(obj), len(obj))]
        for i, item in enumerate(obj):
            out += snapshot(item, f"{path}[{i}]")
        return out
    if isinstance(obj, dict):
        return [(path, id(obj), tuple(sorted((k, id(v)) for k, v in obj.items())))]
    return [(path, id(obj), None)]


def local_mla_spec():
    return mcore_specs.get_gpt_layer_local_spec(
        multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm"
    )


def attention(spec):
    return spec.submodules.self_attention


class FakeTECoreAttention:
    """Stands in for TEDotProductAttention (no Transformer Engine here)."""


def te_like_mla_spec():
    """An MLA layer spec shaped like the Transformer Engine one, built without TE."""
    spec = local_mla_spec()
    attention(spec).submodules.core_attention = FakeTECoreAttention
    return spec


def test_local_spec_swapped_in():
    spec = local_mla_spec()
    before = snapshot(spec)
    ext = to_megatron_ext_spec(spec)
    assert attention(ext).module is ExtMLASelfAttention
    assert attention(ext).submodules.core_attention is SDPADotProductAttention
    assert attention(ext).params == attention(spec).params
    # Everything else is megatron-core's, and the input is untouched.
    for name in (
        "linear_q_down_proj",
        "linear_q_up_proj",
        "linear_kv_down_proj",
        "linear_kv_up_proj",
        "linear_proj",
        "q_layernorm",
        "kv_layernorm",
    ):
        assert getattr(attention(ext).submodules, name) is getattr(attention(spec).submodules, name)
    assert ext.submodules.mlp is spec.submodules.mlp
    assert snapshot(spec) == before
    assert attention(spec).module is mcore_mla.MLASelfAttention


def test_round_trip_restores_the_spec():
    spec = local_mla_spec()
    assert to_megatron_core_spec(to_megatron_ext_spec(spec)) == spec
    with_backends = to_megatron_ext_spec(spec, sdpa_backends=["math"])
    core_attention = attention(with_backends).submodules.core_attention
    assert isinstance(core_attention, ModuleSpec)
    assert core_attention.module is SDPADotProductAttention
    assert core_attention.params["sdpa_backends"] == [torch.nn.attention.SDPBackend.MATH]
    assert to_megatron_core_spec(with_backends) == spec


def test_te_shaped_spec_keeps_its_core_attention():
    spec = te_like_mla_spec()
    ext = to_megatron_ext_spec(spec)
    assert attention(ext).module is ExtMLASelfAttention
    assert attention(ext).submodules.core_attention is FakeTECoreAttention
    assert to_megatron_core_spec(ext) == spec


def test_real_te_spec_if_installed():
    pytest.importorskip("transformer_engine", reason="Transformer Engine is not installed")
    spec = mcore_specs.get_gpt_layer_with_transformer_engine_spec(
        multi_latent_attention=True, qk_layernorm=True
    )
    ext = to_megatron_ext_spec(spec)
    assert attention(ext).module is ExtMLASelfAttention
    assert attention(ext).submodules.core_attention is attention(spec).submodules.core_attention
    assert to_megatron_core_spec(ext) == spec


def test_only_core_attention_when_rope_not_requested():
    spec = local_mla_spec()
    ext = to_megatron_ext_spec(spec, mla_rope_contiguous_load=False)
    assert attention(ext).module is mcore_mla.MLASelfAttention
    assert attention(ext).submodules.core_attention is SDPADotProductAttention
    only_mla = to_megatron_ext_spec(spec, sdpa_core_attention=False)
    assert attention(only_mla).submodules.core_attention is DotProductAttention
    assert attention(only_mla).module is ExtMLASelfAttention


def test_core_attention_given_as_module_spec():
    spec = local_mla_spec()
    attention(spec).submodules.core_attention = ModuleSpec(
        module=DotProductAttention, params={"attention_dropout": 0.0}
    )
    ext = to_megatron_ext_spec(spec, sdpa_backends=["math"])
    core = attention(ext).submodules.core_attention
    assert core.module is SDPADotProductAttention
    assert core.params == {
        "attention_dropout": 0.0,
        "sdpa_backends": [torch.nn.attention.SDPBackend.MATH],
    }
    back = to_megatron_core_spec(ext)
    assert attention(back).submodules.core_attention == ModuleSpec(
        module=DotProductAttention, params={"attention_dropout": 0.0}
    )


def test_block_spec_keeps_sharing_and_swaps_every_layer():
    layer = local_mla_spec()
    block = TransformerBlockSubmodules(layer_specs=[layer, layer, layer], layer_norm=None)
    ext = to_megatron_ext_spec(block)
    assert isinstance(ext, TransformerBlockSubmodules)
    assert ext.layer_specs[0] is ext.layer_specs[1] is ext.layer_specs[2]
    assert attention(ext.layer_specs[0]).module is ExtMLASelfAttention
    assert count_mla_attention_specs(ext) == {"ExtMLASelfAttention": 1}
    assert count_mla_attention_specs([layer, ext]) == {
        "MLASelfAttention": 1,
        "ExtMLASelfAttention": 1,
    }


def test_decoder_block_spec_from_megatron_core(mcore_parallel_state, make_mla_config):
    config = make_mla_config(num_layers=3, normalization="RMSNorm")
    block = mcore_specs.get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization="RMSNorm"
    )
    ext = to_megatron_ext_spec(block)
    assert len(ext.layer_specs) == 3
    assert all(attention(s).module is ExtMLASelfAttention for s in ext.layer_specs)
    assert to_megatron_core_spec(ext) == block


def test_import_path_tuples_are_recognised():
    spec = local_mla_spec()
    attention(spec).module = (
        "megatron.core.transformer.multi_latent_attention",
        "MLASelfAttention",
    )
    assert attention(to_megatron_ext_spec(spec)).module is ExtMLASelfAttention


def test_strict_refuses_specs_without_mla():
    spec = mcore_specs.get_gpt_layer_local_spec(multi_latent_attention=False)
    with pytest.raises(ValueError, match="no MLASelfAttention"):
        to_megatron_ext_spec(spec)
    assert to_megatron_ext_spec(spec, strict=False) is spec
    # A plain attention's local core attention is not MLA's: it stays.
    assert (
        to_megatron_ext_spec(spec, strict=False).submodules.self_attention.submodules.core_attention
        is DotProductAttention
    )


def test_ext_spec_builds_mla_without_te(monkeypatch, mcore_parallel_state, make_mla_config):
    """The swapped local spec builds an MLA layer; megatron-core's own local spec cannot."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    config = make_mla_config(
        normalization="RMSNorm", qk_layernorm=True, use_cpu_initialization=True
    )
    spec = attention(local_mla_spec())
    with pytest.raises(TypeError):
        spec.module(config, spec.submodules, layer_number=1, attn_mask_type=AttnMaskType.causal)
    ext = attention(to_megatron_ext_spec(local_mla_spec()))
    module = ext.module(config, ext.submodules, layer_number=1, attn_mask_type=AttnMaskType.causal)
    assert isinstance(module.core_attention, SDPADotProductAttention)


def test_swapping_the_sdpa_core_attention_in_applies_te_free_mla(mla_transformer_config):
    """The conversion that makes MLA buildable without TE is where the fix megatron-core 0.16's
    MLA constructor needs is applied (declared in patches.PATCHES); building modules applies none.
    """
    patches.undo_patches(patches.TE_FREE_MLA)
    to_megatron_ext_spec(local_mla_spec(), sdpa_core_attention=False)
    assert not patches.is_applied(patches.TE_FREE_MLA)
    to_megatron_ext_spec(local_mla_spec())
    assert patches.is_applied(patches.TE_FREE_MLA)
    patches.undo_patches(patches.TE_FREE_MLA)
    get_gpt_layer_local_mla_spec(mla_transformer_config())
    assert patches.is_applied(patches.TE_FREE_MLA)


@pytest.mark.skipif(
    ExtFusedMLASelfAttention is None,
    reason="this megatron-core release has no FusedMLASelfAttention",
)
def test_fused_mla_swapped():
    spec = local_mla_spec()
    attention(spec).module = mcore_mla.FusedMLASelfAttention
    ext = to_megatron_ext_spec(spec)
    assert attention(ext).module is ExtFusedMLASelfAttention
    assert attention(to_megatron_core_spec(ext)).module is mcore_mla.FusedMLASelfAttention


class TestPatchMegatronCoreSpecs:
    def teardown_method(self):
        unpatch_megatron_core_gpt_specs()

    def test_patch_and_unpatch(self):
        assert not is_megatron_core_gpt_specs_patched()
        names = patch_megatron_core_gpt_specs()
        assert "megatron.core.models.gpt.gpt_layer_specs.MLASelfAttention" in names
        assert is_megatron_core_gpt_specs_patched()
        assert attention(local_mla_spec()).module is ExtMLASelfAttention
        # Non-MLA specs are unaffected.
        plain = mcore_specs.get_gpt_layer_local_spec(multi_latent_attention=False)
        assert "MLA" not in plain.submodules.self_attention.module.__name__
        patch_megatron_core_gpt_specs()  # idempotent
        unpatch_megatron_core_gpt_specs()
        assert not is_megatron_core_gpt_specs_patched()
        assert attention(local_mla_spec()).module is mcore_mla.MLASelfAttention
        assert mcore_specs.MLASelfAttention is mcore_mla.MLASelfAttention
        unpatch_megatron_core_gpt_specs()  # a no-op now
        assert mcore_specs.MLASelfAttention is mcore_mla.MLASelfAttention


# ----------------------------------------------------------------------------------------------
# Every megatron-core builder that can produce MLA self-attention builds the extension class
# while it is patched in.

_MLA_NAME = re.compile(r"\b(?:Fused)?MLASelfAttention\b")


def test_patched_modules_are_every_megatron_core_module_that_names_mla():
    """A megatron-core release that adds a builder elsewhere fails here until it is patched."""
    import megatron.core

    root = Path(megatron.core.__file__).parent
    defining = root / "transformer" / "multi_latent_attention.py"
    naming = set()
    for path in root.rglob("*.py"):
        if path == defining:
            continue
        code = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
        if _MLA_NAME.search("\n".join(code)):
            naming.add(
                ".".join(("megatron", "core", *path.relative_to(root).with_suffix("").parts))
            )
    patched = set()
    for entry in patches.PATCHES[patches.MLA_ROPE_CONTIGUOUS_LOAD]:
        try:
            module = importlib.import_module(entry.module_name)
        except ImportError:
            continue
        # An optional patch whose attribute this release lacks (0.19's DSA variant specs) does not
        # count as patched.
        if isinstance(entry, patches.SpecConstantsPatch) or hasattr(module, entry.attribute):
            patched.add(entry.module_name)
    rope_modules = {"megatron.core.fusions.fused_mla_yarn_rope_apply", mcore_mla.__name__}
    assert naming == patched - rope_modules


@pytest.fixture
def mla_transformer_config(make_mla_config):
    """Two layers and a multi-token-prediction layer, RMSNorm."""
    return functools.partial(
        make_mla_config, num_layers=2, normalization="RMSNorm", mtp_num_layers=1
    )


class _AnyBackend:
    """A spec backend whose every layer is a placeholder class (no Transformer Engine needed):
    the builders' choice of attention class is what is checked."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: type(f"Placeholder_{name}", (), {})


def _builders(config):
    """(name, zero-argument builder) for every MLA-producing builder this release has."""
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as variants
    from megatron.core.post_training.modelopt.gpt.model_specs import get_gpt_modelopt_spec

    builders = [
        ("get_gpt_layer_local_spec", lambda: local_mla_spec()),
        (
            "get_gpt_decoder_block_spec",
            lambda: mcore_specs.get_gpt_decoder_block_spec(
                config, use_transformer_engine=False, normalization="RMSNorm"
            ),
        ),
        (
            "get_gpt_mtp_block_spec",
            lambda: mcore_specs.get_gpt_mtp_block_spec(
                config, local_mla_spec(), use_transformer_engine=False
            ),
        ),
        ("get_gpt_modelopt_spec", lambda: get_gpt_modelopt_spec(config)),
        (
            "get_gpt_modelopt_spec(local_core_attention)",
            lambda: get_gpt_modelopt_spec(config, local_core_attention=True),
        ),
    ]
    if getattr(variants, "MLASelfAttention", None) is not None:  # megatron-core 0.16
        builders.append(
            (
                "get_dsa_module_spec_for_backend",
                lambda: variants.get_dsa_module_spec_for_backend(config, _AnyBackend()),
            )
        )
    try:
        from megatron.core.models.hybrid import hybrid_block, hybrid_layer_specs
        from megatron.core.models.mamba import mamba_layer_specs
        from megatron.core.post_training.modelopt.hybrid.model_specs import (
            get_hybrid_stack_modelopt_spec,
        )
    except ImportError:  # megatron-core < 0.19 has no hybrid MLA models
        return builders
    builders += [
        ("hybrid_stack_spec", lambda: hybrid_layer_specs.hybrid_stack_spec),
        ("hybrid_inference_stack_spec", lambda: hybrid_layer_specs.hybrid_inference_stack_spec),
        ("mamba_stack_spec", lambda: mamba_layer_specs.mamba_stack_spec),
        ("get_hybrid_stack_modelopt_spec", lambda: get_hybrid_stack_modelopt_spec()),
        (
            "HybridStack._fuse_mla_down_proj",
            # megatron-core's own stack spec holds objects deepcopy refuses without Transformer
            # Engine; a local MLA layer stands in for its MLA layer.
            lambda: hybrid_block.HybridStack._fuse_mla_down_proj(
                None, hybrid_block.HybridStackSubmodules(mla_layer=local_mla_spec())
            ),
        ),
    ]
    return builders


def _mcore_and_ext_counts(spec):
    counts = count_mla_attention_specs(spec)
    mcore = sum(n for name, n in counts.items() if not name.startswith("Ext"))
    ext = sum(n for name, n in counts.items() if name.startswith("Ext"))
    return mcore, ext


def test_every_builder_builds_the_extension_while_patched(
    mcore_parallel_state, mla_transformer_config
):
    builders = _builders(mla_transformer_config())
    try:
        patch_megatron_core_gpt_specs()
        while_patched = {name: _mcore_and_ext_counts(build()) for name, build in builders}
    finally:
        unpatch_megatron_core_gpt_specs()
    after = {name: _mcore_and_ext_counts(build()) for name, build in builders}
    for name, (mcore, ext) in while_patched.items():
        assert mcore == 0 and ext > 0, f"{name}: {mcore} megatron-core MLA specs while patched"
    for name, (mcore, ext) in after.items():
        assert ext == 0 and mcore > 0, f"{name}: {ext} megatron_ext MLA specs after unpatching"


def test_te_spec_builder_is_patched_too():
    """The Transformer Engine spec needs TE to build; it reads the same module global."""
    if getattr(mcore_specs, "HAVE_TE", False) is not True:
        pytest.skip("Transformer Engine is not installed: its spec cannot be built here")
    try:
        patch_megatron_core_gpt_specs()
        spec = mcore_specs.get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True)
    finally:
        unpatch_megatron_core_gpt_specs()
    assert _mcore_and_ext_counts(spec)[0] == 0


def test_local_mla_spec_for_megatron_trainings_spec_option():
    """What megatron.training 0.19's --spec calls with the model config: megatron-core's local MLA
    layer with the SDPA core attention; its MLA class follows the flag's patch."""
    from types import SimpleNamespace

    config = SimpleNamespace(qk_layernorm=True, normalization="RMSNorm")
    spec = get_gpt_layer_local_mla_spec(config)
    attention = spec.submodules.self_attention
    assert attention.module is mcore_mla.MLASelfAttention
    assert attention.submodules.core_attention.module is SDPADotProductAttention
    assert attention.submodules.core_attention.params["sdpa_backends"] is not None
    assert attention.submodules.q_layernorm is not None
    try:
        patch_megatron_core_gpt_specs()
        patched = get_gpt_layer_local_mla_spec(config, vp_stage=0)
    finally:
        unpatch_megatron_core_gpt_specs()
    assert patched.submodules.self_attention.module is ExtMLASelfAttention
