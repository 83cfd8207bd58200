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


def test_a_pickled_copy_views_its_own_buffer():
    """pickle copies views apart from the tensor they view; the copy's views are its buffer's."""
    import pickle

    packed = PackedBuffer([("a", torch.int64, 3), ("b", torch.uint8, 5)], torch.device("cpu"))
    packed["a"].copy_(torch.tensor([7, 8, 9]))
    copy = pickle.loads(pickle.dumps(packed))
    assert copy["a"].tolist() == [7, 8, 9]
    copy["b"].fill_(4)
    copy["a"][0] = -1
    assert copy.buffer.view(torch.uint8)[24:29].tolist() == [4] * 5
    assert copy.buffer[:8].view(torch.int64).tolist() == [-1]
    assert packed["a"].tolist() == [7, 8, 9]  # the original is untouched
