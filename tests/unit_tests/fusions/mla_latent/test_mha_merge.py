# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of the MHA form's merge of partial attentions (megatron_ext.fusions.mla_latent.mha_merge):
the torch merge's edge cases, and the merge kernel against a float64 merge, writing only its
tokens' rows (guard rows around them), for consecutive and indexed tokens, strided partials and
rows no earlier call wrote. Without a GPU the kernel runs in the Triton interpreter
(tests/conftest.py); tests marked ``gpu`` run it compiled, as the MHA form does on CUDA.
"""

import math

import pytest
import torch

from megatron_ext.fusions.mla_latent import mha_merge
from megatron_ext.fusions.mla_latent.mha_merge import merge_partials, merge_partials_into
from tests.unit_tests.fusions.mla_latent.mha_testlib import float64_merge

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda") if ON_GPU else torch.device("cpu")
GUARD = 1234.5


def test_merge_of_queries_without_keys():
    """Both sides -inf (no keys in either): zeros and -inf, no NaN; one side -inf: the other."""
    out_a, out_b = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    none = torch.full((3, 2), -math.inf)
    lse_b = torch.randn(3, 2)
    merged, lse = merge_partials(out_a, none, out_b, none)
    assert torch.equal(merged, torch.zeros_like(merged)) and torch.equal(lse, none)
    merged, lse = merge_partials(out_a, none, out_b, lse_b)
    assert torch.equal(merged, out_b) and torch.equal(lse, lse_b)


def _case(used, heads, v, count, dtype, seed):
    """An accumulator with guard rows before and after it, some rows never written (-inf, their
    values garbage the kernel must not read), a partial with -inf rows, and the call's tokens."""
    gen = torch.Generator().manual_seed(seed)
    acc_buffer = torch.full((used + 2, heads, v), GUARD)
    acc_buffer[1:-1] = torch.randn(used, heads, v, generator=gen)
    lse_buffer = torch.full((used + 2, heads), GUARD)
    lse_buffer[1:-1] = torch.randn(used, heads, generator=gen) * 4
    fresh = torch.rand(used, heads, generator=gen) < 0.3
    lse_buffer[1:-1][fresh] = -math.inf
    acc_buffer[1:-1][fresh] = math.nan  # never read: a row no call wrote
    # The partial as a strided view (wider rows, as a padded backend returns them).
    part = torch.randn(count, heads, v + 8, generator=gen).to(dtype)[:, :, :v]
    part_lse = (torch.randn(heads, count, generator=gen) * 4).t()  # [count, heads], strided
    part_lse[torch.rand(count, heads, generator=gen) < 0.2] = -math.inf
    tensors = (acc_buffer, lse_buffer, part, part_lse)
    return [t.to(DEVICE) for t in tensors]


def _tokens(kind, used, count, seed):
    if kind == "slice":
        return slice(used - count - 1, used - 1)
    order = torch.randperm(used, generator=torch.Generator().manual_seed(seed))[:count]
    return order.to(torch.int32 if kind == "int32" else torch.int64).to(DEVICE)


@pytest.fixture
def kernel_everywhere(monkeypatch):
    """The kernel on this machine's device (the interpreter's on CPU), as on CUDA."""
    if not ON_GPU:
        monkeypatch.setattr(mha_merge, "_kernel_takes", lambda *a: True)


@pytest.mark.parametrize("tokens_kind", ["slice", "int32", "int64"])
@pytest.mark.parametrize(
    "heads, v", [(1, 128), (3, 20), (16, 128), (5, 512)], ids=["1x128", "3x20", "16x128", "5x512"]
)
def test_kernel_matches_float64_and_writes_only_its_tokens(
    kernel_everywhere, tokens_kind, heads, v
):
    used, count = 37, 11
    dtypes = [torch.float32] + ([torch.bfloat16] if ON_GPU else [torch.float16])
    for dtype in dtypes:
        acc_buffer, lse_buffer, part, part_lse = _case(used, heads, v, count, dtype, v)
        acc, acc_lse = acc_buffer[1:-1], lse_buffer[1:-1]
        tokens = _tokens(tokens_kind, used, count, heads)
        before, lse_before = acc_buffer.clone(), lse_buffer.clone()
        want, want_lse = float64_merge(acc[tokens], acc_lse[tokens], part, part_lse)
        merge_partials_into(acc, acc_lse, part, part_lse, tokens)
        torch.testing.assert_close(acc[tokens].double(), want, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(acc_lse[tokens].double(), want_lse, rtol=2e-6, atol=2e-6)
        # Every other row, the guards included, keeps its bits (NaN rows too).
        written = torch.zeros(used + 2, dtype=torch.bool, device=DEVICE)
        written[1:-1][tokens] = True
        assert torch.equal(
            acc_buffer[~written].view(torch.int32), before[~written].view(torch.int32)
        ), "the kernel wrote outside its tokens' accumulator rows"
        assert torch.equal(
            lse_buffer[~written].view(torch.int32), lse_before[~written].view(torch.int32)
        ), "the kernel wrote outside its tokens' log-sum-exps"


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_a_last_merge_writes_the_answers_and_leaves_the_accumulator(monkeypatch, path):
    """With ``out`` the merged rows go to the result in its dtype (the accumulator's cast), the
    accumulator and every other row of the result untouched; rows no call wrote are not read
    (NaN there) on either path."""
    if path == "kernel" and not ON_GPU:
        monkeypatch.setattr(mha_merge, "_kernel_takes", lambda *a: True)
    if path == "torch":
        monkeypatch.setattr(mha_merge, "_kernel_takes", lambda *a: False)
    used, heads, v, count = 21, 4, 64, 9
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    acc_buffer, lse_buffer, part, part_lse = _case(used, heads, v, count, dtype, 17)
    acc, acc_lse = acc_buffer[1:-1], lse_buffer[1:-1]
    tokens = _tokens("int64", used, count, 4)
    out_buffer = torch.full((used + 4, heads, v), GUARD, dtype=dtype, device=DEVICE)
    out = out_buffer[1:-1]  # [used + 2, ...]: more rows than the accumulator, as a padded step's
    before, lse_before, out_before = acc_buffer.clone(), lse_buffer.clone(), out_buffer.clone()
    want, _ = float64_merge(acc[tokens], acc_lse[tokens], part, part_lse)
    merge_partials_into(acc, acc_lse, part, part_lse, tokens, out)
    # Within one rounding to the result's dtype of the float64 merge.
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    torch.testing.assert_close(out[tokens].double(), want, rtol=ulp, atol=1e-6)
    assert out[tokens].dtype == dtype
    assert torch.equal(acc_buffer.nan_to_num(), before.nan_to_num()), "the accumulator moved"
    assert torch.equal(lse_buffer, lse_before), "the log-sum-exps moved"
    written = torch.zeros(used + 4, dtype=torch.bool, device=DEVICE)
    written[1:-1][tokens] = True
    assert torch.equal(out_buffer[~written], out_before[~written]), "a row outside its tokens"


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_a_first_calls_output_as_the_accumulator_gives_the_merged_bits(monkeypatch, path):
    """A 16-bit first call's output and strided log-sum-exps read as the accumulator by a merge
    that writes the result: the bits of merging it into an empty fp32 accumulator first; the
    16-bit output is left as it was, and a merge that would write it is refused."""
    if path == "kernel" and not ON_GPU:
        monkeypatch.setattr(mha_merge, "_kernel_takes", lambda *a: True)
    if path == "torch":
        monkeypatch.setattr(mha_merge, "_kernel_takes", lambda *a: False)
    used, heads, v = 19, 4, 64
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    _, _, first, first_lse = _case(used, heads, v, used, dtype, 3)
    _, _, second, second_lse = _case(used, heads, v, used, dtype, 5)
    everything = slice(0, used)
    acc = torch.empty(used, heads, v, device=DEVICE)
    acc_lse = torch.full((used, heads), -math.inf, device=DEVICE)
    merge_partials_into(acc, acc_lse, first, first_lse, everything)
    want = torch.zeros(used, heads, v, dtype=dtype, device=DEVICE)
    merge_partials_into(acc, acc_lse, second, second_lse, everything, want)
    got = torch.zeros_like(want)
    first_before = first.clone()
    merge_partials_into(first, first_lse, second, second_lse, everything, got)
    assert torch.equal(got, want), "the first call's output as the accumulator moved the bits"
    assert torch.equal(first, first_before), "the first call's output was written"
    with pytest.raises(TypeError, match="acc must be float32 or float64"):
        merge_partials_into(first, first_lse.clone(), second, second_lse, everything)


def test_the_kernel_and_torch_merge_agree_and_both_sides_empty_give_zeros(kernel_everywhere):
    """Rows with no keys on either side: zeros and -inf (no NaN); the kernel's merge within fp32
    rounding of the torch merge's everywhere."""
    heads, v, used = 4, 64, 9
    gen = torch.Generator().manual_seed(3)
    acc = torch.zeros(used, heads, v)
    acc_lse = torch.full((used, heads), -math.inf)
    part = torch.randn(used, heads, v, generator=gen)
    part_lse = torch.randn(used, heads, generator=gen)
    part_lse[2:4] = -math.inf
    acc, acc_lse, part, part_lse = (t.to(DEVICE) for t in (acc, acc_lse, part, part_lse))
    torch_acc, torch_lse = merge_partials(acc, acc_lse, part, part_lse)
    merge_partials_into(acc, acc_lse, part, part_lse, slice(0, used))
    assert not acc[2:4].any() and (acc_lse[2:4] == -math.inf).all()
    torch.testing.assert_close(acc, torch_acc, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(acc_lse, torch_lse, rtol=1e-6, atol=1e-6)
    # A second partial over the same rows: the merge of three, as the torch merge gives it.
    again = torch.randn(used, heads, v, generator=gen).to(DEVICE)
    again_lse = torch.randn(used, heads, generator=gen).to(DEVICE)
    torch_acc, torch_lse = merge_partials(torch_acc, torch_lse, again, again_lse)
    merge_partials_into(acc, acc_lse, again, again_lse, slice(0, used))
    torch.testing.assert_close(acc, torch_acc, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(acc_lse, torch_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "change, message",
    [
        ("part_heads", "must be \\[used, heads, v\\]"),
        ("part_lse", "part_lse must be"),
        ("slice", "consecutive rows"),
        ("index", "tokens must have shape \\(3,\\)"),
        ("strided index", "tokens must be contiguous"),
        ("out over part", "out overlaps part"),
        ("out", "out must be"),
        ("index_dtype", "tokens must have dtype int32, int64"),
        ("device", "part is on meta"),
    ],
)
def test_mismatched_shapes_are_refused_before_any_write(change, message):
    acc, acc_lse = torch.zeros(8, 2, 4), torch.full((8, 2), -math.inf)
    part, part_lse, tokens = torch.ones(3, 2, 4), torch.zeros(3, 2), slice(0, 3)
    if change == "part_heads":
        part = torch.ones(3, 3, 4)
    elif change == "part_lse":
        part_lse = torch.zeros(3, 1)
    elif change == "slice":
        tokens = slice(0, 4)
    elif change == "index":
        tokens = torch.arange(4)
    elif change == "strided index":
        tokens = torch.arange(6)[::2]
    elif change == "index_dtype":
        tokens = torch.arange(3, dtype=torch.float32)
    elif change == "device":
        part = torch.ones(3, 2, 4, device="meta")
    out = torch.zeros(7 if change == "out" else 8, 2, 4)
    if change == "out over part":
        part = out[5:]  # the partial's rows lie in the result's
    error = TypeError if change == "index_dtype" else ValueError
    with pytest.raises(error, match=message):
        merge_partials_into(acc, acc_lse, part, part_lse, tokens, out)
    assert not out.any()
    assert not acc.any() and (acc_lse == -math.inf).all()


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_a_written_tensor_sharing_memory_is_refused_on_every_call(monkeypatch, path):
    """An accumulator that shares memory with the partial, on a layout the kernel has already
    launched for (its cached plan) as on a first call and on the torch path: refused, nothing
    written."""
    if path == "kernel" and not ON_GPU:
        monkeypatch.setattr(mha_merge, "_kernel_takes", lambda *a: True)
    if path == "torch":
        monkeypatch.setattr(mha_merge, "_kernel_takes", lambda *a: False)
    used, heads, v = 6, 2, 8
    storage = torch.zeros(2 * used, heads, v, device=DEVICE)
    lse = torch.full((used, heads), -math.inf, device=DEVICE)
    part_lse = torch.zeros(used, heads, device=DEVICE)
    apart = storage[:used], storage[used:]
    merge_partials_into(apart[0], lse, apart[1].clone(), part_lse, slice(0, used))
    merge_partials_into(apart[0], lse, apart[1].clone(), part_lse, slice(0, used))
    before = storage.clone()
    shared = storage[used:]  # the same layout as the accumulator: the partial lies on it
    with pytest.raises(ValueError, match="acc overlaps part"):
        merge_partials_into(shared, lse.clone(), shared, part_lse, slice(0, used))
    assert torch.equal(storage, before)


@pytest.mark.gpu
def test_gpu_the_merge_runs_the_kernel_and_replays_from_a_graph(monkeypatch):
    """On CUDA with an fp32 accumulator the kernel merges (not the torch path), and a CUDA
    graph's replay of it gives the eager call's bits."""
    monkeypatch.setattr(mha_merge, "merge_partials", None)  # the torch path would fail
    acc_buffer, lse_buffer, part, part_lse = _case(64, 16, 128, 32, torch.bfloat16, 5)
    tokens = torch.arange(10, 42, device=DEVICE, dtype=torch.int32)
    acc, acc_lse = acc_buffer[1:-1].clone(), lse_buffer[1:-1].clone()
    eager, eager_lse = acc.clone(), acc_lse.clone()
    merge_partials_into(eager, eager_lse, part, part_lse, tokens)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        merge_partials_into(acc.clone(), acc_lse.clone(), part, part_lse, tokens)  # warm up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        merge_partials_into(acc, acc_lse, part, part_lse, tokens)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(acc.nan_to_num(), eager.nan_to_num()), "graph replay moved the bits"
    assert torch.equal(acc_lse, eager_lse)
