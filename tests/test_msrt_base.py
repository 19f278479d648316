"""The closed `exl3-msrt-base/1` profile (seeds.md §1.3): a base written from a rank-sliced checkpoint loads through
SGLang at tp = 1 with the same experts; unknown or missing keys, wrong fixed values and a root digest that is not
the recomputation of the per-layer map are refused naming the key; tp > 1 is refused naming the missing slicing."""

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


def test_tensor_parallel_slicing_is_refused_until_it_exists(checkpoints):
    spec = parse(tail(checkpoints[1]))
    with pytest.raises(RankSlicedError, match="full-rank for slicing at load.*--tp 1"):
        check_runtime(spec, 2, spec.experts_per_layer)
    check_runtime(spec, 1, spec.experts_per_layer)
