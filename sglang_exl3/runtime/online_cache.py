"""The persistent cache of online EXL3 encodings (the reference's F22 rules, shared/reference/seeds.md §1.7): encoding
a BF16 linear takes a Viterbi search per tile, so a server that loads the same model again reads the result back
instead. Cached payloads become weights, so the cache is strict about what it returns:

- an entry is found by the SHA-256 of its key, the canonical JSON of every input that changes the result (model and
  encoder identity, module, bits, codebook, seed, TP world size and rank, shapes, source dtype), and its metadata must
  repeat that key exactly; its tensors must be exactly {trellis int16 [in/16, out/16, 16K], suh fp16 [in], svh fp16
  [out]}, finite; anything else is corrupt: re-encoded and replaced (read-only: re-encoded, not replaced);
- entries are published atomically (a temporary file in the same folder, fsync, rename) under a file lock;
- modes: `readwrite` (default), `readonly` (a miss is encoded, never published), `off` (neither read nor written);
  a read or write that fails with an OSError encodes without the cache, with a warning;
- an encoding with non-finite scales is rejected and retried once, then the error names the module;
- the cache folder must not be writable by group or others (it is created 0700);
- a hit never calls the encoder.

A local model's identity hashes its small metadata files and, per weight file, name, size, mtime, inode and ctime:
a file replaced in place keeps neither its inode nor its ctime (rename, copy, or an mtime set back with `touch`
all change them), which is how stale reuse is detected without hashing every weight. A hub model needs a resolved
commit: a branch name is refused (its files can change under it).

Runtime layer: torch and safetensors, no SGLang.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
SCHEMA = 1
MODES = ("off", "readonly", "readwrite")
KEY_FIELDS = ("schema", "model_identity", "encoder_identity", "module", "bits", "codebook", "seed", "tp_world_size",
              "tp_rank", "input_size", "output_size", "source_dtype")
METADATA_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "quantization_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
SMALL_FILE_BYTES = 16 << 20
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class OnlineCacheError(ValueError):
    """The cache cannot be used as configured; the message names the setting or path and the fix."""


class NonFiniteEncoding(RuntimeError):
    pass


def resolve_mode(text: str | None) -> str:
    """The cache mode, one spelling per value (unset: readwrite), as SGLANG_EXL3_ONLINE_CACHE takes it."""
    mode = (text or "readwrite").strip().lower()
    if mode not in MODES:
        raise OnlineCacheError(f"online cache mode {text!r} is not one of {', '.join(MODES)}")
    return mode


def canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def cache_key(**fields) -> dict:
    """The key of one encoding; every field of KEY_FIELDS is required (schema is filled in)."""
    key = {"schema": SCHEMA, **fields}
    missing, unknown = sorted(set(KEY_FIELDS) - set(key)), sorted(set(key) - set(KEY_FIELDS))
    if missing or unknown:
        raise OnlineCacheError(f"online cache key: missing {missing}, unknown {unknown}")
    return key


def _file_record(path: Path) -> list:
    st = path.stat()
    record = [path.name, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]
    if st.st_size <= SMALL_FILE_BYTES:
        record.append(hashlib.sha256(path.read_bytes()).hexdigest())
    return record


def local_model_identity(model_dir: str | Path) -> str:
    """SHA-256 over the metadata files' bytes and every weight file's record (see the module docstring)."""
    root = Path(model_dir).resolve()
    digest = hashlib.sha256()
    for name in METADATA_FILES:
        if (root / name).is_file():
            digest.update(canonical([name, hashlib.sha256((root / name).read_bytes()).hexdigest()]).encode())
    weights = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not weights:
        raise OnlineCacheError(f"{root} holds no weight files (*.safetensors, *.bin, *.gguf)")
    for p in weights:
        digest.update(canonical(_file_record(p)).encode())
    return digest.hexdigest()


def model_identity(model: str | Path, revision: str | None = None) -> str:
    """A local folder's identity, or a hub model's {id, resolved commit}."""
    if Path(model).is_dir():
        return local_model_identity(model)
    if revision is None or not _COMMIT.match(revision):
        raise OnlineCacheError(f"online cache: {model} is not a local folder and its revision {revision!r} is not a "
                               "resolved commit; pass the commit hash (--revision) or turn the cache off")
    return hashlib.sha256(canonical({"hub": str(model), "revision": revision}).encode()).hexdigest()


def encoder_identity() -> str:
    """SHA-256 of the encoder's own sources: a change to how tiles are encoded invalidates every entry."""
    from sglang_exl3 import codec

    digest = hashlib.sha256()
    for name in ("encode.py", "trellis.py", "codebook.py", "hadamard.py"):
        digest.update((Path(codec.__file__).parent / name).read_bytes())
    return digest.hexdigest()


def _check_private(folder: Path) -> None:
    mode = folder.stat().st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise OnlineCacheError(f"online cache folder {folder} is writable by group or others (mode "
                               f"{stat.S_IMODE(mode):o}); cached encodings become weights: chmod go-w it, or use "
                               "another folder")


def _valid(tensors: dict, key: dict) -> bool:
    if set(tensors) != {"trellis", "suh", "svh"}:
        return False
    t, suh, svh = tensors["trellis"], tensors["suh"], tensors["svh"]
    k, n = key["input_size"], key["output_size"]
    return (t.dtype == torch.int16 and tuple(t.shape) == (k // 16, n // 16, 16 * key["bits"])
            and suh.dtype == svh.dtype == torch.float16 and tuple(suh.shape) == (k,) and tuple(svh.shape) == (n,)
            and bool(torch.isfinite(suh).all()) and bool(torch.isfinite(svh).all()))


class OnlineCache:
    def __init__(self, root: str | Path, mode: str = "readwrite"):
        self.root, self.mode = Path(root), resolve_mode(mode)
        if self.mode != "off":
            if self.root.exists():
                _check_private(self.root)
            elif self.mode == "readwrite":
                self.root.mkdir(parents=True, mode=0o700)

    def path(self, key: dict) -> Path:
        digest = hashlib.sha256(canonical(key).encode()).hexdigest()
        return (self.root / f"v{SCHEMA}" / key["model_identity"][:20] /
                f"tp{key['tp_world_size']}-rank{key['tp_rank']}" / f"{digest}.safetensors")

    def load(self, key: dict) -> dict[str, torch.Tensor] | None:
        """A valid entry, or None (absent, or corrupt: logged)."""
        from safetensors import SafetensorError, safe_open

        path = self.path(key)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                stored = (f.metadata() or {}).get("cache_key")
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (SafetensorError, OSError, ValueError) as e:
            logger.warning("online EXL3 cache entry %s is unreadable (%s): encoding again", path, e)
            return None
        if stored != canonical(key) or not _valid(tensors, key):
            logger.warning("online EXL3 cache entry %s does not match its key or shapes: encoding again", path)
            return None
        return tensors

    def publish(self, key: dict, tensors: dict[str, torch.Tensor], proxy_error: float) -> None:
        from filelock import FileLock
        from safetensors.torch import save_file

        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with FileLock(str(path) + ".lock"):
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
            os.close(fd)
            try:
                save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp,
                          metadata={"cache_key": canonical(key), "proxy_error": repr(float(proxy_error))})
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)

    def get_or_encode(self, key: dict, encode: Callable[[], tuple[dict[str, torch.Tensor], float]]
                      ) -> tuple[dict[str, torch.Tensor], str]:
        """(tensors, "hit" | "encoded" | "encoded, not published"). `encode()` returns (tensors, proxy error)."""
        if self.mode != "off":
            hit = self.load(key)  # an unreadable entry is logged there and encoded again
            if hit is not None:
                return hit, "hit"
        tensors, proxy_error = _encode_finite(key, encode)
        if self.mode != "readwrite":
            return tensors, "encoded" if self.mode == "off" else "encoded, not published"
        try:
            self.publish(key, tensors, proxy_error)
        except OSError as e:
            logger.warning("online EXL3 cache not written (%s): serving the fresh encoding", e)
            return tensors, "encoded, not published"
        return tensors, "encoded"


def _encode_finite(key: dict, encode) -> tuple[dict[str, torch.Tensor], float]:
    for attempt in range(2):
        tensors, proxy_error = encode()
        if _valid(tensors, key):
            return tensors, proxy_error
        logger.warning("online EXL3 encoding of %s is not finite or not of its shapes (attempt %d of 2)",
                       key["module"], attempt + 1)
    raise NonFiniteEncoding(f"online EXL3 encoding of {key['module']} gave non-finite scales or wrong shapes twice")
