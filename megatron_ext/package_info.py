# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Version of megatron_ext and the megatron-core releases it supports."""

MAJOR = 0
MINOR = 1
PATCH = 0
PRE_RELEASE = ""

VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)

__shortversion__ = '.'.join(map(str, VERSION[:3]))
__version__ = '.'.join(map(str, VERSION[:3])) + ''.join(VERSION[3:])
__package_name__ = 'megatron_ext'
__description__ = (
    'Extensions for NVIDIA Megatron-Core: contiguous-load MLA RoPE kernels and static active '
    'slices for CUDA-graphed dynamic inference'
)

# The half-open range of megatron-core releases this package is tested against. Anything
# outside it is refused at import (see megatron_ext.utils.check_megatron_core_version).
MIN_MCORE_VERSION = '0.16.1'
MAX_MCORE_VERSION_EXCLUSIVE = '0.20.0'
