# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""``as_int`` refusing tensors; ``prompt_token_ids``: the range check it can leave out (no host
read), what it never leaves out (the integrality of floating ids it converts), meta tensors."""

import numpy as np
import pytest
import torch

from megatron_ext.inference.contexts.request_checks import as_int, prompt_token_ids


def test_integer_ids_unchecked_when_asked_and_checked_by_default():
    ids = torch.tensor([3, -1], dtype=torch.int32)
    assert prompt_token_ids("ids", ids, check_values=False).tolist() == [3, -1]
    assert prompt_token_ids("ids", ids, check_values=False).dtype == torch.int64
    with pytest.raises(ValueError, match=r"ids\[1\] is -1"):
        prompt_token_ids("ids", ids)
    with pytest.raises(ValueError, match=r"ids\[0\] is 3: .*\[0, 3\)"):
        prompt_token_ids("ids", ids, vocab_size=3)


def test_floating_ids_are_always_checked_before_they_are_converted():
    with pytest.raises(ValueError, match=r"ids\[1\] is 2\.5: .*integral"):
        prompt_token_ids("ids", torch.tensor([1.0, 2.5]), check_values=False)
    assert prompt_token_ids("ids", torch.tensor([1.0, 2.0]), check_values=False).tolist() == [1, 2]
    with pytest.raises(ValueError, match="empty"):
        prompt_token_ids("ids", torch.tensor([], dtype=torch.int64), check_values=False)


@pytest.mark.parametrize(
    "value", [torch.tensor(3), torch.tensor([3]), torch.tensor(3, dtype=torch.int32)]
)
def test_a_tensor_is_no_int(value):
    """A tensor of one integer converts to an index but hashes by identity (the engine keys its
    requests by id); numpy integers are ints."""
    with pytest.raises(TypeError, match=r"request_id must be an int, got Tensor"):
        as_int("request_id", value)
    assert as_int("request_id", np.int64(3)) == 3 and type(as_int("n", np.int32(3))) is int


def test_a_meta_tensor_holds_no_ids():
    with pytest.raises(TypeError, match="ids is a meta tensor"):
        prompt_token_ids("ids", torch.tensor([3, 4], device="meta"))
