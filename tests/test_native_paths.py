"""Native code loaded from a path runs in every server process: SGLANG_EXL3_KERNEL_LIB, SGLANG_EXL3_EXT_PATH and
the kernel build cache are accepted only if absolute, a regular file (or folder) with no symlink in any component,
not group- or world-writable, in a folder that is not world-writable; each refusal names the rule."""

from __future__ import annotations

import os

import pytest

from sglang_exl3 import knobs
from sglang_exl3.knobs import KnobError
from sglang_exl3.native_paths import UnsafeNativePath, check_native_path


@pytest.fixture
def safe(tmp_path):
    """A folder only its owner can write, holding a library file and an extension folder."""
    root = tmp_path / "safe"
    root.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    lib = root / "libexl3_trellis.so"
    lib.write_bytes(b"\x7fELF")
    lib.chmod(0o644)
    ext = root / "ext"
    ext.mkdir(mode=0o755)
    return root, lib, ext


def test_safe_paths_are_accepted(safe):
    root, lib, ext = safe
    assert check_native_path(str(lib), "X", "file") == str(lib)
    assert check_native_path(str(ext), "X", "dir") == str(ext)
    assert check_native_path(str(ext), "X", "file_or_dir") == str(ext)
    values = knobs.validate_all({"SGLANG_EXL3_KERNEL_LIB": str(lib), "SGLANG_EXL3_EXT_PATH": str(ext)})
    assert values["KERNEL_LIB"] == str(lib) and values["EXT_PATH"] == str(ext)


def _rule(safe, case):
    root, lib, ext = safe
    if case == "relative":
        return os.path.relpath(lib), "it is not an absolute path"
    if case == "dotdot":
        return f"{root}/ext/../{lib.name}", "it is not in normal form"
    if case == "missing":
        return str(root / "nope.so"), "it cannot be read"
    if case == "symlink":
        link = root / "link.so"
        link.symlink_to(lib)
        return str(link), "a component of it is a symbolic link"
    if case == "symlinked folder":
        (root / "linkdir").symlink_to(root)
        return str(root / "linkdir" / lib.name), "a component of it is a symbolic link"
    if case == "folder":
        return str(ext), "it is not a regular file"
    if case == "fifo":
        os.mkfifo(root / "fifo.so")
        return str(root / "fifo.so"), "it is not a regular file"
    if case == "group-writable":
        lib.chmod(0o664)
        return str(lib), "it is group- or world-writable (mode 0o664)"
    if case == "world-writable":
        lib.chmod(0o646)
        return str(lib), "it is group- or world-writable (mode 0o646)"
    if case == "world-writable folder":
        root.chmod(0o777)
        return str(lib), f"its folder {root} is world-writable"
    raise AssertionError(case)


CASES = ["relative", "dotdot", "missing", "symlink", "symlinked folder", "folder", "fifo", "group-writable",
         "world-writable", "world-writable folder"]


@pytest.mark.parametrize("case", CASES)
def test_kernel_lib_refusals_name_the_rule(safe, case, monkeypatch):
    path, rule = _rule(safe, case)
    monkeypatch.chdir(safe[0].parent)
    with pytest.raises(KnobError) as info:
        knobs.validate_all({"SGLANG_EXL3_KERNEL_LIB": path})
    assert f"SGLANG_EXL3_KERNEL_LIB={path!r} is refused: {rule}" in str(info.value)
    assert "(fix: " in str(info.value)


def test_ext_path_takes_a_folder_and_refuses_a_writable_one(safe):
    _, _, ext = safe
    ext.chmod(0o777)
    with pytest.raises(KnobError, match=r"SGLANG_EXL3_EXT_PATH=.* is refused: it is group- or world-writable"):
        knobs.validate_all({"SGLANG_EXL3_EXT_PATH": str(ext)})


def test_check_is_the_same_for_files_and_folders(safe):
    _, lib, ext = safe
    with pytest.raises(UnsafeNativePath, match="it is not a directory"):
        check_native_path(str(lib), "X", "dir")


def test_build_cache_must_be_private(tmp_path, monkeypatch):
    """The per-user cache that `auto` loads and writes: a world-writable XDG_CACHE_HOME is refused before anything
    is built or loaded, and a cached library that others could have written is refused."""
    from sglang_exl3.kernels import library
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o777)
    cache.chmod(0o777)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.delenv("SGLANG_EXL3_KERNEL_LIB", raising=False)
    with pytest.raises(library.KernelLibraryUnavailable, match="kernel build cache.*is refused: its folder .* is "
                                                         "world-writable.*XDG_CACHE_HOME"):
        library.build_cached_library("90")
    cache.chmod(0o755)
    lib = library.cache_path("90")
    lib.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    lib.write_bytes(b"\x7fELF")
    lib.chmod(0o666)
    with pytest.raises(library.KernelLibraryUnavailable, match="is refused: it is group- or world-writable"):
        library.build_cached_library("90")
    monkeypatch.setattr(library, "arch_tag", lambda arch: "90")
    with pytest.raises(library.KernelLibraryUnavailable, match="is refused: it is group- or world-writable"):
        library.library_path()
