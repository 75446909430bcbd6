"""The binding builds against the libfabric ``pkg-config`` names (a site
install such as an EFA installer's prefix), with its library dir as rpath."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from types import ModuleType

import pytest

BUILD = Path(__file__).resolve().parents[2] / "native" / "build_fabric.py"


def build_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_fabric_under_test", BUILD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_site_libfabric_from_pkg_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if shutil.which("pkg-config") is None:
        pytest.skip("pkg-config is not installed (deploy/setup.sh installs it)")
    prefix = tmp_path / "opt" / "efa"
    pcdir = prefix / "lib64" / "pkgconfig"
    pcdir.mkdir(parents=True)
    (pcdir / "libfabric.pc").write_text(
        f"prefix={prefix}\nlibdir=${{prefix}}/lib64\nincludedir=${{prefix}}/include\n"
        "Name: libfabric\nDescription: site libfabric\nVersion: 1.22.0\n"
        "Libs: -L${libdir} -lfabric\nCflags: -I${includedir}\n")
    monkeypatch.setenv("PKG_CONFIG_PATH", str(pcdir))
    mod = build_module()
    assert [str(prefix / "include")] == mod.SITE_INCLUDE
    assert [str(prefix / "lib64")] == mod.SITE_LIB
    kw = mod.ffibuilder._assigned_source[3]
    assert str(prefix / "include") in kw["include_dirs"]
    assert kw["runtime_library_dirs"] == [str(prefix / "lib64")]


def test_no_libfabric_pc_keeps_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PKG_CONFIG_PATH", str(tmp_path))
    monkeypatch.setenv("PKG_CONFIG_LIBDIR", str(tmp_path))  # hide the system's .pc too
    mod = build_module()
    assert mod.site_libfabric() == ([], [])
    assert mod.ffibuilder._assigned_source[3]["include_dirs"] == ["native/src"]
