# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

import torch

from megatron_ext.inference.contexts.static_slices_buffers import PackedBuffer, SliceTable


def test_packed_buffer_views_are_aligned_and_disjoint():
    fields = [("a", torch.bool, 3), ("b", torch.int64, 2), ("c", torch.float32, 5)]
    packed = PackedBuffer(fields, torch.device("cpu"))
    for name, dtype, numel in fields:
        view = packed[name]
        assert view.dtype == dtype and view.numel() == numel
        assert (view.data_ptr() - packed.buffer.data_ptr()) % 8 == 0
    packed["b"].fill_(-1)
    packed["c"].fill_(2.5)
    packed["a"].fill_(True)
    assert packed["b"].tolist() == [-1, -1] and packed["a"].all()
    assert packed["c"].tolist() == [2.5] * 5


def test_slice_table_copies_and_fills_rows_bit_for_bit():
    rows = 8
    dtypes = [torch.int32, torch.float32, torch.bool, torch.int64, torch.float64]
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(rows, generator=gen).mul(100).to(dtype) for dtype in dtypes]
    statics = [torch.zeros(rows, dtype=dtype) for dtype in dtypes]
    templates = [torch.full((rows,), 7, dtype=dtype) for dtype in dtypes]
    table = SliceTable(statics, templates)
    table.copy_rows(sources, start=3, count=4)
    for source, static in zip(sources, statics):
        assert torch.equal(static[:4], source[3:7])
        assert not static[4:].any()
    table.fill_rows(2, 6)
    for source, static, template in zip(sources, statics, templates):
        assert torch.equal(static[:2], source[3:5])
        assert torch.equal(static[2:6], template[2:6])
    # Statics past the given sources (computed fields) are left alone.
    before = statics[-1].clone()
    table.copy_rows(sources[:-1], start=0, count=rows)
    assert torch.equal(statics[-1], before)
