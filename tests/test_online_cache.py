"""The online EXL3 encoding cache (runtime/online_cache.py) against the reference's rules (seeds.md F22, the
test_exl3_online_cache.py list of §6). The cache stores whatever an encoding returns; these tests hand it the
tensors of a seeded random EXL3 linear (the real encoder takes ~6 s for the smallest 128x128 module on the CPU and
is tested on its own in test_encode.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang_exl3.runtime.online_cache import (
    KEY_FIELDS,
    NonFiniteEncoding,
    OnlineCache,
    OnlineCacheError,
    cache_key,
    encoder_identity,
    local_model_identity,
    model_identity,
    resolve_mode,
)


def _key(**changes) -> dict:
    fields = {"model_identity": "a" * 64, "encoder_identity": "b" * 64, "module": "model.layers.0.mlp.down_proj",
              "bits": 4, "codebook": "mcg", "seed": 7, "tp_world_size": 1, "tp_rank": 0, "input_size": 256,
              "output_size": 128, "source_dtype": "torch.bfloat16"}
    return cache_key(**{**fields, **changes})


class Encoder:
    """Counts its calls; returns a seeded EXL3 linear of the key's shapes (NaN scales for the first `bad` calls)."""

    def __init__(self, key: dict, bad: int = 0):
        self.key, self.bad, self.calls = key, bad, 0

    def __call__(self):
        self.calls += 1
        g = torch.Generator().manual_seed(self.calls)
        k, n, bits = self.key["input_size"], self.key["output_size"], self.key["bits"]
        suh = torch.randn(k, generator=g).half()
        if self.calls <= self.bad:
            suh[3] = float("nan")
        return {"trellis": torch.randint(-32768, 32768, (k // 16, n // 16, 16 * bits), generator=g,
                                         dtype=torch.int16),
                "suh": suh, "svh": torch.randn(n, generator=g).half()}, 0.125


def test_round_trip(tmp_path):
    cache, key = OnlineCache(tmp_path / "c"), _key()
    enc = Encoder(key)
    first, how = cache.get_or_encode(key, enc)
    assert how == "encoded" and enc.calls == 1
    second, how = cache.get_or_encode(key, enc)
    assert how == "hit" and enc.calls == 1
    assert all(torch.equal(first[n], second[n]) for n in first)
    path = cache.path(key)
    assert path.parts[-3:-1] == ("a" * 20, "tp1-rank0") and path.parent.parent.parent.name == "v1"
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        assert float(f.metadata()["proxy_error"]) == 0.125
        assert json.loads(f.metadata()["cache_key"]) == key
    assert oct((tmp_path / "c").stat().st_mode & 0o777) == oct(0o700)


def test_a_corrupt_entry_is_encoded_again_and_replaced(tmp_path):
    cache, key = OnlineCache(tmp_path / "c"), _key()
    enc = Encoder(key)
    cache.get_or_encode(key, enc)
    cache.path(key).write_bytes(b"not a safetensors file")
    _, how = cache.get_or_encode(key, enc)
    assert how == "encoded" and enc.calls == 2
    assert cache.get_or_encode(key, enc)[1] == "hit"


def test_an_entry_for_another_key_at_the_path_is_not_used(tmp_path):
    cache, key = OnlineCache(tmp_path / "c"), _key()
    other = _key(bits=3)
    cache.get_or_encode(other, Encoder(other))
    cache.path(key).parent.mkdir(parents=True, exist_ok=True)
    os.replace(cache.path(other), cache.path(key))  # right path, wrong key and shapes
    enc = Encoder(key)
    assert cache.get_or_encode(key, enc)[1] == "encoded" and enc.calls == 1


def test_readonly_encodes_a_miss_without_publishing(tmp_path):
    rw = OnlineCache(tmp_path / "c")
    ro, key = OnlineCache(tmp_path / "c", "readonly"), _key()
    enc = Encoder(key)
    assert ro.get_or_encode(key, enc)[1] == "encoded, not published" and not ro.path(key).exists()
    rw.get_or_encode(key, enc)
    assert ro.get_or_encode(key, enc)[1] == "hit"


def test_off_neither_reads_nor_writes(tmp_path):
    rw, key = OnlineCache(tmp_path / "c"), _key()
    rw.get_or_encode(key, Encoder(key))
    off = OnlineCache(tmp_path / "c", "off")
    enc = Encoder(key)
    assert off.get_or_encode(key, enc)[1] == "encoded" and enc.calls == 1
    assert not OnlineCache(tmp_path / "elsewhere", "off").root.exists()


@pytest.mark.parametrize(("text", "mode"), [(None, "readwrite"), ("READONLY", "readonly"), ("off", "off"),
                                            ("readwrite", "readwrite")])
def test_one_spelling_per_mode(text, mode):
    assert resolve_mode(text) == mode


@pytest.mark.parametrize("text", ["sometimes", "rw", "read-only", "none"])
def test_unknown_mode_is_refused(text):
    with pytest.raises(OnlineCacheError, match=f"'{text}' is not one of off, readonly, readwrite"):
        resolve_mode(text)


def test_every_key_field_changes_the_entry(tmp_path):
    cache, base = OnlineCache(tmp_path / "c"), _key()
    changes = {"model_identity": "c" * 64, "encoder_identity": "d" * 64, "module": "x", "bits": 3,
               "codebook": "mul1", "seed": 8, "tp_world_size": 2, "tp_rank": 1, "input_size": 512, "output_size": 256,
               "source_dtype": "torch.float16"}
    assert set(changes) | {"schema"} == set(KEY_FIELDS)
    paths = {cache.path(base)} | {cache.path(_key(**{f: v})) for f, v in changes.items()}
    assert len(paths) == len(changes) + 1
    with pytest.raises(OnlineCacheError, match=r"missing \['bits'\]"):
        cache_key(**{k: v for k, v in base.items() if k not in ("bits", "schema")})


def test_non_finite_encodings_are_retried_once(tmp_path):
    cache, key = OnlineCache(tmp_path / "c"), _key()
    enc = Encoder(key, bad=1)
    assert cache.get_or_encode(key, enc)[1] == "encoded" and enc.calls == 2
    other = _key(seed=9)
    with pytest.raises(NonFiniteEncoding, match="model.layers.0.mlp.down_proj gave non-finite scales"):
        cache.get_or_encode(other, Encoder(other, bad=2))
    assert not cache.path(other).exists()


def test_a_folder_others_can_write_is_refused(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(OnlineCacheError, match="writable by group or others .* chmod go-w"):
        OnlineCache(folder)


def _model(tmp_path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"hidden_size": 128}')
    (d / "model.safetensors").write_bytes(b"x" * 1000)
    return d


def test_local_identity_tracks_config_edits_and_in_place_replacement(tmp_path):
    d = _model(tmp_path)
    first = local_model_identity(d)
    assert local_model_identity(d) == first
    (d / "config.json").write_text('{"hidden_size": 256}')
    edited = local_model_identity(d)
    assert edited != first
    weights = d / "model.safetensors"
    st = weights.stat()
    replacement = tmp_path / "new.safetensors"
    replacement.write_bytes(b"y" * 1000)  # same size
    os.replace(replacement, weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the old mtime
    assert local_model_identity(d) != edited


def test_hub_identity_needs_a_resolved_commit():
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert model_identity("org/model", commit) == model_identity("org/model", commit)
    assert model_identity("org/model", commit) != model_identity("org/other", commit)
    with pytest.raises(OnlineCacheError, match="revision 'main' is not a resolved commit"):
        model_identity("org/model", "main")


def test_encoder_identity_is_a_digest_of_its_sources():
    assert len(encoder_identity()) == 64 and encoder_identity() == encoder_identity()


def test_a_hit_does_not_import_the_encoder(tmp_path):
    cache, key = OnlineCache(tmp_path / "c"), _key()
    cache.get_or_encode(key, Encoder(key))
    probe = (f"import json, sys; from sglang_exl3.runtime.online_cache import OnlineCache; "
             f"key = json.loads({json.dumps(json.dumps(key))}); "
             f"t, how = OnlineCache({str(tmp_path / 'c')!r}).get_or_encode(key, None); "
             "print(how, 'sglang_exl3.codec.encode' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["hit", "False"]
