# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""megatron_ext: extensions for NVIDIA Megatron-Core."""

from megatron_ext.package_info import __version__
from megatron_ext.utils import check_megatron_core_version

# Fail at import on an untested megatron-core, before any extension class is defined on top of
# internals that may have changed.
MEGATRON_CORE_VERSION = check_megatron_core_version()

__all__ = ["__version__", "MEGATRON_CORE_VERSION"]
