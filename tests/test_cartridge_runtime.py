"""Expert cartridges on a served model (SGLang's real Qwen3-MoE class on the CPU, the base loaded as a server loads
it): each projection serves base + sum of stages / scale with the base's rotations (the oracle: the codec's
reference linear per stage, summed); deactivation restores the base bit for bit; a narrower cartridge leaves the
layers it does not select on the base; the base identity, base.k and residual shapes are checked before anything
changes; at TP 2 each rank serves its slice, the same for a `full` and a `rank-sharded` cartridge."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from sglang_cpu import load_as_server, sglang_runtime
from sglang_exl3.codec import exl3_linear_reference
from sglang_exl3.format.cartridge_manifest import MANIFEST_NAME, CartridgeError
from sglang_exl3.format.constants import Codebook
from sglang_exl3.layers.cartridge_runtime import CartridgeRuntime
from sglang_exl3.synth.cartridge_writer import StageSpec, write_cartridge

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
PROJ = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from sglang_exl3.synth.msrt_base_writer import write_msrt_base
    from sglang_exl3.synth.rank_sliced_writer import write_rank_sliced_checkpoint

    root = tmp_path_factory.mktemp("cart-rt")
    sliced = write_rank_sliced_checkpoint(root / "rs", bits=3, tp=1, seed=7, with_tokenizer=True)
    base = write_msrt_base(sliced, root / "base")
    other = write_msrt_base(write_rank_sliced_checkpoint(root / "rs2", bits=3, tp=1, seed=8), root / "other")
    two = write_cartridge(base, root / "two", [StageSpec("res2", 3, 8.0), StageSpec("res3", 2, 32.0, (1, 3))], seed=2)
    narrow = write_cartridge(base, root / "narrow", [StageSpec("one", 2, 8.0)], layers=[1], seed=3)
    return {"sliced": sliced, "base": base, "other": other, "two": two, "narrow": narrow, "root": root}


@pytest.fixture(scope="module")
def served(ckpts):
    sglang_runtime()
    model, _ = load_as_server(ckpts["base"])
    return model


def _moe_layers(model):
    return [(i, layer.mlp.experts) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


def _apply(experts, x, weights, ids):
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    out = StandardDispatchOutput(hidden_states=x, hidden_states_scale=None,
                                 topk_output=StandardTopKOutput(weights, ids, torch.zeros(x.shape[0], 4)))
    return experts.quant_method.apply(experts, out).hidden_states


def _routing(m, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 256, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(m)])
    weights = torch.softmax(torch.randn(m, 2, generator=g), -1)
    return x, weights, ids


def _reference(base_tensors, cart_tensors, stages, layer, x, weights, ids):
    """fp32: per projection base linear + sum_s stage linear / scale (the base's suh / svh), silu(gate) * up, down."""
    def proj(e, name, h):
        key = f"model.layers.{layer}.mlp.experts.{e}.{name}.rank0"
        suh, svh = base_tensors[f"{key}.suh"], base_tensors[f"{key}.svh"]
        y = exl3_linear_reference(h, base_tensors[f"{key}.trellis"], suh, svh, Codebook.MCG).float()
        for label in stages:
            if f"{key}.trellis_{label}" in cart_tensors:
                scale = float(cart_tensors[f"{key}.scale_{label}"])
                y += exl3_linear_reference(h, cart_tensors[f"{key}.trellis_{label}"], suh, svh,
                                           Codebook.MCG).float() / scale
        return y

    out = torch.zeros(x.shape[0], 256)
    for m in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[m, k])
            h = torch.nn.functional.silu(proj(e, "gate_proj", x[m:m + 1])) * proj(e, "up_proj", x[m:m + 1])
            out[m] += weights[m, k] * proj(e, "down_proj", h.half())[0]
    return out


def _tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_cartridge_serves_base_plus_stages_and_deactivates_exactly(ckpts, served):
    x, weights, ids = _routing(5, 1)
    before = {i: _apply(experts, x, weights, ids) for i, experts in _moe_layers(served)}
    rt = CartridgeRuntime(served)
    assert rt.stage(str(ckpts["two"])) == 2
    assert rt.prepare() == 2
    assert all(getattr(experts, "exl3_cartridge", None) is None for _, experts in _moe_layers(served))  # not yet
    assert rt.commit() == 2 and rt.status()["active"]
    rt.discard()
    base_t, cart_t = _tensors(ckpts["base"]), _tensors(ckpts["two"])
    for i, experts in _moe_layers(served):
        got = _apply(experts, x, weights, ids).float()
        want = _reference(base_t, cart_t, ("res2", "res3"), i, x, weights, ids)
        base_only = before[i].float()
        assert (got - want).norm() / want.norm() < 5e-3, i
        assert (got - base_only).norm() / base_only.norm() > 5e-2, i  # the cartridge moved the output
    assert rt.deactivate() == 2 and not rt.status()["active"]
    for i, experts in _moe_layers(served):
        assert torch.equal(_apply(experts, x, weights, ids), before[i]), i


def test_a_narrower_cartridge_leaves_other_layers_on_the_base(ckpts, served):
    x, weights, ids = _routing(3, 2)
    layers = dict(_moe_layers(served))
    before = {i: _apply(e, x, weights, ids) for i, e in layers.items()}
    rt = CartridgeRuntime(served)
    for path, want in ((ckpts["two"], 2), (ckpts["narrow"], 1)):
        rt.stage(str(path))
        rt.prepare()
        assert rt.commit() == want
    assert torch.equal(_apply(layers[0], x, weights, ids), before[0])
    assert not torch.equal(_apply(layers[1], x, weights, ids), before[1])
    assert rt.status()["layers"] == ["model.layers.1.mlp.experts"]
    rt.deactivate()
    rt.discard()
    assert torch.equal(_apply(layers[1], x, weights, ids), before[1])


def test_a_cartridge_for_another_base_is_refused_before_anything_changes(ckpts, served, tmp_path):
    """By its root at staging; a manifest that names the loaded root but another layer digest, at preparation (the
    layer's digest recomputed from its loaded tensors)."""
    import shutil

    foreign = write_cartridge(ckpts["other"], tmp_path / "c", [StageSpec("r", 2)])
    rt = CartridgeRuntime(served)
    with pytest.raises(CartridgeError, match="encoded for a different base checkpoint: its base root"):
        rt.stage(str(foreign))
    assert rt.staged is None and not rt.status()["active"]
    forged = shutil.copytree(foreign, tmp_path / "f")
    doc = json.loads((forged / MANIFEST_NAME).read_text())
    doc["base"]["compatibility_sha256"] = json.loads((ckpts["base"] / "config.json").read_text())[
        "hybrid_tr3_tail"]["compatibility_sha256"]
    (forged / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(CartridgeError, match=r"layers \[0, 1\] are missing from the loaded base's"):
        rt.stage(str(forged))
    for layer in rt.layers.values():  # as if the verified map agreed: the per-layer check still refuses
        layer.exl3_base_identity = (layer.exl3_base_identity[0], {0: doc["base"]["compatibility_by_layer"]["0"],
                                                                  1: doc["base"]["compatibility_by_layer"]["1"]})
    try:
        rt.stage(str(forged))
        with pytest.raises(CartridgeError, match="encoded for a different base checkpoint \\(layer"):
            rt.prepare()
        assert rt.prepared is None and not rt.status()["active"]
    finally:
        rt.discard()
        for layer in rt.layers.values():
            layer.exl3_base_identity = (layer.exl3_base_identity[0], {
                int(k): v for k, v in json.loads((ckpts["base"] / "config.json").read_text())[
                    "hybrid_tr3_tail"]["compatibility_by_layer"].items()})


def test_base_k_must_be_the_layers(ckpts, served, tmp_path):
    import shutil

    dst = shutil.copytree(ckpts["narrow"], tmp_path / "k")
    doc = json.loads((dst / MANIFEST_NAME).read_text())
    doc["base"]["k"] = 4
    (dst / MANIFEST_NAME).write_text(json.dumps(doc))
    rt = CartridgeRuntime(served)
    rt.stage(str(dst))
    with pytest.raises(CartridgeError, match=r"base.k \(4\) does not match the layer's base bitrate \[3\]"):
        rt.prepare()


def test_a_residual_of_another_shape_is_refused(ckpts, served, tmp_path):
    import hashlib
    import shutil

    from safetensors.torch import save_file

    dst = shutil.copytree(ckpts["narrow"], tmp_path / "s")
    doc = json.loads((dst / MANIFEST_NAME).read_text())
    shard = dst / doc["shards"][0]["path"]
    t = load_file(str(shard))
    key = "model.layers.1.mlp.experts.2.down_proj.rank0.trellis_one"
    t[key] = t[key][:8].contiguous()
    save_file(t, str(shard))
    doc["shards"][0].update(size=shard.stat().st_size, sha256=hashlib.sha256(shard.read_bytes()).hexdigest())
    (dst / MANIFEST_NAME).write_text(json.dumps(doc))
    rt = CartridgeRuntime(served)
    rt.stage(str(dst))
    with pytest.raises(CartridgeError, match=r"residual .*experts.2.down_proj.rank0.trellis_one is \[128, 256\] "
                                             r"\(in, out\); the projection is \[256, 256\]"):
        rt.prepare()


def test_a_base_without_verified_identity_takes_no_cartridge(ckpts):
    sglang_runtime()
    model, _ = load_as_server(ckpts["sliced"])  # the same experts, but not an exl3-msrt-base/1 profile
    with pytest.raises(CartridgeError, match="no EXL3 MoE layer with a verified exl3-msrt-base/1 base"):
        CartridgeRuntime(model).stage(str(ckpts["two"]))


def test_tp2_ranks_serve_their_slice_for_full_and_rank_sharded(ckpts, served, tmp_path):
    """Rank r's folded weights are the [r*I/2, (r+1)*I/2) slice of the one-rank weights (gate/up rows of W^T, down
    columns), for a full cartridge sliced at load and a rank-sharded one written for two ranks alike."""
    from sglang.srt.runtime_context import get_parallel

    stages = [StageSpec("a", 3, 8.0), StageSpec("b", 2, 16.0, (0, 2))]
    full = write_cartridge(ckpts["base"], tmp_path / "full", stages, seed=4)
    sharded = write_cartridge(ckpts["base"], tmp_path / "sh", stages, seed=4, layout="rank-sharded", world_size=2)
    one = CartridgeRuntime(served)
    one.stage(str(full))
    one.prepare()
    whole = {n: c.weights for n, c in one.prepared.items()}
    one.discard()
    for rank in range(2):
        with get_parallel().override(moe_tp_size=2, moe_tp_rank=rank):
            model, _ = load_as_server(ckpts["base"])
        for path in (full, sharded):
            rt = CartridgeRuntime(model)
            rt.stage(str(path))
            assert rt.prepare() == 2
            for name, cart in rt.prepared.items():
                gate_up, down = whole[name]  # gate experts, then up experts
                half = gate_up.shape[1] // 2
                cut = slice(rank * half, (rank + 1) * half)
                assert torch.equal(cart.weights[0], gate_up[:, cut]) and torch.equal(cart.weights[1], down[:, :, cut])
            rt.discard()
