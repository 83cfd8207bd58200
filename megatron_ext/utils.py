# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Helpers shared across megatron_ext: the megatron-core version gate, quiet CLIs."""

import ast
import importlib.util
import os
import sys
from typing import Optional

from packaging.version import Version

from megatron_ext.package_info import MAX_MCORE_VERSION_EXCLUSIVE, MIN_MCORE_VERSION


class UnsupportedMegatronCoreVersionError(ImportError):
    """Raised when the installed megatron-core release is outside the supported range."""


def _version_from_package_info(path: str) -> Version:
    """MAJOR.MINOR.PATCH + PRE_RELEASE (or ``__version__``), read as literals: the file runs git
    when executed (0.19)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    fields = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    fields[target.id] = node.value.value
    if all(name in fields for name in ("MAJOR", "MINOR", "PATCH")):
        pre = fields.get("PRE_RELEASE", "")
        return Version(f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}{pre}")
    if isinstance(fields.get("__version__"), str):
        return Version(fields["__version__"])
    raise UnsupportedMegatronCoreVersionError(
        f"cannot read megatron-core's version from {path}: no MAJOR/MINOR/PATCH constants"
    )


def get_megatron_core_version() -> Version:
    """Return the version of the megatron-core that ``import megatron.core`` would load.

    Read from ``megatron/core/package_info.py`` without importing ``megatron.core``, whose
    ``__init__`` pulls in most of the library (that keeps ``import megatron_ext`` light).

    Returns:
        Version: the installed release.

    Raises:
        UnsupportedMegatronCoreVersionError: if megatron-core is not installed.
    """
    loaded = sys.modules.get("megatron.core.package_info")
    if loaded is not None:
        return Version(loaded.__version__)
    spec = importlib.util.find_spec("megatron")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(root, "core", "package_info.py")
        if os.path.isfile(path):
            return _version_from_package_info(path)
    raise UnsupportedMegatronCoreVersionError(
        "megatron_ext needs megatron-core "
        f">={MIN_MCORE_VERSION},<{MAX_MCORE_VERSION_EXCLUSIVE}; it is not installed"
    )


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


# megatron-core warns at import, once per module, that optional Transformer Engine / Apex (and,
# from 0.19, absl.logging) are missing; megatron_ext works without them, so its command-line
# tools hide these (and only these).
OPTIONAL_DEPENDENCY_WARNING = (
    r".*(Transformer Engine|Apex|absl\.logging)( and Apex)? (is|are) not installed.*"
)


def ignore_optional_dependency_warnings() -> None:
    """Hide megatron-core's "Transformer Engine / Apex / absl.logging not installed" warnings
    (for CLIs: call it in a ``warnings.catch_warnings()`` block or a script's ``__main__``, not
    in library code)."""
    import warnings

    warnings.filterwarnings("ignore", message=OPTIONAL_DEPENDENCY_WARNING, category=UserWarning)
