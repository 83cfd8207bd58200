# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The tests here share the MLA RoPE test helpers of the folder above (mla_rope_testlib)."""

import sys
from pathlib import Path

_FUSIONS_TESTS = str(Path(__file__).resolve().parents[1])
if _FUSIONS_TESTS not in sys.path:
    sys.path.insert(0, _FUSIONS_TESTS)
