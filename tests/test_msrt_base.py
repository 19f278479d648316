"""The closed `exl3-msrt-base/1` profile (seeds.md §1.3): a base written from a rank-sliced checkpoint loads through
SGLang at tp = 1 with the same experts; unknown or missing keys, wrong fixed values and a root digest that is not
the recomputation of the per-layer map are refused naming the key; at tp > 1 every rank slices the full-rank experts
at load (gate/up on the output axis, down on the input axis); experts that no longer match their layer digest stop
the load."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from sglang_cpu import expert_tensors, load_as_server, sglang_runtime
from sglang_exl3.format.msrt_base import parse
from sglang_exl3.format.rank_sliced import RankSlicedError, check_runtime


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from sglang_exl3.synth.msrt_base_writer import write_msrt_base
    from sglang_exl3.synth.rank_sliced_writer import write_rank_sliced_checkpoint

    root = tmp_path_factory.mktemp("msrt")
    sliced = write_rank_sliced_checkpoint(root / "rs", bits=3, tp=1, seed=3, with_tokenizer=True)
    return sliced, write_msrt_base(sliced, root / "base")


def tail(path) -> dict:
    return json.loads((path / "config.json").read_text())["hybrid_tr3_tail"]


def test_the_base_serves_the_rank_sliced_experts(checkpoints):
    sliced, base = checkpoints
    spec = parse(tail(base))
    assert spec.tp == 1 and spec.bits == 3 and spec.profile == "exl3-msrt-base/1"
    sglang_runtime()
    got, cfg = load_as_server(base)
    want, _ = load_as_server(sliced)
    assert cfg.rank_sliced.profile == "exl3-msrt-base/1"
    layers = [i for i, layer in enumerate(got.model.layers) if hasattr(layer.mlp, "experts")]
    assert layers
    for i in layers:
        a, b = expert_tensors(got.model.layers[i].mlp.experts), expert_tensors(want.model.layers[i].mlp.experts)
        assert a.keys() == b.keys() and any(k[2] == "trellis" for k in a)
        for key, value in a.items():
            torch.testing.assert_close(value, b[key], rtol=0, atol=0, msg=f"layer {i} {key}")


@pytest.mark.parametrize(("change", "match"), [
    ({"tp": 1}, r"unknown keys \['tp'\]"),
    ({"experts_per_layer": None}, r"missing keys \['experts_per_layer'\]"),
    ({"codebook": "mul1"}, "codebook must be 'mcg'"),
    ({"mcg_multiplier": 1}, "mcg_multiplier must be 3417055213"),
    ({"bits": 2.5}, "integral K"),
    ({"runtime_profile": "exl3-msrt-base/2"}, "only runtime profile"),
    ({"moe_layer_coverage": []}, "moe_layer_coverage"),
    ({"compatibility_sha256": "0" * 64}, "does not match its compatibility_by_layer"),
])
def test_profile_rejections_name_the_key(checkpoints, change, match):
    meta = copy.deepcopy(tail(checkpoints[1]))
    for key, value in change.items():
        if value is None:
            meta.pop(key)
        else:
            meta[key] = value
    with pytest.raises(RankSlicedError, match=match):
        parse(meta)


def test_a_changed_layer_digest_breaks_the_root(checkpoints):
    meta = copy.deepcopy(tail(checkpoints[1]))
    first = next(iter(meta["compatibility_by_layer"]))
    meta["compatibility_by_layer"][first] = "f" * 64
    with pytest.raises(RankSlicedError, match="does not match its compatibility_by_layer"):
        parse(meta)


def test_each_tp_rank_slices_the_full_rank_base(checkpoints):
    """TP2: rank r keeps gate/up output tiles and svh [r*I/2, (r+1)*I/2), down input tiles and suh the same range;
    the hidden-side tensors whole. The full-rank load (tp 1) is the oracle."""
    from sglang.srt.runtime_context import get_parallel

    spec = parse(tail(checkpoints[1]))
    check_runtime(spec, 2, spec.experts_per_layer)  # a full-rank base serves any TP
    sglang_runtime()
    full, _ = load_as_server(checkpoints[1])
    for rank in range(2):
        with get_parallel().override(moe_tp_size=2, moe_tp_rank=rank):
            got, _ = load_as_server(checkpoints[1])
        for layer_full, layer_got in zip(full.model.layers, got.model.layers, strict=True):
            if not hasattr(layer_full.mlp, "experts"):
                continue
            for whole, part in zip(layer_full.mlp.experts.exl3_experts, layer_got.mlp.experts.exl3_experts,
                                   strict=True):
                half = whole["w1"].out_features // 2
                cut = slice(rank * half, (rank + 1) * half)
                for role in ("w1", "w3"):
                    assert torch.equal(part[role].trellis, whole[role].trellis[:, cut.start // 16:cut.stop // 16])
                    assert torch.equal(part[role].svh, whole[role].svh[cut])
                    assert torch.equal(part[role].suh, whole[role].suh)
                assert torch.equal(part["w2"].trellis, whole["w2"].trellis[cut.start // 16:cut.stop // 16])
                assert torch.equal(part["w2"].suh, whole["w2"].suh[cut])
                assert torch.equal(part["w2"].svh, whole["w2"].svh)


def test_a_changed_expert_tensor_stops_the_load(checkpoints, tmp_path):
    """The layer digest is recomputed from the tensors SGLang's loader hands over: one flipped trellis word of one
    expert fails the load naming the layer and the digest."""
    import shutil

    from safetensors.torch import load_file, save_file

    from sglang_exl3.format.msrt_fingerprint import FingerprintError

    base = shutil.copytree(checkpoints[1], tmp_path / "base")
    for f in sorted(base.glob("*.safetensors")):
        tensors = load_file(str(f))
        name = next((n for n in tensors if n.endswith(".experts.1.up_proj.rank0.trellis")), None)
        if name:
            tensors[name][0, 0, 0] ^= 1
            save_file(tensors, str(f))
            break
    sglang_runtime()
    with pytest.raises(FingerprintError, match=r"do not match compatibility digest .* of layer \d"):
        load_as_server(base)
