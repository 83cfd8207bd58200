# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of the fused top-k candidate draw (megatron_ext.fusions.fused_top_k_sampling).

Without a GPU the kernel runs in the Triton interpreter (tests/conftest.py) in fp32 and fp16 (the
interpreter's bf16 arithmetic is broken); tests marked ``gpu`` add bf16, the direct launch and
CUDA-graph replay.
"""

import pytest
import torch

from megatron_ext.fusions import direct_launch
from megatron_ext.fusions import fused_top_k_sampling as fused
from megatron_ext.fusions.fused_top_k_sampling import MAX_FUSED_CAP, sample_top_k_candidates

GUARD = -777
ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda") if ON_GPU else torch.device("cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])


def _case(rows, cap, dtype, seed, vocab=None):
    """Inputs as the region makes them: the top ``cap`` of random logits, Exp(1) draws."""
    gen = torch.Generator().manual_seed(seed)
    vocab = vocab or 4 * cap
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    values, indices = torch.topk(logits, cap, dim=-1)
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.05
    top_k = torch.randint(1, cap + 1, (rows,), generator=gen, dtype=torch.int32)
    noise = torch.empty(rows, cap).exponential_(1.0, generator=gen)
    return [t.to(DEVICE) for t in (values, indices, temperature, top_k, noise)]


def _reference(values, indices, temperature, top_k, noise):
    """The draw in float64, and each row's relative margin between its two best races."""
    v = values.double().cpu()
    cap = v.shape[1]
    k = top_k.long().cpu().clamp(1, cap)
    kth = v.gather(1, (k - 1).unsqueeze(1))
    scores = (v / temperature.double().cpu().unsqueeze(1)).masked_fill(v < kth, float("-inf"))
    race = scores.softmax(-1) / noise.double().cpu().clamp(min=torch.finfo(torch.float32).tiny)
    best = race.topk(min(2, cap), dim=-1).values
    margin = (best[:, 0] - best[:, -1]) / best[:, 0] if cap > 1 else torch.ones(len(v))
    return indices.cpu().gather(1, race.argmax(-1, keepdim=True)).squeeze(1), margin


def _guarded_out(rows):
    buffer = torch.full((rows + 8,), GUARD, dtype=torch.int64, device=DEVICE)
    return buffer, buffer[4 : 4 + rows]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,cap", [(1, 2), (7, 4), (64, 32), (33, 50), (5, 256)])
def test_draw_matches_a_float64_race_and_writes_only_its_rows(rows, cap, dtype):
    values, indices, temperature, top_k, noise = _case(rows, cap, dtype, seed=rows * cap)
    buffer, out = _guarded_out(rows)
    returned = sample_top_k_candidates(values, indices, temperature, top_k, noise, out=out)
    assert returned.data_ptr() == out.data_ptr()
    expected, margin = _reference(values, indices, temperature, top_k, noise)
    clear = margin > 1e-4  # rows whose two best races are not within rounding of each other
    assert clear.float().mean() > 0.9
    assert torch.equal(out.cpu()[clear], expected[clear])
    assert (buffer[:4] == GUARD).all() and (buffer[4 + rows :] == GUARD).all()


def test_candidates_tied_with_the_kth_stay_and_those_below_it_never_win():
    values = torch.tensor([[5.0, 4.0, 4.0, 4.0, 1.0, 1.0, 0.0, -1.0]], device=DEVICE)
    indices = torch.arange(100, 108, device=DEVICE).unsqueeze(0)
    temperature = torch.ones(1, device=DEVICE)
    # top_k 0 and 99 are clamped to 1 and the cap; 2 and 4 keep the three 4.0s, 5 both 1.0s.
    for top_k, kept in ((2, 4), (4, 4), (5, 6), (1, 1), (0, 1), (99, 8)):
        for small in range(8):
            # One tiny draw makes its candidate win wherever the candidate is kept.
            noise = torch.ones(1, 8, device=DEVICE)
            noise[0, small] = 1e-30
            k = torch.tensor([top_k], dtype=torch.int32, device=DEVICE)
            token = int(sample_top_k_candidates(values, indices, temperature, k, noise)[0])
            assert token == 100 + (small if small < kept else 0), (top_k, small)


def test_a_zero_draw_picks_a_kept_candidate_not_a_filtered_one():
    values = torch.tensor([[2.0, 1.0, 0.5, 0.1]], device=DEVICE)
    indices = torch.tensor([[7, 8, 9, 10]], device=DEVICE)
    noise = torch.tensor([[1.0, 0.0, 0.0, 0.0]], device=DEVICE)
    top_k = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    token = sample_top_k_candidates(values, indices, torch.ones(1, device=DEVICE), top_k, noise)
    # Both zeros race as the smallest float32; the kept one (index 1) beats the filtered ones.
    assert int(token[0]) == 8


def test_draws_follow_the_tempered_softmax_of_the_kept_candidates():
    rows, cap = (20000 if ON_GPU else 2000), 8  # the interpreter runs one program at a time
    values = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0]).expand(rows, cap)
    values = values.contiguous().to(DEVICE)
    indices = torch.arange(cap, device=DEVICE).expand(rows, cap).contiguous()
    temperature = torch.full((rows,), 0.7, device=DEVICE)
    top_k = torch.full((rows,), 5, dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(11)
    noise = torch.empty(rows, cap).exponential_(1.0, generator=gen).to(DEVICE)
    tokens = sample_top_k_candidates(values, indices, temperature, top_k, noise).cpu()
    counts = torch.bincount(tokens, minlength=cap).double()
    expected = torch.zeros(cap, dtype=torch.float64)
    expected[:5] = (values[0, :5].double().cpu() / 0.7).softmax(-1)
    assert counts[5:].sum() == 0
    # Each frequency within five standard deviations of its binomial expectation.
    sd = (rows * expected * (1 - expected)).sqrt()
    assert ((counts - rows * expected).abs() <= 5 * sd + 1e-9).all(), (counts, rows * expected)


def test_rows_without_finite_scores_read_only_their_own_candidates():
    """A NaN or +inf candidate, or all -inf, races NaN in every lane, the masked lanes past the
    cap included (cap 5, block 8): the token read must still be one of the row's candidates, not
    one past them (the next row's, or past the end: the guard values). The region reports such
    rows and never uses their token."""
    rows, cap = 4, 5
    values = torch.randn(rows, cap, generator=torch.Generator().manual_seed(3))
    values = values.sort(dim=-1, descending=True).values
    values[0, 0] = float("nan")
    values[1, 0] = float("inf")
    values[2] = float("-inf")
    storage = torch.full((rows * cap + 16,), GUARD, dtype=torch.int64, device=DEVICE)
    indices = storage[: rows * cap].view(rows, cap)
    indices.copy_(torch.arange(rows * cap, device=DEVICE).view(rows, cap) * 10)
    buffer, out = _guarded_out(rows)
    sample_top_k_candidates(
        values.to(DEVICE),
        indices,
        torch.ones(rows, device=DEVICE),
        torch.full((rows,), cap, dtype=torch.int32, device=DEVICE),
        torch.ones(rows, cap, device=DEVICE),
        out=out,
    )
    for row, token in enumerate(out.tolist()):
        assert token in indices[row].tolist(), (row, token)
    assert (buffer[:4] == GUARD).all() and (buffer[4 + rows :] == GUARD).all()


def test_no_rows_is_no_launch():
    values, indices, temperature, top_k, noise = _case(3, 4, torch.float32, seed=1)
    out = sample_top_k_candidates(values[:0], indices[:0], temperature[:0], top_k[:0], noise[:0])
    assert out.shape == (0,) and out.dtype == torch.int64


def _bad_inputs():
    values, indices, temperature, top_k, noise = _case(4, 8, torch.float32, seed=2)
    good = dict(values=values, indices=indices, temperature=temperature, top_k=top_k, noise=noise)
    wide = torch.zeros(4, MAX_FUSED_CAP + 1, device=DEVICE)
    yield "values list", dict(good, values=values.tolist()), TypeError, "values must be a Tensor"
    yield "indices shape", dict(good, indices=indices[:, :4]), ValueError, "alike"
    yield "noise shape", dict(good, noise=noise[:3]), ValueError, "alike"
    yield "top_k shape", dict(good, top_k=top_k[:3]), ValueError, "top_k must have shape"
    yield "int values", dict(good, values=values.long()), TypeError, "values must be float32"
    yield "int32 indices", dict(good, indices=indices.int()), TypeError, "indices must be"
    yield "fp16 noise", dict(good, noise=noise.half()), TypeError, "noise must be"
    yield "float top_k", dict(good, top_k=top_k.float()), TypeError, "top_k must be int32"
    yield "fp64 temperature", dict(good, temperature=temperature.double()), TypeError, "temper"
    yield "strided values", dict(good, values=values.t().contiguous().t()), ValueError, "last"
    yield "strided top_k", dict(
        good, top_k=torch.zeros(8, dtype=torch.int32, device=DEVICE)[::2]
    ), ValueError, "top_k must be contiguous"
    yield "too many candidates", dict(
        good,
        values=wide,
        indices=wide.long(),
        noise=wide,
    ), ValueError, "candidate count"
    # Without out: the error names the inputs' shapes, not the out the function would allocate.
    yield "1-d values, no out", dict(
        good, values=values[0], indices=indices[0], noise=noise[0]
    ), ValueError, "alike"
    yield "3-d values, no out", dict(
        good, values=values[None], indices=indices[None], noise=noise[None]
    ), ValueError, "alike"
    yield "out inside indices", dict(good, out=indices[0, :4]), ValueError, "out overlaps indices"
    yield "out dtype", dict(good, out=torch.zeros(4, dtype=torch.int32, device=DEVICE)), (
        TypeError
    ), "out must be"


@pytest.mark.parametrize("case", list(_bad_inputs()), ids=lambda case: case[0])
def test_bad_input_is_refused_before_any_launch(case, monkeypatch):
    _, kwargs, error, match = case
    launches = []
    monkeypatch.setattr(fused, "_LAUNCHES", _Recorder(launches, fused._LAUNCHES))
    with pytest.raises(error, match=match):
        sample_top_k_candidates(**kwargs)
    assert launches == []


class _Recorder:
    """Stands in for the kernel's launches: records each grid (there must be none)."""

    def __init__(self, launches, kernel_launches):
        self.launches, self.kernel_launches = launches, kernel_launches

    def __call__(self, grid, *args, **kwargs):
        self.launches.append(grid)
        return self.kernel_launches(grid, *args, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="CUDA-graph replay and the direct launch need a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_direct_launches_and_graph_replays_equal_the_jit_launch_bitwise(dtype):
    values, indices, temperature, top_k, noise = _case(256, 32, dtype, seed=5, vocab=32000)
    fused._LAUNCHES.launches.clear()
    fused._PLANS.clear()  # plans hold the launches they bound
    first = sample_top_k_candidates(values, indices, temperature, top_k, noise)  # JIT, binds
    if direct_launch.ENABLED:
        assert any(fused._LAUNCHES.launches.values()), "the direct launch was not bound"
    buffer, out = _guarded_out(256)
    sample_top_k_candidates(values, indices, temperature, top_k, noise, out=out)  # direct
    assert torch.equal(out, first)
    graph_buffer, graph_out = _guarded_out(256)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sample_top_k_candidates(values, indices, temperature, top_k, noise, out=graph_out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    graph_out.fill_(GUARD)
    with torch.cuda.graph(graph):
        sample_top_k_candidates(values, indices, temperature, top_k, noise, out=graph_out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, first)
    for b in (buffer, graph_buffer):
        assert (b[:4] == GUARD).all() and (b[-4:] == GUARD).all()
