# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""pytest plugin: one ``MASTER_PORT`` per pytest-xdist worker.

megatron-core's test utilities bind a single-rank process group on ``MASTER_PORT``; workers of one
run sharing it would collide. Each worker takes the run's port plus one plus its index. Used by
``scripts/run_megatron_core_tests.py --workers``.
"""

import os


def pytest_configure(config):
    """Give this worker its own port before any test initialises torch.distributed."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw"):
        base = int(os.environ.get("MASTER_PORT", "29500"))
        os.environ["MASTER_PORT"] = str(base + 1 + int(worker[2:]))
