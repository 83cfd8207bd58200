# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""SDPADotProductAttention against a float64 reference (CPU and GPU) and TE (where installed)."""

import math
import types

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.transformer.sdpa_attention import SDPADotProductAttention, resolve_sdpa_backends

HEADS, GROUPS, DK, DV = 4, 4, 24, 16


def make_config(**overrides) -> TransformerConfig:
    kwargs = dict(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=DK,
        attention_dropout=0.0,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def make_attention(mask_type=AttnMaskType.causal, config=None, **kwargs) -> SDPADotProductAttention:
    return SDPADotProductAttention(
        config=config or make_config(),
        layer_number=1,
        attn_mask_type=mask_type,
        attention_type="self",
        k_channels=kwargs.pop("k_channels", DK),
        v_channels=kwargs.pop("v_channels", DV),
        **kwargs,
    )


def reference(q, k, v, keep, scale):
    """float64 attention on [b, h, s, d]; rows with no visible key give zeros."""
    q, k, v = q.double(), k.double(), v.double()
    if k.size(1) != q.size(1):
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
        v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    if keep is not None:
        keep = keep.expand_as(scores)
        scores = scores.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    else:
        probs = torch.softmax(scores, dim=-1)
    return probs @ v


def sbhd_inputs(sq, sk, b=2, heads=HEADS, groups=GROUPS, dtype=torch.float64, device="cpu"):
    gen = torch.Generator().manual_seed(sq * 100 + sk)
    q = torch.randn(sq, b, heads, DK, generator=gen, dtype=torch.float64)
    k = torch.randn(sk, b, groups, DK, generator=gen, dtype=torch.float64)
    v = torch.randn(sk, b, groups, DV, generator=gen, dtype=torch.float64)
    return [x.to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v)]


def to_bhsd(x):
    return x.permute(1, 2, 0, 3)


def from_module(out, sq, b, heads=HEADS):
    # [sq, b, h*dv] -> [b, h, sq, dv]
    return out.view(sq, b, heads, -1).permute(1, 2, 0, 3)


def causal_keep(sq, sk, bottom_right=False):
    offset = sk - sq if bottom_right else 0
    return torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + offset


def check_against_reference(attn, q, k, v, mask, keep, atol=1e-10, mask_type=None):
    out = attn(q, k, v, mask, attn_mask_type=mask_type)
    sq, b = q.shape[:2]
    assert out.shape == (sq, b, HEADS * v.shape[-1])
    ref = reference(to_bhsd(q), to_bhsd(k), to_bhsd(v), keep, attn.softmax_scale)
    torch.testing.assert_close(from_module(out, sq, b).double(), ref, atol=atol, rtol=atol)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), from_module(grad, sq, b).double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=atol * 10, rtol=atol * 10)


@pytest.fixture(autouse=True)
def _parallel_state(mcore_parallel_state):
    yield


class TestAgainstFloat64Reference:
    def test_causal_mla_head_sizes(self):
        attn = make_attention()
        q, k, v = sbhd_inputs(7, 7)
        check_against_reference(attn, q, k, v, None, causal_keep(7, 7))
        assert attn.softmax_scale == pytest.approx(1 / math.sqrt(DK))

    def test_explicit_softmax_scale(self):
        attn = make_attention(softmax_scale=0.37)
        q, k, v = sbhd_inputs(5, 5)
        check_against_reference(attn, q, k, v, None, causal_keep(5, 5))

    def test_grouped_query_attention(self):
        attn = make_attention(config=make_config(num_query_groups=2))
        q, k, v = sbhd_inputs(6, 6, groups=2)
        check_against_reference(attn, q, k, v, None, causal_keep(6, 6))

    def test_padding_mask(self):
        attn = make_attention(AttnMaskType.padding)
        q, k, v = sbhd_inputs(6, 6)
        mask = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
        mask[0, ..., 4:] = True  # the last two keys of sample 0 are padding
        check_against_reference(attn, q, k, v, mask, ~mask)

    def test_padding_without_mask_attends_everywhere(self):
        attn = make_attention(AttnMaskType.padding)
        q, k, v = sbhd_inputs(4, 5)
        check_against_reference(attn, q, k, v, None, None)

    def test_causal_with_mask_applies_both(self):
        attn = make_attention(AttnMaskType.causal)
        q, k, v = sbhd_inputs(6, 6)
        mask = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
        mask[1, ..., 0] = True
        check_against_reference(attn, q, k, v, mask, ~mask & causal_keep(6, 6))

    def test_padding_causal(self):
        attn = make_attention(AttnMaskType.padding_causal)
        q, k, v = sbhd_inputs(6, 6)
        mask = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
        mask[0, ..., 3:] = True
        check_against_reference(attn, q, k, v, mask, ~mask & causal_keep(6, 6))

    def test_no_mask_ignores_given_mask(self):
        attn = make_attention(AttnMaskType.no_mask)
        q, k, v = sbhd_inputs(5, 5)
        mask = torch.ones(2, 1, 5, 5, dtype=torch.bool)
        check_against_reference(attn, q, k, v, mask, None)

    def test_arbitrary_mask(self):
        attn = make_attention(AttnMaskType.arbitrary)
        q, k, v = sbhd_inputs(5, 5)
        gen = torch.Generator().manual_seed(3)
        mask = torch.rand(2, 1, 5, 5, generator=gen) < 0.4
        mask[..., 0] = False
        check_against_reference(attn, q, k, v, mask, ~mask)

    def test_fully_masked_rows_give_zeros(self):
        attn = make_attention(AttnMaskType.padding)
        q, k, v = sbhd_inputs(4, 4)
        mask = torch.zeros(2, 1, 4, 4, dtype=torch.bool)
        mask[0, :, 2, :] = True  # query 2 of sample 0 sees nothing
        out = attn(q, k, v, mask)
        assert torch.isfinite(out).all()
        assert (from_module(out, 4, 2)[0, :, 2] == 0).all()
        check_against_reference(attn, q, k, v, mask, ~mask)

    @pytest.mark.parametrize("sq,sk", [(3, 5), (5, 3), (1, 4)])
    def test_causal_bottom_right(self, sq, sk):
        attn = make_attention(AttnMaskType.causal_bottom_right)
        q, k, v = sbhd_inputs(sq, sk)
        check_against_reference(attn, q, k, v, None, causal_keep(sq, sk, bottom_right=True))

    def test_causal_top_left_rectangular(self):
        attn = make_attention(AttnMaskType.causal)
        q, k, v = sbhd_inputs(3, 5)
        check_against_reference(attn, q, k, v, None, causal_keep(3, 5))

    def test_mask_type_override_per_call(self):
        attn = make_attention(AttnMaskType.causal)
        q, k, v = sbhd_inputs(4, 4)
        check_against_reference(attn, q, k, v, None, None, mask_type=AttnMaskType.no_mask)

    def test_math_backend_matches(self):
        attn = make_attention(sdpa_backends=["math"])
        q, k, v = sbhd_inputs(6, 6)
        check_against_reference(attn, q, k, v, None, causal_keep(6, 6))


def thd_case(lengths, padded, heads=HEADS, dv=DV, dtype=torch.float64, device="cpu"):
    total = sum(padded)
    gen = torch.Generator().manual_seed(total)
    q = torch.randn(total, heads, DK, generator=gen, dtype=torch.float64)
    k = torch.randn(total, heads, DK, generator=gen, dtype=torch.float64)
    v = torch.randn(total, heads, dv, generator=gen, dtype=torch.float64)
    q, k, v = [x.to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v)]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32).to(device)
    cu_padded = torch.tensor([0] + padded).cumsum(0).to(torch.int32).to(device)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=None if padded == lengths else cu_padded,
        cu_seqlens_kv_padded=None if padded == lengths else cu_padded,
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
    )
    return q, k, v, params


def thd_reference(q, k, v, lengths, padded, scale, causal=True):
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    start = 0
    for length, plen in zip(lengths, padded):
        sl = slice(start, start + length)
        qs, ks, vs = (x[sl].transpose(0, 1)[None] for x in (q, k, v))
        keep = causal_keep(length, length) if causal else None
        out[sl] = reference(qs, ks, vs, keep, scale)[0].transpose(0, 1)
        start += plen
    return out


class TestPacked:
    @pytest.mark.parametrize(
        "lengths,padded", [([5, 3, 8], [5, 3, 8]), ([5, 2, 7], [8, 4, 8])], ids=["exact", "padded"]
    )
    @pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.padding_causal])
    def test_thd_matches_per_sequence_reference(self, lengths, padded, mask_type):
        attn = make_attention(mask_type)
        q, k, v, params = thd_case(lengths, padded)
        out = attn(q, k, v, None, packed_seq_params=params)
        assert out.shape == (sum(padded), HEADS * DV)
        ref = thd_reference(q, k, v, lengths, padded, attn.softmax_scale)
        torch.testing.assert_close(out.view_as(ref).double(), ref, atol=1e-10, rtol=1e-10)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), grad)
        want = torch.autograd.grad(ref, (q, k, v), grad.view_as(ref))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-9)
        # Padding tokens produce zeros and receive no gradient.
        start = 0
        for length, plen in zip(lengths, padded):
            pad = slice(start + length, start + plen)
            assert (out.view_as(ref)[pad] == 0).all()
            assert all((g[pad] == 0).all() for g in got)
            start += plen

    def test_thd_non_causal(self):
        attn = make_attention(AttnMaskType.padding)
        lengths = [4, 6]
        q, k, v, params = thd_case(lengths, lengths)
        out = attn(q, k, v, None, packed_seq_params=params)
        ref = thd_reference(q, k, v, lengths, lengths, attn.softmax_scale, causal=False)
        torch.testing.assert_close(out.view_as(ref), ref, atol=1e-10, rtol=1e-10)

    def test_thd_value_padded_to_query_width(self):
        # megatron-core 0.19 pads MLA's value to the query head size for thd; output follows it.
        attn = make_attention()
        q, k, v, params = thd_case([4, 4], [4, 4], dv=DK)
        out = attn(q, k, v, None, packed_seq_params=params)
        assert out.shape == (8, HEADS * DK)

    def test_thd_equals_sbhd_for_one_sequence(self):
        attn = make_attention()
        q, k, v, params = thd_case([6], [6])
        out_thd = attn(q, k, v, None, packed_seq_params=params)
        out_sbhd = attn(q[:, None], k[:, None], v[:, None], None)
        torch.testing.assert_close(out_thd, out_sbhd[:, 0], atol=0, rtol=0)


class TestDropout:
    def test_dropout_only_in_training(self):
        attn = make_attention(attention_dropout=0.5)
        q, k, v = sbhd_inputs(6, 6)
        attn.eval()
        check_against_reference(attn, q, k, v, None, causal_keep(6, 6))
        attn.train()
        torch.manual_seed(0)
        a = attn(q, k, v, None)
        torch.manual_seed(0)
        b = attn(q, k, v, None)
        torch.manual_seed(1)
        c = attn(q, k, v, None)
        torch.testing.assert_close(a, b, atol=0, rtol=0)
        assert not torch.equal(a, c)
        ref = reference(to_bhsd(q), to_bhsd(k), to_bhsd(v), causal_keep(6, 6), attn.softmax_scale)
        assert not torch.allclose(from_module(a, 6, 2).double(), ref)

    def test_dropout_from_config(self):
        assert make_attention(config=make_config(attention_dropout=0.25)).dropout_p == 0.25
        overridden = make_attention(
            config=make_config(attention_dropout=0.25), attention_dropout=0.0
        )
        assert overridden.dropout_p == 0.0


class TestErrors:
    def test_attention_bias_rejected(self):
        attn = make_attention()
        q, k, v = sbhd_inputs(3, 3)
        with pytest.raises(ValueError, match="attention_bias"):
            attn(q, k, v, None, attention_bias=torch.zeros(1))

    def test_context_parallel_needs_a_matching_group(self):
        # The session's parallel state has a context-parallel group of one rank.
        with pytest.raises(ValueError, match="cp group has 1 ranks"):
            make_attention(config=make_config(context_parallel_size=2))
        with pytest.raises(ValueError, match="self-attention only"):
            SDPADotProductAttention(
                make_config(context_parallel_size=2), 1, AttnMaskType.causal, "cross"
            )

    def test_softmax_type_rejected(self):
        with pytest.raises(ValueError, match="softmax_type"):
            make_attention(config=make_config(softmax_type="off-by-one"))

    def test_sliding_window_rejected(self):
        with pytest.raises(ValueError, match="sliding-window"):
            make_attention(config=make_config(window_size=(4, 0)))

    def test_mask_type_must_be_enum(self):
        with pytest.raises(TypeError, match="AttnMaskType"):
            make_attention("causal")

    def test_bad_dropout(self):
        with pytest.raises(ValueError, match="dropout"):
            make_attention(attention_dropout=1.5)

    def test_mask_dtype_and_rank(self):
        attn = make_attention(AttnMaskType.padding)
        q, k, v = sbhd_inputs(3, 3)
        with pytest.raises(TypeError, match="boolean"):
            attn(q, k, v, torch.zeros(2, 1, 1, 3))
        with pytest.raises(ValueError, match="4 dims"):
            attn(q, k, v, torch.zeros(2, 3, dtype=torch.bool))

    def test_arbitrary_needs_mask(self):
        attn = make_attention(AttnMaskType.arbitrary)
        q, k, v = sbhd_inputs(3, 3)
        with pytest.raises(ValueError, match="arbitrary"):
            attn(q, k, v, None)

    def test_shape_errors(self):
        attn = make_attention()
        q, k, v = sbhd_inputs(3, 3)
        with pytest.raises(ValueError, match="head sizes"):
            attn(q, k[..., :-1], v, None)
        with pytest.raises(ValueError, match="multiple"):
            attn(q[:, :, :3], k, v, None)
        with pytest.raises(ValueError, match="sbhd: "):
            attn(q[0], k[0], v[0], None)

    def test_thd_errors(self):
        attn = make_attention()
        q, k, v, params = thd_case([4, 4], [4, 4])
        with pytest.raises(ValueError, match="cu_seqlens"):
            attn(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))
        too_long = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=torch.tensor([0, 9], dtype=torch.int32),
            cu_seqlens_kv=torch.tensor([0, 9], dtype=torch.int32),
        )
        with pytest.raises(ValueError, match="covers 9 tokens"):
            attn(q, k, v, None, packed_seq_params=too_long)
        with pytest.raises(ValueError, match="arbitrary"):
            attn(q, k, v, None, attn_mask_type=AttnMaskType.arbitrary, packed_seq_params=params)

    def test_backend_names(self):
        from torch.nn.attention import SDPBackend

        assert resolve_sdpa_backends(None) is None
        assert resolve_sdpa_backends("math") == [SDPBackend.MATH]
        assert resolve_sdpa_backends(["efficient", SDPBackend.FLASH_ATTENTION]) == [
            SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.FLASH_ATTENTION,
        ]
        with pytest.raises(ValueError, match="unknown SDPA backend"):
            resolve_sdpa_backends(["fast"])
        with pytest.raises(ValueError, match="at least one"):
            resolve_sdpa_backends([])
        with pytest.raises(TypeError):
            resolve_sdpa_backends([3])


def test_building_it_patches_nothing():
    """Constructing the core attention writes nothing to megatron-core: the ``te_free_mla`` patch
    that MLA needs without Transformer Engine is applied where a spec is converted."""
    from megatron.core.transformer import multi_latent_attention as mcore_mla

    from megatron_ext import patches

    patches.undo_patches(patches.TE_FREE_MLA)
    te_linear = mcore_mla.TELinear
    make_attention(k_channels=8, v_channels=4)
    assert not any(patches.is_applied(extension) for extension in patches.EXTENSIONS)
    assert mcore_mla.TELinear is te_linear


# ----------------------------------------------------------------------------------------------
# Context parallelism: two gloo processes on CPU


class _OneRankGroup:
    def size(self):
        return 1

    def rank(self):
        return 0


def _local_rows(lengths_padded, cp, rank):
    """Indices of the packed tokens a context-parallel rank holds (each sequence split 2*cp)."""
    from megatron_ext.transformer.context_parallel import cp_chunk_positions

    rows, start = [], 0
    for plen in lengths_padded:
        rows.append(start + cp_chunk_positions(plen // cp, cp, rank))
        start += plen
    return torch.cat(rows)


def _cp_worker(rank, world, store_path):
    import datetime

    import torch.distributed as dist

    # A group of its own (the test process may already have a default one); a timeout so that a
    # broken collective fails the test instead of hanging it.
    cp_group = dist.ProcessGroupGloo(
        dist.FileStore(store_path, world), rank, world, datetime.timedelta(seconds=60)
    )
    pg = types.SimpleNamespace(tp=_OneRankGroup(), cp=cp_group)
    config = make_config(context_parallel_size=world)
    attn = SDPADotProductAttention(
        config, 1, AttnMaskType.causal, "self", k_channels=DK, v_channels=DV, pg_collection=pg
    )
    # sbhd: one sequence of 16 per sample.
    q, k, v = sbhd_inputs(16, 16)
    rows = _local_rows([16], world, rank)
    local = [x.detach()[rows].clone().requires_grad_() for x in (q, k, v)]
    out = attn(*local, None)
    grad_full = torch.randn(
        16, 2, HEADS * DV, generator=torch.Generator().manual_seed(5), dtype=torch.float64
    )
    out.backward(grad_full[rows])
    ref = reference(to_bhsd(q), to_bhsd(k), to_bhsd(v), causal_keep(16, 16), attn.softmax_scale)
    torch.testing.assert_close(from_module(out, 8, 2), ref[:, :, rows], atol=1e-10, rtol=0)
    want = torch.autograd.grad(ref, (q, k, v), from_module(grad_full, 16, 2))
    for got, w in zip(local, want):
        torch.testing.assert_close(got.grad, w[rows], atol=1e-10, rtol=0)

    # thd: three sequences, padded to multiples of 2*cp, one with padding.
    lengths, padded = [8, 5, 12], [8, 8, 12]
    q, k, v, params = thd_case(lengths, padded)
    rows = _local_rows(padded, world, rank)
    local = [x.detach()[rows].clone().requires_grad_() for x in (q, k, v)]
    out = attn(*local, None, packed_seq_params=params)
    assert out.shape == (len(rows), HEADS * DV)
    grad_full = torch.randn(
        sum(padded), HEADS * DV, dtype=torch.float64, generator=torch.Generator().manual_seed(6)
    )
    out.backward(grad_full[rows])
    ref = thd_reference(q, k, v, lengths, padded, attn.softmax_scale)
    torch.testing.assert_close(out.view(-1, HEADS, DV), ref[rows], atol=1e-10, rtol=0)
    want = torch.autograd.grad(ref, (q, k, v), grad_full.view_as(ref))
    for got, w in zip(local, want):
        torch.testing.assert_close(got.grad, w[rows], atol=1e-10, rtol=0)


def test_context_parallel_matches_full_attention(tmp_path):
    """Two CPU ranks (gloo), causal sbhd and padded thd: outputs and gradients of each rank's
    tokens equal full-sequence attention's."""
    import threading

    # The ranks are threads of this process: forking a process that has run torch ops can
    # deadlock the child (thread pools), and spawning re-imports torch and megatron per rank.
    errors = []

    def rank_main(rank):
        try:
            _cp_worker(rank, 2, str(tmp_path / "store"))
        except BaseException as exc:  # noqa: B036 - reported below
            errors.append((rank, exc))

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a context-parallel rank did not finish"
    if errors:
        raise errors[0][1]


# ----------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
class TestGPU:
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
    @pytest.mark.parametrize("backend", ["math", "efficient", None])
    def test_sbhd_close_to_float64(self, dtype, backend):
        attn = make_attention(sdpa_backends=None if backend is None else [backend]).cuda()
        q, k, v = sbhd_inputs(128, 128, dtype=dtype, device="cuda")
        out = attn(q, k, v, None)
        ref = reference(
            to_bhsd(q), to_bhsd(k), to_bhsd(v), causal_keep(128, 128).cuda(), attn.softmax_scale
        )
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(from_module(out, 128, 2).double(), ref, atol=tol, rtol=tol)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
    def test_thd_close_to_float64(self, dtype):
        attn = make_attention(sdpa_backends=["math"]).cuda()
        lengths, padded = [40, 17, 64], [48, 32, 64]
        q, k, v, params = thd_case(lengths, padded, dtype=dtype, device="cuda")
        out = attn(q, k, v, None, packed_seq_params=params)
        ref = thd_reference(q.cpu(), k.cpu(), v.cpu(), lengths, padded, attn.softmax_scale)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out.view_as(ref).double().cpu(), ref, atol=tol, rtol=tol)

    def test_math_backward_is_deterministic(self):
        attn = make_attention(sdpa_backends=["math"]).cuda()
        grads = []
        for _ in range(2):
            q, k, v = sbhd_inputs(256, 256, dtype=torch.bfloat16, device="cuda")
            out = attn(q, k, v, None)
            grads.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
        for a, b in zip(*grads):
            assert torch.equal(a, b)

    def test_matches_transformer_engine(self):
        pytest.importorskip("transformer_engine", reason="Transformer Engine is not installed")
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        config = make_config(bf16=True, params_dtype=torch.bfloat16)
        kwargs = dict(
            config=config,
            layer_number=1,
            attn_mask_type=AttnMaskType.causal,
            attention_type="self",
            k_channels=DK,
            v_channels=DV,
        )
        te_attn = TEDotProductAttention(**kwargs).cuda()
        ours = SDPADotProductAttention(**kwargs).cuda()
        q, k, v = sbhd_inputs(128, 128, dtype=torch.bfloat16, device="cuda")
        causal = dict(attn_mask_type=AttnMaskType.causal)  # required by TE's forward on 0.16
        torch.testing.assert_close(
            ours(q, k, v, None, **causal), te_attn(q, k, v, None, **causal), atol=2e-2, rtol=2e-2
        )
        lengths, padded = [40, 24, 64], [48, 32, 64]
        q, k, v, params = thd_case(lengths, padded, dtype=torch.bfloat16, device="cuda")
        kw = dict(packed_seq_params=params, attn_mask_type=AttnMaskType.padding_causal)
        a, b = ours(q, k, v, None, **kw), te_attn(q, k, v, None, **kw)
        start = 0
        for length, plen in zip(lengths, padded):
            # TE leaves padding tokens unspecified; compare the real ones.
            sl = slice(start, start + length)
            torch.testing.assert_close(a[sl], b.view_as(a)[sl], atol=2e-2, rtol=2e-2)
            start += plen
