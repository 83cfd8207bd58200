# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Helpers shared across megatron_ext: the megatron-core version gate."""

from typing import Optional

from packaging.version import Version

from megatron_ext.package_info import MAX_MCORE_VERSION_EXCLUSIVE, MIN_MCORE_VERSION


class UnsupportedMegatronCoreVersionError(ImportError):
    """Raised when the installed megatron-core release is outside the supported range."""


def get_megatron_core_version() -> Version:
    """Return the installed megatron-core version.

    Returns:
        Version: the version read from ``megatron.core.package_info``.

    Raises:
        UnsupportedMegatronCoreVersionError: if megatron-core is not installed.
    """
    try:
        from megatron.core import package_info
    except ImportError as exc:  # pragma: no cover - exercised only without megatron-core
        raise UnsupportedMegatronCoreVersionError(
            "megatron_ext needs megatron-core "
            f">={MIN_MCORE_VERSION},<{MAX_MCORE_VERSION_EXCLUSIVE}; it is not installed"
        ) from exc
    return Version(package_info.__version__)


def check_megatron_core_version(version: Optional[Version] = None) -> Version:
    """Refuse megatron-core releases that megatron_ext is not built and tested for.

    The extension classes subclass megatron-core internals that change between releases, so an
    untested release fails here, at import, instead of misbehaving later.

    Args:
        version: the version to check; the installed one when None.

    Returns:
        Version: the checked version.

    Raises:
        UnsupportedMegatronCoreVersionError: if the version is outside the supported range.
    """
    if version is None:
        version = get_megatron_core_version()
    low, high = Version(MIN_MCORE_VERSION), Version(MAX_MCORE_VERSION_EXCLUSIVE)
    if not low <= version < high:
        raise UnsupportedMegatronCoreVersionError(
            f"megatron_ext supports megatron-core >={low},<{high}; found megatron-core {version}. "
            "Install a supported release (pip install 'megatron-core>=0.16.1,<0.20')."
        )
    return version


def is_megatron_core_min_version(minimum: str) -> bool:
    """Whether the installed megatron-core is at least ``minimum``.

    Args:
        minimum: a version string such as ``"0.19.0"``.

    Returns:
        bool: True if the installed release is ``minimum`` or newer.
    """
    return get_megatron_core_version() >= Version(minimum)
