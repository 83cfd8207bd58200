# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of the tensor checks every kernel of megatron_ext.fusions shares
(megatron_ext.fusions.tensor_checks). The kernels' own refusals are tested with them."""

import pytest
import torch

from megatron_ext.fusions import tensor_checks


def test_overlap_is_found_between_memory_ranges():
    buffer = torch.zeros(100)
    assert tensor_checks.overlaps(buffer[:50], buffer[49:])
    assert not tensor_checks.overlaps(buffer[:50], buffer[50:])
    assert not tensor_checks.overlaps(torch.zeros(10), torch.zeros(10))
    assert not tensor_checks.overlaps(buffer[:0], buffer)  # nothing to overlap
    rows = buffer.view(10, 10)
    # Column slices of the same rows interleave: their spans intersect, which is refused.
    assert tensor_checks.overlaps(rows[:, :5], rows[:, 5:])


def test_disjoint_check_names_the_input():
    buffer = torch.zeros(64)
    with pytest.raises(ValueError, match="out overlaps second"):
        tensor_checks.check_disjoint(
            "out", buffer[:8], [("first", buffer[8:16]), ("second", buffer[4:])]
        )
    tensor_checks.check_disjoint("out", buffer[:8], [("first", buffer[8:16])])


def test_outputs_whose_elements_share_memory_are_refused():
    with pytest.raises(ValueError, match="share memory"):
        tensor_checks.check_no_self_overlap("out", torch.zeros(1, 4).expand(3, 4))
    tensor_checks.check_no_self_overlap("out", torch.zeros(3, 8)[:, :4])  # a strided view is fine


def test_index_vectors_must_be_contiguous_int_vectors_of_the_token_count():
    tensor_checks.check_index_vector(
        "idx", torch.zeros(4, dtype=torch.int32), 4, torch.device("cpu")
    )
    with pytest.raises(TypeError, match="idx must have dtype"):
        tensor_checks.check_index_vector("idx", torch.zeros(4), 4, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"idx must have shape \(4,\)"):
        tensor_checks.check_index_vector(
            "idx", torch.zeros(5, dtype=torch.long), 4, torch.device("cpu")
        )


def _aliases(count: int = 64):
    """Two tensors over one bytearray through two storage objects (``torch.frombuffer`` twice):
    the same memory, other storages."""
    memory = bytearray(4 * count)
    first = torch.frombuffer(memory, dtype=torch.float32)
    second = torch.frombuffer(memory, dtype=torch.float32)
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert first.untyped_storage() is not second.untyped_storage()
    return first, second


def test_tensors_of_two_storages_over_one_memory_overlap():
    """Two storage objects over one memory: their views overlap where their ranges do."""
    first, second = _aliases()
    assert tensor_checks.overlaps(first[:8], second[4:12])
    assert not tensor_checks.overlaps(first[:8], second[8:16])
    with pytest.raises(ValueError, match="out overlaps values"):
        tensor_checks.check_disjoint("out", first[:8], [("values", second[7:])])
    tensor_checks.check_disjoint("out", first[:8], [("values", second[8:])])


def test_a_second_storage_over_the_middle_of_a_buffer_overlaps_it():
    """A storage whose base pointer lies inside another's (an import of part of a buffer): the
    storages' base pointers differ, which the check once took for separate allocations."""
    memory = bytearray(4 * 64)
    whole = torch.frombuffer(memory, dtype=torch.float32)
    middle = torch.frombuffer(memory, dtype=torch.float32, offset=4 * 16, count=16)
    assert whole.untyped_storage().data_ptr() != middle.untyped_storage().data_ptr()
    assert tensor_checks.overlaps(whole[10:20], middle)
    assert not tensor_checks.overlaps(whole[:16], middle)


def test_cpu_tensors_are_refused_outside_the_interpreter(monkeypatch):
    monkeypatch.setattr(tensor_checks, "INTERPRETED", False)
    with pytest.raises(ValueError, match="f: x is on the CPU.*TRITON_INTERPRET=1") as err:
        tensor_checks.check_runnable("f", "x", torch.zeros(1))
    assert ".cuda()" in str(err.value)
    with pytest.raises(ValueError, match="f: x is on meta.*CUDA devices"):
        tensor_checks.check_runnable("f", "x", torch.zeros(1, device="meta"))


def test_spans_meet_reads_the_layouts_spans():
    """The per-call test of a cached layout: the spans measured once, the pointers each call."""
    first, second = _aliases()
    tensors = (first[:8], second[4:12], None, first[:0])
    spans = tuple(tensor_checks.span_bytes(x) for x in tensors)
    assert spans == (32, 32, 0, 0)
    assert tensor_checks.spans_meet(tensors, spans, 0)
    apart = (first[:8], second[8:16], None, first[:0])
    assert not tensor_checks.spans_meet(apart, spans, 0)
    assert not tensor_checks.spans_meet(tensors, spans, 3)  # an empty output meets nothing
    strided = torch.zeros(4, 8)[:, :2]
    assert tensor_checks.span_bytes(strided) == (3 * 8 + 2) * 4
