"""Expert cartridges before anything live changes: the closed fq-cartridge-adapter/3 manifest, the tensor index and
private SHA-256 staging (seeds.md §1.6, F27; the rejection matrix of the reference's test_exl3_lora_cartridge.py).
Each case starts from a valid cartridge written by the project's writer and changes one thing; the error must name
the rule."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import changed
from sglang_exl3.format.cartridge_index import live_layer_index
from sglang_exl3.format.cartridge_manifest import MANIFEST_NAME, CartridgeError, parse_manifest
from sglang_exl3.format.cartridge_staging import stage_cartridge
from sglang_exl3.synth.cartridge_writer import StageSpec, write_cartridge


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from sglang_exl3.synth.msrt_base_writer import write_msrt_base
    from sglang_exl3.synth.rank_sliced_writer import write_rank_sliced_checkpoint

    root = tmp_path_factory.mktemp("cart-base")
    return write_msrt_base(write_rank_sliced_checkpoint(root / "rs", bits=3, tp=1, seed=5), root / "base")


@pytest.fixture(scope="module")
def cartridge(base, tmp_path_factory):
    return write_cartridge(base, tmp_path_factory.mktemp("cart") / "c",
                           [StageSpec("res2", 3, 16.0), StageSpec("res10", 2, 64.0, (0, 2))], seed=1)


def manifest(path) -> dict:
    return json.loads((path / MANIFEST_NAME).read_text())


def rewrite(src, dst, tensors=None, doc=None, rehash=True):
    """A copy of cartridge `src` with its tensors (rank0 shard) and / or manifest edited; shard sizes and SHA-256
    recomputed unless `rehash` is off, so the case reaches the rule under test."""
    shutil.copytree(src, dst)
    doc = doc if doc is not None else manifest(dst)
    if tensors is not None:
        shard = dst / doc["shards"][0]["path"]
        save_file(tensors(load_file(str(shard))), str(shard))
    if rehash:
        for entry in doc["shards"]:
            data = (dst / entry["path"]).read_bytes()
            entry["size"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (dst / MANIFEST_NAME).write_text(json.dumps(doc))
    return dst


def test_a_written_cartridge_stages_and_indexes(cartridge):
    staged = stage_cartridge(cartridge)
    m = staged.manifest
    assert [s.label for s in m.chain] == ["res2", "res10"]  # chain order, not label order
    assert m.coverage["res10"] == {0: (0, 2), 1: (0, 2)} and m.base_k == 3
    assert len(staged.index.tensors) * 2 == m.num_tensors
    assert all(f.parent.name.startswith("sglang-exl3-cartridge-") for f in staged.files)
    staged.discard()
    assert not staged.files[0].exists()


def _doc(cartridge, **changes):
    return changed(manifest(cartridge), **changes)


@pytest.mark.parametrize(("edit", "match"), [
    (lambda d: d.pop("campaign"), r"missing=\['campaign'\], unexpected=\[\]"),
    (lambda d: d.update(extra=1), r"missing=\[\], unexpected=\['extra'\]"),
    (lambda d: d.update(schema="fq-cartridge-adapter/2"), "schema: must be 'fq-cartridge-adapter/3'"),
    (lambda d: d.update(standard_lora_compatible=0), "standard_lora_compatible: must be False"),
    (lambda d: d.update(mcg_multiplier=1), "mcg_multiplier: must be 3417055213"),
    (lambda d: d.update(assembly="-bad"), "label '-bad' must match"),
    (lambda d: d.update(assembly="_bad"), "label '_bad' must match"),
    (lambda d: d.update(assembly="bad.label"), "label 'bad.label' must match"),
    (lambda d: d.update(assembly="a" * 33), "must match"),
    (lambda d: d["base"].update(k=True), r"k must be an integer in 2..6"),
    (lambda d: d["base"].update(k=7), r"k must be an integer in 2..6"),
    (lambda d: d["base"].update(compatibility_sha256="AB" * 32), "lowercase 64-digit"),
    (lambda d: d["base"]["compatibility_by_layer"].pop("1"), "must map exactly the selected layers"),
    (lambda d: d["chain"][0].update(parent="other"), r"chain\[0\].parent: must be 'base-k3'"),
    (lambda d: d["chain"][1].update(parent="base-k3"), r"chain\[1\].parent: must be 'res2'"),
    (lambda d: d["chain"][1].update(label="res2"), "duplicate label 'res2'"),
    (lambda d: d["chain"][0].update(k=0), r"k must be an integer in 1..6"),
    (lambda d: d.update(chain=[]), "non-empty list of stages"),
    (lambda d: d["coverage"].pop("res10"), "keys must be the chain's labels"),
    (lambda d: d["coverage"]["res10"].update({"1": [0, 1, 2]}), r"experts \[1\] are outside the stage's declared"),
    (lambda d: (d["chain"][0].update(experts=[0, 2]), d["chain"][1].update(experts=[0, 1, 2]),
                d["coverage"]["res2"].update({"0": [0, 2], "1": [0, 2]}),
                d["coverage"]["res10"].update({"1": [0, 1]})), "layer 1 experts \\[1\\] are not covered by parent"),
    (lambda d: d["coverage"]["res2"].update({"1": [0, 1]}), "declares experts 'all' but does not cover"),
    (lambda d: d["coverage"]["res2"].update({"7": [0]}), "layer '7' is not one of the selected layers"),
    (lambda d: d["tensor_parallel"].update(world_size=2, ranks=[0, 1]), "a 'full' layout is one rank0 artefact"),
    (lambda d: d["tensor_parallel"].update(ranks=[1]), r"ranks: must be \[0\]"),
    (lambda d: d["tensor_parallel"]["axis_by_projection"].update(down_proj="output"), "axis_by_projection"),
    (lambda d: d["shards"][0].update(path="../x.safetensors"), "must be relative to the adapter directory"),
    (lambda d: d["shards"][0].update(path="/abs.safetensors"), "must be relative to the adapter directory"),
    (lambda d: d["shards"][0].update(size=0), "must be an integer from 1"),
    (lambda d: d["shards"][0].update(size=(64 << 30) + 1), "must be an integer from 1"),
    (lambda d: d["shards"].append(dict(d["shards"][0])), "duplicate shard path"),
    (lambda d: d.update(num_tensors=0), "num_tensors: must be a positive integer"),
    (lambda d: d.update(selected_experts=[0, 0]), "unique non-negative"),
    (lambda d: d.update(producer_verified_signer="x"), "or null"),
    (lambda d: d["campaign"].update(block_size=0), "block_size"),
    (lambda d: d["campaign"].pop("signer_pubkey"), r"campaign: fields do not match"),
    (lambda d: d["source_assembly"].update(path="../a"), "source_assembly"),
    (lambda d: d.update(tool_version=" "), "tool_version"),
    (lambda d: d.update(created_utc="2026-01-01T00:00:00"), "RFC 3339 timestamp with a timezone"),
    (lambda d: d.update(created_utc="yesterday"), "RFC 3339"),
])
def test_manifest_rejections(cartridge, edit, match):
    doc = manifest(cartridge)
    edit(doc)
    with pytest.raises(CartridgeError, match=match):
        parse_manifest(doc)


def test_manifest_accepts_the_edges(cartridge):
    doc = _doc(cartridge, assembly="a" * 32, created_utc="2026-01-01T00:00:00.5+02:00")
    assert parse_manifest(doc).assembly == "a" * 32


def test_rank_sharded_world_size_must_be_the_runtime_tp(base, tmp_path):
    sharded = write_cartridge(base, tmp_path / "c", [StageSpec("r1", 2)], layout="rank-sharded", world_size=2)
    assert stage_cartridge(sharded, runtime_tp=2).index.ranks() == [0, 1]
    with pytest.raises(CartridgeError, match="world_size 2 cannot serve tp=1"):
        stage_cartridge(sharded, runtime_tp=1)
    one = write_cartridge(base, tmp_path / "c1", [StageSpec("r1", 2)], layout="rank-sharded", world_size=1)
    assert stage_cartridge(one, runtime_tp=1).index.ranks() == [0]


def _renamed(old: str, new: str):
    def edit(t):
        t[new] = t.pop(old)
        return t
    return edit


def _first(t, suffix):
    return next(n for n in sorted(t) if n.endswith(suffix))


KEY = "model.layers.0.mlp.experts.0.gate_proj.rank0"


@pytest.mark.parametrize(("tensors", "doc_edit", "match"), [
    (lambda t: _renamed(f"{KEY}.trellis_res2", f"{KEY}.trellis_res2.mul1_res1")(t), None,
     "Malformed MSRT cartridge key"),
    (lambda t: {**t, f"{KEY}.suh_res2": torch.zeros(16, dtype=torch.float16)}, "count+1",
     "Malformed MSRT cartridge key"),
    (lambda t: _renamed(f"{KEY}.trellis_res2", f"{KEY[:-5]}rankx.trellis_res2")(t), None,
     "Malformed MSRT cartridge key"),
    (lambda t: {k.replace("model.layers.0", "model.language_model.layers.0"): v for k, v in t.items()}, None,
     "not canonical"),
    (lambda t: (t.pop(f"{KEY}.trellis_res2"), t)[1], "count-1", "Orphaned MSRT cartridge scale"),
    (lambda t: (t.pop(f"{KEY}.scale_res2"), t)[1], "count-1", "has no scalar scale companion"),
    (lambda t: {**t, f"{KEY}.scale_res2": torch.tensor([16.0])}, None, "float32 0-d scalar"),
    (lambda t: {**t, f"{KEY}.scale_res2": torch.tensor(16.0, dtype=torch.float64)}, None, "float32 0-d scalar"),
    (lambda t: {**t, f"{KEY}.scale_res2": torch.tensor(0.0)}, None, "must be finite and > 0"),
    (lambda t: {**t, f"{KEY}.scale_res2": torch.tensor(-2.0)}, None, "must be finite and > 0"),
    (lambda t: {**t, f"{KEY}.scale_res2": torch.tensor(float("inf"))}, None, "must be finite and > 0"),
    (lambda t: {**t, f"{KEY}.scale_res2": torch.tensor(1e-40)}, None, "finite float32 inverse"),
    (lambda t: {**t, f"{KEY}.trellis_res2": t[f"{KEY}.trellis_res2"][..., :32].contiguous()}, None,
     "declares K2, but its stage's chain entry has k=3"),
    (lambda t: {**t, f"{KEY}.trellis_res2": t[f"{KEY}.trellis_res2"].to(torch.int32)}, None, "must be int16"),
    (lambda t: {k: v for k, v in t.items() if ".0.down_proj." not in k or "layers.1." in k}, "count-4",
     r"Incomplete MSRT cartridge: stage '\w+' layer 0 expert 0 rank 0 lacks \['down_proj'\]"),
    (lambda t: {k: v for k, v in t.items() if ".experts.2." not in k or "res10" not in k or "layers.1." in k},
     "count-6", r"do not match its manifest coverage for stage\(s\) \['res10'\]"),
    (None, "count+1", "holds 72 tensors, its manifest num_tensors says 73"),
    (lambda t: {k.replace("_res10", "_res11"): v for k, v in t.items()}, None, "not in the manifest's chain"),
])
def test_index_rejections(cartridge, tmp_path, tensors, doc_edit, match):
    doc = manifest(cartridge)
    if doc_edit:
        doc["num_tensors"] += int(doc_edit.removeprefix("count"))
    with pytest.raises(CartridgeError, match=match):
        stage_cartridge(rewrite(cartridge, tmp_path / "c", tensors, doc))


def test_selected_sets_must_be_the_observed(cartridge, tmp_path):
    doc = manifest(cartridge)
    doc["selected_experts"] = [0, 1, 2, 3, 4]
    doc["chain"][0]["experts"] = [0, 1, 2, 3]
    with pytest.raises(CartridgeError, match=r"manifest selects layers \[0, 1\] and experts \[0, 1, 2, 3, 4\]"):
        stage_cartridge(rewrite(cartridge, tmp_path / "c", None, doc))


def test_a_key_in_two_shards_is_refused(cartridge, tmp_path):
    dst = rewrite(cartridge, tmp_path / "c")
    doc = manifest(dst)
    first = dst / doc["shards"][0]["path"]
    t = load_file(str(first))
    name = _first(t, ".trellis_res2")
    save_file({name: t[name]}, str(dst / "extra.safetensors"))
    doc["shards"].append({"path": "extra.safetensors", "size": 1, "sha256": "0" * 64})
    with pytest.raises(CartridgeError, match="appears in two shards"):
        stage_cartridge(rewrite(dst, tmp_path / "d", None, doc))


def test_rank_sharded_consistency(base, tmp_path):
    src = write_cartridge(base, tmp_path / "c", [StageSpec("r1", 2)], layout="rank-sharded", world_size=2)
    doc = manifest(src)
    rank1 = doc["shards"][1]["path"]

    def edit_rank1(dst_name, fn):
        dst = shutil.copytree(src, tmp_path / dst_name)
        shard = dst / rank1
        save_file(fn(load_file(str(shard))), str(shard))
        d = manifest(dst)
        d["shards"][1].update(size=shard.stat().st_size, sha256=hashlib.sha256(shard.read_bytes()).hexdigest())
        d["num_tensors"] = sum(len(load_file(str(dst / s["path"]))) for s in d["shards"])
        (dst / MANIFEST_NAME).write_text(json.dumps(d))
        return dst

    key = "model.layers.0.mlp.experts.1.up_proj.rank1"
    scaled = edit_rank1("s", lambda t: {**t, f"{key}.scale_r1": torch.tensor(8.0)})
    with pytest.raises(CartridgeError, match="scales differ across TP ranks"):
        stage_cartridge(scaled, runtime_tp=2)
    moved = edit_rank1("m", lambda t: {(k.replace("experts.1.", "experts.9.") if "experts.1." in k else k): v
                                       for k, v in t.items()})
    with pytest.raises(CartridgeError, match="inconsistent stage topology|coverage"):
        stage_cartridge(moved, runtime_tp=2)


# -- staging: paths, hashes, private copies ------------------------------------------------------------------------

def test_a_tampered_shard_is_refused_naming_it(cartridge, tmp_path):
    dst = shutil.copytree(cartridge, tmp_path / "c")
    shard = dst / manifest(dst)["shards"][0]["path"]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CartridgeError, match=f"{shard.name}: SHA-256 .* does not match its manifest"):
        stage_cartridge(dst)


def test_a_shard_of_another_size_is_refused(cartridge, tmp_path):
    dst = shutil.copytree(cartridge, tmp_path / "c")
    shard = dst / manifest(dst)["shards"][0]["path"]
    shard.write_bytes(shard.read_bytes() + b"\0")
    with pytest.raises(CartridgeError, match="bytes, its manifest says"):
        stage_cartridge(dst)


def test_path_rules(cartridge, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(cartridge)
    with pytest.raises(CartridgeError, match="symlink"):
        stage_cartridge(link)
    with pytest.raises(CartridgeError, match="does not exist"):
        stage_cartridge(tmp_path / "nothing")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(CartridgeError, match="must be a directory or regular file"):
        stage_cartridge(fifo)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CartridgeError, match="holds no adapter_config.json"):
        stage_cartridge(empty)


def test_a_listed_shard_file_stands_for_its_directory(cartridge, tmp_path):
    shard = cartridge / manifest(cartridge)["shards"][0]["path"]
    assert stage_cartridge(shard).source == cartridge
    dst = shutil.copytree(cartridge, tmp_path / "c")
    (dst / "stray.safetensors").write_bytes(b"x")
    with pytest.raises(CartridgeError, match="is not a shard listed by"):
        stage_cartridge(dst / "stray.safetensors")


def test_symlinked_shards_and_fifo_shards_are_refused(cartridge, tmp_path):
    dst = shutil.copytree(cartridge, tmp_path / "c")
    name = manifest(dst)["shards"][0]["path"]
    real = tmp_path / "real.safetensors"
    (dst / name).rename(real)
    (dst / name).symlink_to(real)
    with pytest.raises(CartridgeError, match="symlink or leaves the adapter directory"):
        stage_cartridge(dst)
    (dst / name).unlink()
    os.mkfifo(dst / name)
    with pytest.raises(CartridgeError, match="must be a regular file"):
        stage_cartridge(dst)


def test_manifest_must_be_utf8_json_and_a_regular_file(cartridge, tmp_path):
    dst = shutil.copytree(cartridge, tmp_path / "c")
    (dst / MANIFEST_NAME).write_bytes(b"\xff\xfe{")
    with pytest.raises(CartridgeError, match="is not UTF-8"):
        stage_cartridge(dst)
    (dst / MANIFEST_NAME).write_text("{")
    with pytest.raises(CartridgeError, match="is not valid JSON"):
        stage_cartridge(dst)
    (dst / MANIFEST_NAME).unlink()
    (dst / MANIFEST_NAME).symlink_to(cartridge / MANIFEST_NAME)
    with pytest.raises(CartridgeError, match="without following links"):
        stage_cartridge(dst)


def test_loads_read_only_the_private_copy(cartridge, tmp_path):
    """After staging, the source may be replaced or deleted: the index reads the verified copies."""
    dst = shutil.copytree(cartridge, tmp_path / "c")
    staged = stage_cartridge(dst)
    shutil.rmtree(dst)
    info = next(iter(staged.index.tensors.values())).trellis
    assert info.file.parent.name.startswith("sglang-exl3-cartridge-") and len(info.read_bytes()) == info.nbytes
    staged.discard()


def test_staging_deadline(cartridge):
    with pytest.raises(TimeoutError, match="deadline"):
        stage_cartridge(cartridge, deadline_s=-1)


@pytest.mark.parametrize(("name", "want"), [
    ("model.layers.3.mlp.experts", 3),
    ("language_model.model.layers.3.mlp.experts", 3),
    ("model.layers.12.block_sparse_moe.experts", 12),
])
def test_live_layers_match_by_their_one_numeric_segment(name, want):
    assert live_layer_index(name) == want


@pytest.mark.parametrize("name", ["model.layers.3.mtp.layers.0.mlp.experts", "model.mlp.experts",
                                  "model.layers.x.mlp.experts"])
def test_ambiguous_live_names_are_refused(name):
    with pytest.raises(CartridgeError, match="one numeric 'layers.<idx>' segment"):
        live_layer_index(name)


def test_the_cli_writes_a_cartridge_a_server_accepts_and_leaves_none_it_would_refuse(base, tmp_path, capsys):
    from sglang_exl3.cli.main import main

    assert main(["write-cartridge", str(base), str(tmp_path / "ok"), "--stage", "a:3:16", "--stage",
                 "b:2:32:0,1", "--layers", "1"]) == 0
    staged = stage_cartridge(tmp_path / "ok")
    assert [s.k for s in staged.manifest.chain] == [3, 2] and staged.manifest.selected_layers == (1,)
    staged.discard()
    assert main(["write-cartridge", str(base), str(tmp_path / "bad"), "--stage", "a:9"]) == 1
    assert "k must be an integer in 1..6" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    with pytest.raises(SystemExit):
        main(["write-cartridge", str(base), str(tmp_path / "x"), "--stage", "a"])
