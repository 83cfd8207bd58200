# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

import os
import subprocess
import sys
import textwrap

import pytest
from packaging.version import Version

from megatron_ext.utils import (
    UnsupportedMegatronCoreVersionError,
    check_megatron_core_version,
    get_megatron_core_version,
    is_megatron_core_min_version,
)


@pytest.mark.parametrize("version", ["0.16.1", "0.17.0", "0.19.2", "0.19.99"])
def test_supported_versions_pass(version):
    assert check_megatron_core_version(Version(version)) == Version(version)


@pytest.mark.parametrize("version", ["0.15.3", "0.16.0", "0.16.1rc0", "0.20.0", "1.0.0"])
def test_unsupported_versions_fail_with_a_clear_message(version):
    with pytest.raises(UnsupportedMegatronCoreVersionError, match=f"found megatron-core {version}"):
        check_megatron_core_version(Version(version))


def test_installed_version_is_reported():
    from megatron.core import package_info

    import megatron_ext

    assert megatron_ext.MEGATRON_CORE_VERSION == Version(package_info.__version__)
    assert get_megatron_core_version() == Version(package_info.__version__)
    assert is_megatron_core_min_version("0.16.1")
    assert not is_megatron_core_min_version("99.0")


def test_import_fails_early_on_an_unsupported_release(tmp_path):
    # A stand-in megatron-core 0.15.0 shadows the installed one: importing megatron_ext must
    # refuse it before anything else is defined.
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    (core / "package_info.py").write_text("__version__ = '0.15.0'\n")
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import megatron_ext
        """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "UnsupportedMegatronCoreVersionError" in proc.stderr
    assert "found megatron-core 0.15.0" in proc.stderr


def test_package_exposes_the_readme_entry_points_lazily():
    # In a fresh interpreter: importing the package must not import the argument layer or the
    # kernels; touching an entry point imports it and gives the very object of its module.
    code = textwrap.dedent("""
        import sys
        import megatron_ext
        lazy = ("megatron_ext.arguments", "megatron_ext.fusions.fused_mla_yarn_rope_apply")
        assert not any(name in sys.modules for name in lazy), [n for n in lazy if n in sys.modules]
        from megatron_ext import arguments
        from megatron_ext.fusions import fused_mla_yarn_rope_apply as kernels
        for name in ("apply_megatron_ext", "undo_megatron_ext", "applied_megatron_ext",
                     "add_megatron_ext_args", "MegatronExtConfigError"):
            assert getattr(megatron_ext, name) is getattr(arguments, name), name
        for name in ("fused_apply_mla_rope_for_q", "fused_apply_mla_rope_for_kv"):
            assert getattr(megatron_ext, name) is getattr(kernels, name), name
        assert set(megatron_ext.__all__) <= set(dir(megatron_ext))
        try:
            megatron_ext.no_such_entry_point
        except AttributeError as exc:
            assert "no_such_entry_point" in str(exc)
        else:
            raise AssertionError("unknown attributes must raise AttributeError")
        print("ok")
        """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


def test_cli_filter_hides_only_megatron_cores_optional_dependency_warnings():
    import warnings

    from megatron_ext.utils import ignore_optional_dependency_warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ignore_optional_dependency_warnings()
        for message in (
            "Transformer Engine and Apex are not installed. Falling back to Torch.",
            "Apex is not installed. Falling back to Torch Norm",
            "absl.logging is not installed. Using logging.getLogger(__name__) instead.",
            "a real problem",
        ):
            warnings.warn(message, UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["a real problem"]
