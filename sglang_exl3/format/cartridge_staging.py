"""Stage a cartridge (seeds.md F27): read its manifest and copy every listed shard into a private directory,
hashing while copying, so that what a server later loads is exactly what was verified -- whatever happens to the
source afterwards. Everything here runs before the server pauses; a bad cartridge stops here naming the file and
the rule, and nothing live has changed.

Rules: the adapter path must exist without a symlink anywhere on it; it is a directory holding
`adapter_config.json`, or one listed shard file beside it. Manifest and shards are opened without following links
and must be regular files (no FIFOs or devices); each shard's size and SHA-256 must be the manifest's, and the file
must not change (device, inode, size, mtime, ctime) while it is copied. A deadline bounds the whole copy.

Format layer: no torch, no SGLang.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from sglang_exl3.format.cartridge_index import CartridgeIndex, index_cartridge
from sglang_exl3.format.cartridge_manifest import MANIFEST_NAME, CartridgeError, decode_manifest, parse_manifest

MAX_MANIFEST_BYTES = 16 << 20
COPY_CHUNK = 8 << 20
STAGING_DEADLINE_S = 15 * 60
PREFIX = "sglang-exl3-cartridge-"


@dataclass
class StagedCartridge:
    """A verified private copy: the index of its tensors and the directory that holds them (removed by discard)."""

    source: Path
    index: CartridgeIndex
    files: list[Path]
    _dir: tempfile.TemporaryDirectory = field(repr=False)

    @property
    def manifest(self):
        return self.index.manifest

    def discard(self) -> None:
        self._dir.cleanup()


def _no_links(path: Path) -> Path:
    if not os.path.lexists(path):
        raise CartridgeError(f"cartridge path {path} does not exist")
    if path.absolute() != path.resolve():
        raise CartridgeError(f"cartridge path {path} is or passes through a symlink; pass the real path")
    return path.absolute()


def _open_regular(path: Path, what: str) -> tuple[int, os.stat_result]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise CartridgeError(f"{what} {path} cannot be opened without following links ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CartridgeError(f"{what} {path} must be a regular file")
    return fd, st


def _identity(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def read_manifest(adapter_dir: Path) -> bytes:
    path = adapter_dir / MANIFEST_NAME
    if not os.path.lexists(path):
        raise CartridgeError(f"{adapter_dir} holds no {MANIFEST_NAME} (the fq-cartridge-adapter/3 manifest)")
    fd, st = _open_regular(path, "cartridge manifest")
    try:
        if st.st_size > MAX_MANIFEST_BYTES:
            raise CartridgeError(f"cartridge manifest {path} is {st.st_size} bytes, more than 16 MiB")
        raw = os.read(fd, MAX_MANIFEST_BYTES + 1)
        if len(raw) != st.st_size or _identity(os.fstat(fd)) != _identity(st):
            raise CartridgeError(f"cartridge manifest {path} changed while it was read")
        return raw
    finally:
        os.close(fd)


def resolve_adapter(path: str | Path) -> tuple[Path, str | None]:
    """(the adapter directory, the shard file named if a file was passed)."""
    p = _no_links(Path(path))
    mode = os.lstat(p).st_mode
    if stat.S_ISDIR(mode):
        return p, None
    if stat.S_ISREG(mode):
        return p.parent, p.name
    raise CartridgeError(f"cartridge path {p} must be a directory or regular file")


def _copy_shard(src: Path, dst: Path, size: int, sha256: str, deadline: float) -> None:
    fd, st = _open_regular(src, "cartridge shard")
    try:
        if st.st_size != size:
            raise CartridgeError(f"cartridge shard {src.name} is {st.st_size} bytes, its manifest says {size}")
        digest, copied = hashlib.sha256(), 0
        with open(dst, "xb") as out:
            while chunk := os.read(fd, COPY_CHUNK):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"staging the cartridge passed its {STAGING_DEADLINE_S} s deadline at "
                                       f"{src.name}")
                digest.update(chunk)
                out.write(chunk)
                copied += len(chunk)
        if copied != size or _identity(os.fstat(fd)) != _identity(st):
            raise CartridgeError(f"cartridge shard {src.name} changed while it was copied")
        if digest.hexdigest() != sha256:
            raise CartridgeError(f"cartridge shard {src.name}: SHA-256 {digest.hexdigest()} does not match its "
                                 f"manifest's {sha256} (tampered or damaged; copy the cartridge again)")
    finally:
        os.close(fd)


def stage_cartridge(path: str | Path, runtime_tp: int | None = None,
                    deadline_s: float = STAGING_DEADLINE_S) -> StagedCartridge:
    """Validate the manifest, copy and verify every shard into a private directory, index the copies."""
    adapter_dir, named = resolve_adapter(path)
    manifest = parse_manifest(decode_manifest(read_manifest(adapter_dir), str(adapter_dir / MANIFEST_NAME)),
                              runtime_tp, str(adapter_dir / MANIFEST_NAME))
    if named is not None and named != MANIFEST_NAME and named not in {s.path for s in manifest.shards}:
        raise CartridgeError(f"{adapter_dir / named} is not a shard listed by {adapter_dir / MANIFEST_NAME}")
    private = tempfile.TemporaryDirectory(prefix=PREFIX)
    try:
        deadline, files = time.monotonic() + deadline_s, []
        for i, shard in enumerate(manifest.shards):
            src = adapter_dir / shard.path
            if not os.path.lexists(src):
                raise CartridgeError(f"cartridge shard {shard.path} listed by the manifest is missing")
            if src.absolute() != src.resolve() or adapter_dir not in src.resolve().parents:
                raise CartridgeError(f"cartridge shard {shard.path} is a symlink or leaves the adapter directory")
            dst = Path(private.name) / f"{i:06d}.safetensors"
            _copy_shard(src, dst, shard.size, shard.sha256, deadline)
            files.append(dst)
        return StagedCartridge(adapter_dir, index_cartridge(manifest, files), files, private)
    except BaseException:
        private.cleanup()
        raise
