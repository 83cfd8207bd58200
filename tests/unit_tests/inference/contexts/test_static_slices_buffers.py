# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

import torch

from megatron_ext.inference.contexts.static_slices_buffers import PackedBuffer


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
