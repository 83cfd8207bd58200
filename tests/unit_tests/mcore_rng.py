# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""megatron-core's inference RNG tracker for a block of a test, the process-wide one put back
afterwards (tests that run later in the same process keep their seeds)."""

import contextlib
from typing import Iterator


@contextlib.contextmanager
def inference_rng_tracker() -> Iterator[None]:
    """megatron-core's inference RNG tracker (the one its CUDA graphs accept) for the block.

    Yields:
        None: inside the block the inference tracker is megatron-core's process-wide tracker.
    """
    from megatron.core.tensor_parallel import random as mcore_random

    saved = (mcore_random._CUDA_RNG_STATE_TRACKER, mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    try:
        yield
    finally:
        mcore_random._CUDA_RNG_STATE_TRACKER, mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = (
            saved
        )
