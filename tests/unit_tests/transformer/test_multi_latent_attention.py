# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""ExtMLASelfAttention: megatron-core's MLA with megatron_ext's RoPE kernels, nothing else."""

import contextlib
import dataclasses
import threading
import types

import mla_rope_reference
import numpy as np
import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import multi_latent_attention as mcore_mla
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron_ext import patches
from megatron_ext.fusions import fused_mla_yarn_rope_apply as ext_rope
from megatron_ext.models.gpt.gpt_layer_specs import to_megatron_ext_spec
from megatron_ext.transformer import multi_latent_attention as ext_mla
from megatron_ext.transformer.multi_latent_attention import (
    ExtFusedMLASelfAttention,
    ExtMLASelfAttention,
)
from tests.unit_tests.fusions.mla_rope_testlib import (
    assert_bitwise_equal,
    pin_megatron_core_autotuners,
)


def make_config(device: str, **overrides) -> MLATransformerConfig:
    """A small MLA config; on GPU DeepSeek-V3's head sizes (the kernels' real shapes)."""
    gpu = device == "cuda"
    kwargs = dict(
        num_layers=1,
        hidden_size=256 if gpu else 64,
        num_attention_heads=8 if gpu else 4,
        q_lora_rank=96 if gpu else 32,
        kv_lora_rank=64 if gpu else 16,
        qk_head_dim=128 if gpu else 16,
        qk_pos_emb_head_dim=64 if gpu else 8,
        v_head_dim=128 if gpu else 16,
        qk_layernorm=True,
        normalization="RMSNorm",
        rope_type="yarn",
        apply_rope_fusion=True,
        rotary_scaling_factor=40.0,
        original_max_position_embeddings=64,
        mscale=1.0,
        mscale_all_dim=1.0,
        add_bias_linear=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=not gpu,
        params_dtype=torch.float32,
    )
    kwargs.update(overrides)
    return MLATransformerConfig(**kwargs)


def mla_submodules(sdpa_backends=None):
    spec = get_gpt_layer_local_spec(
        multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm"
    )
    spec = to_megatron_ext_spec(spec, mla_rope_contiguous_load=False, sdpa_backends=sdpa_backends)
    return spec.submodules.self_attention.submodules


def build_pair(config, device="cpu", dtype=torch.float32, sdpa_backends=None, fused=False):
    """megatron-core's MLASelfAttention and ExtMLASelfAttention with the same weights (with
    ``fused``: 0.19's FusedMLASelfAttention, one q/kv down projection, and megatron_ext's)."""
    torch.manual_seed(0)
    sub = mla_submodules(sdpa_backends)
    base_cls, ext_cls = mcore_mla.MLASelfAttention, ExtMLASelfAttention
    if fused:
        from megatron.core.tensor_parallel import ColumnParallelLinear

        sub = dataclasses.replace(sub, linear_qkv_down_proj=ColumnParallelLinear)
        base_cls, ext_cls = mcore_mla.FusedMLASelfAttention, ExtFusedMLASelfAttention
    base = base_cls(config, sub, layer_number=1, attn_mask_type=AttnMaskType.causal)
    ext = ext_cls(config, sub, layer_number=1, attn_mask_type=AttnMaskType.causal)
    ext.load_state_dict(base.state_dict())
    return base.to(device=device, dtype=dtype), ext.to(device=device, dtype=dtype)


def make_inputs(config, fmt, device="cpu", dtype=torch.float32, seq=12, batch=2):
    gen = torch.Generator().manual_seed(7)
    if fmt == "sbhd":
        hidden = torch.randn(seq, batch, config.hidden_size, generator=gen)
        params = None
    else:
        lengths, padded = [5, 3, 7], [8, 4, 8]
        hidden = torch.randn(sum(padded), 1, config.hidden_size, generator=gen)
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32).to(device)
        cu_padded = torch.tensor([0] + padded).cumsum(0).to(torch.int32).to(device)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu_padded,
            cu_seqlens_kv_padded=cu_padded,
            max_seqlen_q=max(padded),
            max_seqlen_kv=max(padded),
        )
    return hidden.to(device=device, dtype=dtype), params


def forward_backward(module, hidden, params, seed=3):
    hidden = hidden.detach().clone().requires_grad_()
    out, _ = module(hidden, None, packed_seq_params=params)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    out.backward(grad)
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return out.detach(), hidden.grad.detach(), grads


def assert_bitwise(a, b):
    """``b`` (megatron_ext's output, input gradient and parameter gradients) holds ``a``'s
    (megatron-core's) bits; a failure names the tensor and where megatron_ext's bits moved."""
    out_a, dx_a, g_a = a
    out_b, dx_b, g_b = b
    reference = "megatron-core"
    assert_bitwise_equal(out_b, out_a, "megatron_ext's output vs megatron-core's", None, reference)
    assert_bitwise_equal(
        dx_b, dx_a, "megatron_ext's input gradient vs megatron-core's", None, reference
    )
    assert g_a.keys() == g_b.keys()
    for name in g_a:
        assert_bitwise_equal(
            g_b[name], g_a[name], f"megatron_ext's gradient of {name} vs megatron-core's"
        )


@pytest.fixture(autouse=True)
def _parallel_state(mcore_parallel_state):
    yield


@contextlib.contextmanager
def ext_rope_applied():
    """The flag's patches of megatron-core, as ``apply_megatron_ext`` applies them."""
    patches.apply_patches(patches.MLA_ROPE_CONTIGUOUS_LOAD)
    try:
        yield
    finally:
        patches.undo_patches(patches.MLA_ROPE_CONTIGUOUS_LOAD)


# ----------------------------------------------------------------------------------------------
# CPU: structure and routing (both sides compute with the plain-torch reference)


def test_override_is_minimal():
    def methods(cls):
        return {
            k
            for k, v in vars(cls).items()
            if (callable(v) or isinstance(v, property)) and not k.startswith("__")
        }

    # rotary_pos_emb: megatron-core's submodule, seen by a static-batching step as its own rows.
    # forward: a dynamic-batching step is megatron_ext's (mla_dynamic_inference).
    assert methods(ext_mla._ContiguousLoadRopeMixin) == {
        "forward",
        "get_query_key_value_tensors",
        "rotary_pos_emb",
    }
    # The subclasses add nothing to the shared overrides.
    assert methods(ExtMLASelfAttention) == set()
    assert issubclass(ExtMLASelfAttention, mcore_mla.MLASelfAttention)
    fused = getattr(mcore_mla, "FusedMLASelfAttention", None)
    if fused is None:
        assert ExtFusedMLASelfAttention is None
    else:
        assert issubclass(ExtFusedMLASelfAttention, fused)
        assert methods(ExtFusedMLASelfAttention) == set()


@pytest.mark.parametrize("fused", [False, True], ids=["mla", "fused_down_proj"])
@pytest.mark.parametrize("fmt", ["sbhd", "thd"])
def test_same_result_and_rope_routed_to_megatron_ext(fmt, fused, rope_spies, cpu_current_device):
    if fused and ExtFusedMLASelfAttention is None:
        pytest.skip("megatron-core 0.16 has no FusedMLASelfAttention (0.19's mla_down_proj_fusion)")
    config = make_config("cpu")
    base, ext = build_pair(config, fused=fused)
    hidden, params = make_inputs(config, fmt)

    base_result = forward_backward(base, hidden, params)
    assert rope_spies == {"ext": [], "mcore": ["q", "kv"]}
    with ext_rope_applied():
        ext_result = forward_backward(ext, hidden, params)
    assert rope_spies == {"ext": ["q", "kv"], "mcore": ["q", "kv"]}
    assert_bitwise(base_result, ext_result)
    # Undo put megatron-core's functions back (here: the test's double standing in for them).
    assert mcore_mla.fused_apply_mla_rope_for_q.__name__ == "wrapper"
    assert mcore_mla.fused_apply_mla_rope_for_q is not ext_rope.fused_apply_mla_rope_for_q


def test_refuses_to_run_without_the_patch(rope_spies, cpu_current_device):
    config = make_config("cpu")
    _, ext = build_pair(config)
    hidden, params = make_inputs(config, "sbhd")
    with pytest.raises(ext_mla.MegatronExtRopeNotAppliedError, match="apply_megatron_ext"):
        forward_backward(ext, hidden, params)
    assert rope_spies == {"ext": [], "mcore": []}


def test_while_applied_every_mla_module_runs_megatron_ext_kernels(rope_spies, cpu_current_device):
    """The patch is process-wide, as the flag documents: a stock module built earlier too."""
    config = make_config("cpu")
    base, _ = build_pair(config)
    hidden, params = make_inputs(config, "sbhd")
    with ext_rope_applied():
        forward_backward(base, hidden, params)
    assert rope_spies == {"ext": ["q", "kv"], "mcore": []}


def test_no_patch_needed_without_rope_fusion(rope_spies, cpu_current_device):
    config = make_config("cpu", apply_rope_fusion=False)
    base, ext = build_pair(config)
    hidden, params = make_inputs(config, "sbhd")
    assert_bitwise(forward_backward(base, hidden, params), forward_backward(ext, hidden, params))
    assert rope_spies == {"ext": [], "mcore": []}


def test_gpt_model_from_ext_spec_matches(rope_spies, cpu_current_device, monkeypatch):
    from megatron.core.models.gpt.gpt_model import GPTModel

    try:  # megatron-core >= 0.19 keeps a process-wide inference flag; this is training
        from megatron.core.inference.utils import InferenceMode

        monkeypatch.setattr(InferenceMode, "_is_active", False)
    except ImportError:
        pass

    config = make_config("cpu", num_layers=2)
    spec = get_gpt_layer_local_spec(
        multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm"
    )
    models = []
    for rope in (False, True):
        torch.manual_seed(0)
        models.append(
            GPTModel(
                config,
                to_megatron_ext_spec(spec, mla_rope_contiguous_load=rope),
                vocab_size=64,
                max_sequence_length=16,
                position_embedding_type="rope",
            )
        )
    assert sum(isinstance(m, ExtMLASelfAttention) for m in models[1].modules()) == 2
    assert not any(isinstance(m, ExtMLASelfAttention) for m in models[0].modules())
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    position_ids = torch.arange(16).expand(2, 16)
    losses = []
    for model, applied in zip(models, (contextlib.nullcontext, ext_rope_applied)):
        with applied():
            loss = model(tokens, position_ids, None, labels=tokens).sum()
            loss.backward()
        losses.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(losses[0][0], losses[1][0])
    assert all(torch.equal(a, b) for a, b in zip(losses[0][1], losses[1][1]))
    assert rope_spies["ext"] == ["q", "kv"] * 2 and rope_spies["mcore"] == ["q", "kv"] * 2


def test_context_parallel_thd_lengths_checked_when_on_the_host():
    class _Group:
        def __init__(self, size):
            self._size = size

        def size(self):
            return self._size

    module = types.SimpleNamespace(pg_collection=types.SimpleNamespace(cp=_Group(2)))
    odd = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=torch.tensor([0, 8, 14], dtype=torch.int32),
        cu_seqlens_kv=torch.tensor([0, 8, 14], dtype=torch.int32),
    )
    with pytest.raises(ValueError, match="sequence 1 has length 6"):
        ext_mla._check_context_parallel_lengths(module, odd)
    with pytest.raises(ValueError, match="multiple of 2 \\* cp_size = 4"):
        ext_mla._check_context_parallel_lengths(module, odd)
    padded = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=odd.cu_seqlens_q,
        cu_seqlens_kv=odd.cu_seqlens_kv,
        cu_seqlens_q_padded=torch.tensor([0, 8, 16], dtype=torch.int32),
        cu_seqlens_kv_padded=torch.tensor([0, 8, 16], dtype=torch.int32),
    )
    ext_mla._check_context_parallel_lengths(module, padded)
    module.pg_collection.cp = _Group(1)
    ext_mla._check_context_parallel_lengths(module, odd)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run the real kernels")
def test_reference_double_matches_megatron_core_kernels(monkeypatch):
    """The CPU tests' double computes what megatron-core's kernels compute (Triton interpreter)."""
    gen = torch.Generator().manual_seed(0)
    s, b, h, dk, emb, dv = 5, 2, 3, 8, 8, 4
    kernels = pin_megatron_core_autotuners(monkeypatch, h)
    cos = torch.randn(16, 1, 1, emb, generator=gen)
    sin = torch.randn(16, 1, 1, emb, generator=gen)
    for cu in (None, torch.tensor([0, 4, 10], dtype=torch.int32)):
        shape = (s, b) if cu is None else (10,)
        q = torch.randn(*shape, h, dk + emb, generator=gen)
        kv = torch.randn(*shape, h, dk + dv, generator=gen)
        k_pe = torch.randn(*shape, 1, emb, generator=gen)
        want_q = mla_rope_reference.rope_q(q, cos, sin, dk, emb, cu)
        got_q = kernels.fused_apply_mla_rope_for_q(q.clone(), cos, sin, dk, emb, cu)
        torch.testing.assert_close(got_q, want_q, atol=0, rtol=0)
        want_k, want_v = mla_rope_reference.rope_kv(kv, k_pe, cos, sin, emb, dk, dv, cu)
        got_k, got_v = kernels.fused_apply_mla_rope_for_kv(kv, k_pe, cos, sin, emb, dk, dv, cu)
        torch.testing.assert_close(got_k, want_k, atol=0, rtol=0)
        assert torch.equal(got_v, want_v)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run the real kernels")
@pytest.mark.parametrize("fmt", ["sbhd", "thd"])
def test_real_kernels_agree_under_interpreter(
    fmt, monkeypatch, cpu_current_device, ext_kernel_calls
):
    """Both classes with their real kernels (Triton interpreter, fp32) agree to rounding.

    Not bit for bit here: megatron_ext's kernels pair products into FMAs explicitly, as the GPU
    compiler contracts megatron-core's; the interpreter evaluates megatron-core's unfused, so the
    last bit may differ on CPU. The GPU tests below check bit identity.
    """
    config = make_config("cpu")
    pin_megatron_core_autotuners(monkeypatch, config.num_attention_heads)
    base, ext = build_pair(config)
    hidden, params = make_inputs(config, fmt, seq=6)
    base_result = forward_backward(base, hidden, params)
    with ext_rope_applied():
        ext_result = forward_backward(ext, hidden, params)
    assert ext_kernel_calls == ["fused_apply_mla_rope_for_q", "fused_apply_mla_rope_for_kv"]
    for a, b in zip(base_result[:2], ext_result[:2]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for name in base_result[2]:
        torch.testing.assert_close(base_result[2][name], ext_result[2][name], atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# Static-batching inference: the fused RoPE from the context's sequence offset


def static_context(max_sequence_length=16, batch=2):
    from megatron.core.inference.contexts import StaticInferenceContext

    return StaticInferenceContext(batch, max_sequence_length)


@pytest.fixture
def rope_tables(monkeypatch):
    """Record the cos/sin rows handed to megatron_ext's kernels (computing with the double)."""
    seen = []

    def recording(reference):
        def wrapper(*args, **kwargs):
            seen.append(args[2 if reference is mla_rope_reference.rope_kv else 1].clone())
            return reference(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        ext_rope, "fused_apply_mla_rope_for_q", recording(mla_rope_reference.rope_q)
    )
    monkeypatch.setattr(
        ext_rope, "fused_apply_mla_rope_for_kv", recording(mla_rope_reference.rope_kv)
    )
    return seen


def generate_rows(module, hidden, prefill, max_sequence_length=16):
    """Query/key/value of a prefill of ``prefill`` tokens, then one decode step per token."""
    context = static_context(max_sequence_length, hidden.shape[1])
    rows = [module.get_query_key_value_tensors(hidden[:prefill], inference_context=context)[:3]]
    for position in range(prefill, hidden.shape[0]):
        context.sequence_len_offset = position
        context.enable_decode_mode()
        step = module.get_query_key_value_tensors(
            hidden[position : position + 1], inference_context=context
        )
        rows.append(step[:3])
    return [torch.cat(parts) for parts in zip(*rows)]


def test_static_inference_rotates_from_the_context_offset(rope_tables, cpu_current_device):
    config = make_config("cpu")
    _, ext = build_pair(config)
    hidden, _ = make_inputs(config, "sbhd", seq=9)
    with ext_rope_applied(), torch.no_grad():
        full = ext.get_query_key_value_tensors(hidden)[:3]
        full_cos = rope_tables[0]
        stepped = generate_rows(ext, hidden, prefill=4)
    # One q and one kv call for the full forward and per step; each step got rows offset.. of the
    # same table bits.
    assert len(rope_tables) == 2 * (1 + 1 + 9 - 4)
    offsets = [0] + list(range(4, 9))
    for step, offset in enumerate(offsets):
        for cos in rope_tables[2 + 2 * step : 4 + 2 * step]:
            assert torch.equal(cos, full_cos[offset : offset + cos.shape[0]])
    for a, b in zip(stepped, full):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert "get_cached_cos_sin" not in vars(ext.rotary_pos_emb)


def test_static_inference_matches_megatron_core_unfused_path(rope_spies, cpu_current_device):
    """megatron-core refuses the fused path with a context; its unfused path is the reference."""
    _, fused = build_pair(make_config("cpu"))
    unfused, _ = build_pair(make_config("cpu", apply_rope_fusion=False))
    hidden, _ = make_inputs(make_config("cpu"), "sbhd", seq=9)
    with torch.no_grad():
        with pytest.raises(AssertionError, match="Inference with MLA RoPE fusion is not supported"):
            mcore_mla.MLASelfAttention.get_query_key_value_tensors(
                fused, hidden[:4], inference_context=static_context()
            )
        want = generate_rows(unfused, hidden, prefill=4)
        with ext_rope_applied():
            got = generate_rows(fused, hidden, prefill=4)
    assert rope_spies["ext"] == ["q", "kv"] * 6 and rope_spies["mcore"] == []
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_static_inference_refusals(rope_spies, cpu_current_device, monkeypatch):
    """Each refused before any projection runs (so before any RoPE kernel)."""
    _, ext = build_pair(make_config("cpu"))
    hidden, _ = make_inputs(make_config("cpu"), "sbhd", seq=4)
    projections = []
    ext.linear_kv_down_proj.register_forward_pre_hook(lambda *_: projections.append(1))
    dynamic = types.SimpleNamespace(is_static_batching=lambda: False)
    thd = PackedSeqParams(qkv_format="thd")
    context = static_context(max_sequence_length=8)

    def refused(error, match, *args, inference_context=context, **kwargs):
        with pytest.raises(error, match=match):
            ext.get_query_key_value_tensors(
                *(args or (hidden,)), inference_context=inference_context, **kwargs
            )

    with ext_rope_applied(), torch.no_grad():
        refused(ValueError, "static-batching inference .* only", inference_context=dynamic)
        for bad, name in ((object(), "object"), ({}, "dict")):
            refused(
                TypeError,
                f"inference_context must be .*inference context.*got {name}",
                inference_context=bad,
            )
        refused(ValueError, "qkv_format='thd'", hidden, None, None, thd)
        for bad in (torch.tensor(2), 2.0, None, True):
            context.sequence_len_offset = bad
            refused(TypeError, r"sequence_len_offset must be a host int")
        context.sequence_len_offset = -1
        refused(ValueError, r"sequence_len_offset must be >= 0, got -1")
        context.sequence_len_offset = 5
        refused(ValueError, "positions 5..8, past the context's max_sequence")
        context.sequence_len_offset = 4
        context.max_sequence_length = "8"
        refused(TypeError, r"max_sequence_length must be a host int .*got str \('8'\)")
        context.max_sequence_length = 8
        refused(TypeError, r"hidden_states must be a 3-D tensor .*shape \(4, 64\)", hidden[:, 0])
        with monkeypatch.context() as patch:
            cp = types.SimpleNamespace(size=lambda: 2, rank=lambda: 0)
            patch.setattr(ext, "pg_collection", types.SimpleNamespace(cp=cp))
            refused(ValueError, r"context parallelism \(2 ranks\)")
        assert projections == [] and rope_spies["ext"] == []
        assert "get_cached_cos_sin" not in vars(ext.rotary_pos_emb)
        # The deprecated keyword reaches the same path; numpy ints are host ints.
        context.sequence_len_offset = np.int64(4)
        ext.get_query_key_value_tensors(hidden, inference_params=context)
    assert rope_spies["ext"] == ["q", "kv"]


def test_static_decode_with_packed_sbhd_params_at_an_offset(rope_spies, cpu_current_device):
    """A packed sbhd ``max_seqlen`` bounds the batch's sequence lengths, not a decode step's
    positions: megatron-core's unfused path computes a row at offset 4 of 16, and so does the
    fused one (it was refused as "positions 4..19")."""
    _, fused = build_pair(make_config("cpu"))
    unfused, _ = build_pair(make_config("cpu", apply_rope_fusion=False))
    hidden, _ = make_inputs(make_config("cpu"), "sbhd", seq=16)
    params = PackedSeqParams(qkv_format="sbhd", max_seqlen_q=16, max_seqlen_kv=16)
    for offset in (4, 15):
        context = static_context(max_sequence_length=16, batch=hidden.shape[1])
        context.sequence_len_offset = offset
        row = hidden[offset : offset + 1]
        with torch.no_grad():
            want = unfused.get_query_key_value_tensors(row, None, None, params, context)[:3]
            with ext_rope_applied():
                got = fused.get_query_key_value_tensors(row, None, None, params, context)[:3]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert rope_spies["ext"] == ["q", "kv"] * 2


def test_threads_sharing_a_module_each_rotate_from_their_own_context(
    rope_spies, cpu_current_device
):
    """Two threads, each with its own StaticInferenceContext (offsets 3 and 40), run one module
    many times: every output is bitwise the single-threaded one, and the module's state (its
    rotary embedding's attributes and megatron-core's cos/sin cache) never changes."""
    _, ext = build_pair(make_config("cpu"))
    hidden, _ = make_inputs(make_config("cpu"), "sbhd", seq=48)
    offsets, steps, rows = (3, 40), 150, 2
    contexts = {}
    for offset in offsets:
        contexts[offset] = static_context(max_sequence_length=64, batch=hidden.shape[1])
        contexts[offset].sequence_len_offset = offset

    def step(offset):
        with torch.no_grad():  # grad mode is per thread
            out = ext.get_query_key_value_tensors(
                hidden[offset : offset + rows], inference_context=contexts[offset]
            )
        return [t.clone() for t in out[:3]]

    errors, mismatches = [], []

    def worker(offset, start):
        try:
            start.wait()
            for _ in range(steps):
                got = step(offset)
                if not all(torch.equal(a, b) for a, b in zip(got, expected[offset])):
                    mismatches.append(offset)
        except Exception as error:  # noqa: BLE001 (reported below, with its thread)
            errors.append((offset, repr(error)))

    rotary = ext.rotary_pos_emb
    with ext_rope_applied():
        expected = {offset: step(offset) for offset in offsets}
        assert not torch.equal(expected[3][0], step(40)[0])
        state = dict(vars(rotary))
        cache = (rotary.cos_cached, rotary.sin_cached)
        start = threading.Barrier(len(offsets))
        threads = [threading.Thread(target=worker, args=(o, start)) for o in offsets]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == [] and mismatches == [], (errors, mismatches[:5])
    assert len(rope_spies["ext"]) == 2 * (len(offsets) * (steps + 1) + 1)
    assert dict(vars(rotary)) == state
    assert rotary.cos_cached is cache[0] and rotary.sin_cached is cache[1]
    assert ext.rotary_pos_emb is rotary


@pytest.fixture
def kernel_io(monkeypatch):
    """Record the inputs (cloned, before the in-place query kernel) and outputs of megatron_ext's
    real kernels."""
    calls = []
    for name in ("fused_apply_mla_rope_for_q", "fused_apply_mla_rope_for_kv"):
        real = getattr(ext_rope, name)

        def recording(*args, _real=real, _name=name, **kwargs):
            inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            out = _real(*args, **kwargs)
            calls.append((_name, _real, inputs, out))
            return out

        monkeypatch.setattr(ext_rope, name, recording)
    return calls


def check_decode_rows_against_full_sequence(kernel_io, device, dtype, heads, batch, offsets):
    """Each decode step's rotated rows, bitwise against the same rows of a full-sequence call.

    The step's own pre-RoPE rows are planted at the step's position of a full-length input, so
    the comparison isolates the RoPE from the projections (whose bits may depend on the row count).

    Returns:
        int: kernel calls compared.
    """
    config = make_config(
        device, num_attention_heads=heads, params_dtype=dtype, bf16=dtype == torch.bfloat16
    )
    _, ext = build_pair(config, device, dtype)
    seq = max(offsets) + 1
    hidden, _ = make_inputs(config, "sbhd", device, dtype, seq=seq, batch=batch)
    gen = torch.Generator(device=device).manual_seed(11)
    checked = 0
    with ext_rope_applied(), torch.no_grad():
        # What a training forward over `seq` tokens rotates with: rows 0..seq-1.
        cos, sin = type(ext.rotary_pos_emb).get_cached_cos_sin(ext.rotary_pos_emb, seq, dtype=dtype)
        for offset in offsets:
            kernel_io.clear()
            context = static_context(seq, batch)
            context.sequence_len_offset = offset
            ext.get_query_key_value_tensors(hidden[offset : offset + 1], inference_context=context)
            for name, real, inputs, out in kernel_io:
                planted = []
                for x in inputs[: 2 if name.endswith("_kv") else 1]:
                    full = torch.randn((seq, *x.shape[1:]), generator=gen, device=device)
                    full = full.to(x.dtype)
                    full[offset : offset + 1] = x
                    planted.append(full)
                tables = 2 if name.endswith("_kv") else 1
                rest = inputs[tables + 2 :]
                want = real(*planted, cos, sin, *rest)
                outs = out if isinstance(out, tuple) else (out,)
                wants = want if isinstance(want, tuple) else (want,)
                for got_part, want_part in zip(outs, wants):
                    assert_bitwise_equal(
                        got_part, want_part[offset : offset + 1], f"{name} at offset {offset}"
                    )
                checked += 1
    return checked


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU variant runs the compiled kernels")
@pytest.mark.parametrize("heads,batch", [(4, 1), (3, 2)])
def test_decode_rows_bitwise_equal_to_full_sequence_interpreted(
    heads, batch, kernel_io, cpu_current_device
):
    checked = check_decode_rows_against_full_sequence(
        kernel_io, "cpu", torch.float32, heads, batch, offsets=[0, 1, 6]
    )
    assert checked == 2 * 3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads,batch", [(8, 1), (40, 3), (128, 2)])
def test_gpu_decode_rows_bitwise_equal_to_full_sequence(heads, batch, dtype, kernel_io):
    """Autotuned and at every config of the autotuner; 40 heads leave a partial head block."""
    from megatron_ext.fusions.mla_rope.launch import AUTOTUNE_CONFIGS, pinned_kernel_config

    checked = 0
    for config in (None,) + AUTOTUNE_CONFIGS:
        pinned = (
            contextlib.nullcontext()
            if config is None
            else pinned_kernel_config(config.block_h, config.num_warps)
        )
        with pinned:
            checked += check_decode_rows_against_full_sequence(
                kernel_io, "cuda", dtype, heads, batch, offsets=[0, 1, 63, 511, 4095]
            )
    assert checked == 2 * 5 * (1 + len(AUTOTUNE_CONFIGS))


# ----------------------------------------------------------------------------------------------
# GPU: the real kernels, bit for bit


@pytest.fixture
def ext_kernel_calls(monkeypatch):
    """Count calls into megatron_ext's real kernels (what the flag's patch installs)."""
    calls = []
    for name in ("fused_apply_mla_rope_for_q", "fused_apply_mla_rope_for_kv"):
        real = getattr(ext_rope, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(ext_rope, name, counting)
    return calls


def assert_flag_bitwise(base, ext, hidden, params, ext_kernel_calls):
    """megatron-core's module, then ours under the flag: megatron_ext's two kernels ran, and output
    and gradients are bitwise megatron-core's."""
    base_result = forward_backward(base, hidden, params)
    assert ext_kernel_calls == []
    with ext_rope_applied():
        ext_result = forward_backward(ext, hidden, params)
    assert ext_kernel_calls == ["fused_apply_mla_rope_for_q", "fused_apply_mla_rope_for_kv"]
    assert_bitwise(base_result, ext_result)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["sbhd", "thd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_bitwise_equal_to_megatron_core(fmt, dtype, ext_kernel_calls, monkeypatch):
    # megatron-core's key/value backward sums heads in a BLOCK_H-dependent order; BLOCK_H=1 is
    # its block-independent order, the one megatron_ext reproduces (and a race-free config).
    config = make_config("cuda", bf16=dtype == torch.bfloat16, params_dtype=dtype)
    pin_megatron_core_autotuners(monkeypatch, config.num_attention_heads)
    base, ext = build_pair(config, "cuda", dtype, sdpa_backends=["math"])
    hidden, params = make_inputs(config, fmt, "cuda", dtype, seq=64)
    assert_flag_bitwise(base, ext, hidden, params, ext_kernel_calls)


@pytest.mark.gpu
def test_gpu_recompute_uses_megatron_ext_kernels_in_backward(ext_kernel_calls, monkeypatch):
    config = make_config(
        "cuda",
        bf16=True,
        params_dtype=torch.bfloat16,
        recompute_granularity="selective",
        recompute_modules=["mla_up_proj"],
    )
    pin_megatron_core_autotuners(monkeypatch, config.num_attention_heads)
    base, ext = build_pair(config, "cuda", torch.bfloat16, sdpa_backends=["math"])
    hidden, params = make_inputs(config, "sbhd", "cuda", torch.bfloat16, seq=64)
    base_result = forward_backward(base, hidden, params)
    hidden_ext = hidden.detach().clone().requires_grad_()
    with ext_rope_applied():
        out, _ = ext(hidden_ext, None)
        forward_calls = len(ext_kernel_calls)
        assert forward_calls == 2
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out))
    # The up-projection + RoPE closure is replayed in backward, still with megatron_ext's kernels.
    assert len(ext_kernel_calls) == 4
    grads = {n: p.grad.detach().clone() for n, p in ext.named_parameters()}
    assert_bitwise(base_result, (out.detach(), hidden_ext.grad.detach(), grads))


# ----------------------------------------------------------------------------------------------
# Transformer Engine: megatron-core's TE layer spec, TE's core attention and linears


def te_attention_pair(config):
    """megatron-core's MLA and the flag's from megatron-core's own TE spec builder, same weights.

    The flag-on spec comes from the real builder while the flag's patches are applied, so the test
    also shows that the builder picks ``ExtMLASelfAttention`` under the flag.
    """
    from megatron.core.models.gpt import gpt_layer_specs as mcore_specs

    def attention_spec():
        spec = mcore_specs.get_gpt_layer_with_transformer_engine_spec(
            multi_latent_attention=True, qk_layernorm=True
        )
        return spec.submodules.self_attention

    stock = attention_spec()
    with ext_rope_applied():
        flagged = attention_spec()
    assert stock.module is mcore_mla.MLASelfAttention
    assert flagged.module is ExtMLASelfAttention
    assert flagged.submodules.core_attention is stock.submodules.core_attention
    torch.manual_seed(0)
    kwargs = dict(layer_number=1, attn_mask_type=AttnMaskType.causal)
    base = stock.module(config, stock.submodules, **kwargs)
    ext = flagged.module(config, flagged.submodules, **kwargs)
    ext.load_state_dict(base.state_dict())
    return base, ext


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["sbhd", "thd"])
def test_gpu_transformer_engine_spec_bitwise_equal_to_megatron_core(
    fmt, ext_kernel_calls, monkeypatch
):
    pytest.importorskip("transformer_engine.pytorch", reason="Transformer Engine is not installed")
    # TE's fused attention backward may accumulate with atomics unless told not to; the two sides
    # may then differ by its order, not by the RoPE.
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    config = make_config("cuda", bf16=True, params_dtype=torch.bfloat16, deterministic_mode=True)
    pin_megatron_core_autotuners(monkeypatch, config.num_attention_heads)
    base, ext = te_attention_pair(config)
    hidden, params = make_inputs(config, fmt, "cuda", torch.bfloat16, seq=64)
    assert_flag_bitwise(base, ext, hidden, params, ext_kernel_calls)
