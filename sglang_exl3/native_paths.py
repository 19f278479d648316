"""Which native code a server may load from a path: the kernel library (`SGLANG_EXL3_KERNEL_LIB`), exllamav3's
extension (`SGLANG_EXL3_EXT_PATH`) and the per-user kernel build cache.

Code loaded from these paths runs inside every server process, so a path is accepted only if nobody but its owner
could have put something there: it is absolute, it is a regular file or a directory (as asked), no component of it
is a symbolic link, it is not group- or world-writable, and its parent is not world-writable. Anything else is
refused, naming the rule it broke (the reference implementation's F31 rules).
"""

from __future__ import annotations

import os
import stat


class UnsafeNativePath(ValueError):
    """A native-code path that breaks one of the rules; the message names the path, the rule and the fix."""


def check_native_path(path: str, what: str, kind: str) -> str:
    """Return `path` if it may be loaded, else raise UnsafeNativePath. `kind`: "file", "dir" or "file_or_dir"."""
    def refuse(rule: str, fix: str) -> UnsafeNativePath:
        return UnsafeNativePath(f"{what}={path!r} is refused: {rule} (fix: {fix})")

    if not os.path.isabs(path):
        raise refuse("it is not an absolute path", "give the absolute path")
    if os.path.normpath(path) != path.rstrip("/") and path != "/":
        raise refuse("it is not in normal form ('..', '.', or repeated '/')", "give the plain absolute path")
    try:
        st = os.lstat(path)
    except OSError as e:
        raise refuse(f"it cannot be read ({e.strerror})", "point it at an existing file or folder") from None
    real = os.path.realpath(path)
    if real != os.path.normpath(path):
        raise refuse(f"a component of it is a symbolic link (it resolves to {real!r})", f"use {real!r} itself")
    want_file, want_dir = kind in ("file", "file_or_dir"), kind in ("dir", "file_or_dir")
    if not ((want_file and stat.S_ISREG(st.st_mode)) or (want_dir and stat.S_ISDIR(st.st_mode))):
        expected = {"file": "a regular file", "dir": "a directory", "file_or_dir": "a regular file or a directory"}
        raise refuse(f"it is not {expected[kind]}", f"point it at {expected[kind]}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise refuse(f"it is group- or world-writable (mode {stat.S_IMODE(st.st_mode):#o})", f"chmod go-w {path}")
    parent = os.path.dirname(path.rstrip("/")) or "/"
    if os.stat(parent).st_mode & stat.S_IWOTH:
        raise refuse(f"its folder {parent} is world-writable, so another user could replace it",
                     "keep it in a folder only its owner can write")
    return path
