"""EXL3 inside SGLang's real model classes and linear layers, on CPU (torch backend).

Each EXL3 layer built by SGLang (fused qkv/gate_up, row-parallel o/down, quantized lm_head) must
compute what the reference codec computes for its source matrices.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DATA, DENSE_CKPTS
from sglang_cpu import exl3_config, load_as_server, load_model, process, sglang_runtime
from sglang_exl3.codec import exl3_linear_reference
from sglang_exl3.format import Codebook, load_checkpoint
from sglang_exl3.layers.tp_slicing import Exl3SliceError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime(str(DENSE_CKPTS[0]))


def _reference(ckpt, key, x, out_features):
    t = ckpt.load_module(key)
    return exl3_linear_reference(x, t["trellis"], t["suh"], t["svh"], ckpt.modules[key].codebook,
                                 out_features=out_features)


@pytest.mark.parametrize("path", DENSE_CKPTS, ids=lambda p: p.name)
def test_model_layers_match_reference_codec(path):
    model, cfg = load_model(path)
    ckpt = load_checkpoint(path)
    gen = torch.Generator().manual_seed(0)
    checked = set()
    layers = {name: m for name, m in model.named_modules() if hasattr(m, "exl3_shards")}
    assert {"model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.down_proj", "lm_head"} <= set(layers)
    for name, layer in layers.items():
        width = layer.input_size if hasattr(layer, "input_size") else layer.embedding_dim
        x = torch.randn(5, width, generator=gen).to(torch.bfloat16)
        y = layer.quant_method.apply(layer, x)
        expected = torch.cat([_reference(ckpt, s.key, x, s.out_features) for s in layer.exl3_shards], dim=-1)
        assert y.dtype == torch.bfloat16 and y.shape == expected.shape
        assert torch.allclose(y.float(), expected.float(), rtol=1e-2, atol=1e-3), name
        checked |= {s.key for s in layer.exl3_shards}
    assert checked == set(ckpt.modules)  # every EXL3 matrix of the checkpoint is served
    assert type(model.model.embed_tokens.quant_method).__name__ == "UnquantizedEmbeddingMethod"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral"])
def test_loader_builds_the_class_the_checkpoint_names(tmp_path, arch):
    """SGLang's loader swaps some model classes for quantization methods it does not list (Mixtral ->
    QuantMixtralForCausalLM: every expert on every token, its own routing); an EXL3 checkpoint must get the class
    its config names, the one its fp16 twin gets."""
    import json

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.utils import get_model_architecture

    from sglang_exl3.synth.exl3_writer import ModelDims, write_exl3_checkpoint

    path = write_exl3_checkpoint(tmp_path / "ckpt", arch, dims=ModelDims(num_hidden_layers=1, vocab_size=512),
                                 bits=4, codebook="mul1", with_tokenizer=False)
    config = ModelConfig(str(path))
    assert config.quantization == "exl3"
    _, resolved = get_model_architecture(config)
    assert resolved == json.loads((path / "config.json").read_text())["architectures"][0]
    assert config.quantization == "exl3"  # the hook restores what it lent out


def test_model_config_autodetects_exl3():
    from sglang.srt.configs.model_config import ModelConfig

    path = str(DENSE_CKPTS[0])
    assert ModelConfig(path).quantization == "exl3"
    assert ModelConfig(path, quantization="exl3").quantization == "exl3"
    with pytest.raises(ValueError, match="does not match"):
        ModelConfig(path, quantization="gptq")


def test_bf16_draft_passthrough_config():
    from sglang.srt.layers.linear import RowParallelLinear

    from sglang_exl3.layers import Exl3Config

    cfg = Exl3Config()
    layer = RowParallelLinear(256, 256, bias=False, quant_config=cfg, prefix="model.layers.0.mlp.down_proj")
    assert type(layer.quant_method).__name__ == "UnquantizedLinearMethod"


def _tp_ckpt(tmp_path, **dims):
    from sglang_exl3.synth.exl3_writer import ModelDims, write_exl3_checkpoint

    return write_exl3_checkpoint(tmp_path / "c", "llama", dims=ModelDims(num_hidden_layers=1, **dims),
                                 bits=3, codebook="mcg", with_tokenizer=False)


def _load_layer(make, cfg, ckpt, sources, tp_rank, tp_size):
    from sglang.srt.runtime_context import get_parallel

    cfg._checked_claims = True  # a lone layer, not a whole model: the rest is unclaimed on purpose

    with get_parallel().override(tp_size=tp_size, tp_rank=tp_rank):
        layer = make(cfg)
    for shard_id, key in sources:
        for suffix, info in ckpt.modules[key].tensors.items():
            param = getattr(layer, suffix)
            tensor = ckpt.load_tensor(info.name)
            param.weight_loader(param, tensor, shard_id) if shard_id is not None else param.weight_loader(param, tensor)
    process(layer)
    return layer


def test_tp2_column_row_merged_and_qkv_replication(tmp_path):
    from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    path = _tp_ckpt(tmp_path, num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    _, cfg = exl3_config(path)
    ckpt = load_checkpoint(path)
    p = "model.layers.0"
    x = torch.randn(3, 256, dtype=torch.float16)
    # QKV: 2 q heads of 128 split, the single KV head replicated on both ranks
    qkv = [_load_layer(lambda c, r=r: QKVParallelLinear(256, 128, 2, 1, bias=False, quant_config=c, prefix=f"{p}.self_attn.qkv_proj", tp_rank=r, tp_size=2),  # noqa: E501
                       cfg, ckpt, [(s, f"{p}.self_attn.{s}_proj") for s in "qkv"], r, 2) for r in range(2)]
    outs = [layer.quant_method.apply(layer, x) for layer in qkv]
    q = _reference(ckpt, f"{p}.self_attn.q_proj", x, None)
    k = _reference(ckpt, f"{p}.self_attn.k_proj", x, None)
    v = _reference(ckpt, f"{p}.self_attn.v_proj", x, None)
    for r, out in enumerate(outs):
        assert qkv[r].num_kv_head_replicas == 2
        assert torch.equal(out, torch.cat([q[:, r * 128:(r + 1) * 128], k, v], dim=-1))
    # gate_up: intermediate 512 split in 256-wide halves per source
    gu = [_load_layer(lambda c, r=r: MergedColumnParallelLinear(256, [512, 512], bias=False, quant_config=c, prefix=f"{p}.mlp.gate_up_proj", tp_rank=r, tp_size=2),  # noqa: E501
                      cfg, ckpt, [(0, f"{p}.mlp.gate_proj"), (1, f"{p}.mlp.up_proj")], r, 2) for r in range(2)]
    gate = _reference(ckpt, f"{p}.mlp.gate_proj", x, None)
    up = _reference(ckpt, f"{p}.mlp.up_proj", x, None)
    for r, layer in enumerate(gu):
        want = torch.cat([gate[:, r * 256:(r + 1) * 256], up[:, r * 256:(r + 1) * 256]], dim=-1)
        assert torch.equal(layer.quant_method.apply(layer, x), want)
    # down: rows split; the partial outputs sum to the full product
    xd = torch.randn(3, 512, dtype=torch.float16)
    down = [_load_layer(lambda c, r=r: RowParallelLinear(512, 256, bias=False, quant_config=c, prefix=f"{p}.mlp.down_proj", tp_rank=r, tp_size=2, reduce_results=False),  # noqa: E501
                        cfg, ckpt, [(None, f"{p}.mlp.down_proj")], r, 2) for r in range(2)]
    partial = sum(layer.quant_method.apply(layer, xd[:, r * 256:(r + 1) * 256]).float() for r, layer in enumerate(down))
    want = _reference(ckpt, f"{p}.mlp.down_proj", xd, None).float()
    assert ((partial - want).norm() / want.norm()) < 2e-3


def test_tp_slice_must_be_128_aligned(tmp_path):
    from sglang.srt.layers.linear import QKVParallelLinear, RowParallelLinear

    path = _tp_ckpt(tmp_path)  # 4 heads of 64, 2 KV heads: at tp=2 each rank holds 64 k/v columns
    _, cfg = exl3_config(path)
    ckpt = load_checkpoint(path)
    p = "model.layers.0.self_attn"
    with pytest.raises(Exl3SliceError, match=r"k_proj: output slice \[64, 128\) of 128 is not 128-aligned"):
        _load_layer(lambda c: QKVParallelLinear(256, 64, 4, 2, bias=False, quant_config=c, prefix=f"{p}.qkv_proj",
                                                tp_rank=1, tp_size=2),
                    cfg, ckpt, [(s, f"{p}.{s}_proj") for s in "qkv"], 1, 2)
    with pytest.raises(Exl3SliceError, match=r"o_proj: input slice \[64, 128\) of 256 is not 128-aligned"):
        _load_layer(lambda c: RowParallelLinear(256, 256, bias=False, quant_config=c, prefix=f"{p}.o_proj",
                                                tp_rank=1, tp_size=4, reduce_results=False),
                    cfg, ckpt, [(None, f"{p}.o_proj")], 1, 4)


def test_missing_marker_is_a_load_time_error(tmp_path):
    from sglang.srt.layers.linear import RowParallelLinear

    path = _tp_ckpt(tmp_path)
    _, cfg = exl3_config(path)
    ckpt = load_checkpoint(path)
    key = "model.layers.0.mlp.down_proj"
    cfg._checked_claims = True  # a lone layer, not a whole model
    layer = RowParallelLinear(512, 256, bias=False, quant_config=cfg, prefix=key, reduce_results=False)
    for suffix in ("trellis", "suh", "svh"):  # the .mcg marker never arrives
        layer.__getattr__(suffix).weight_loader(getattr(layer, suffix), ckpt.load_tensor(f"{key}.{suffix}"))
    with pytest.raises(ValueError, match=r"Missing or inconsistent EXL3 tensors for model.layers.0.mlp.down_proj.*"
                                         r"missing \['mcg'\]"):
        process(layer)


def test_mixed_packed_sources_are_rejected(tmp_path):
    from sglang.srt.layers.linear import MergedColumnParallelLinear

    path = _tp_ckpt(tmp_path)
    _, cfg = exl3_config(path)
    del cfg.checkpoint.modules["model.layers.0.mlp.up_proj"]
    with pytest.raises(ValueError, match="mixes EXL3 and unquantized source shards"):
        MergedColumnParallelLinear(256, [512, 512], bias=False, quant_config=cfg,
                                   prefix="model.layers.0.mlp.gate_up_proj")


def test_truncated_shard_stops_the_load_naming_the_file(tmp_path):
    """SGLang builds the quantization config before it builds the model, so a partial download stops the server at
    startup (never mid-serve), with the file named as truncated."""
    import shutil

    from sglang_exl3.format import Exl3FormatError

    path = tmp_path / "partial"
    shutil.copytree(DENSE_CKPTS[0], path, ignore=shutil.ignore_patterns("oracle"))
    shard = path / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:len(shard.read_bytes()) // 2])
    with pytest.raises(Exl3FormatError, match=r"model.safetensors, tensor .*: the tensor's data ends at byte .* but "
                                              r"the file holds .* bytes: the file is truncated"):
        exl3_config(path)


def test_bad_knob_fails_model_load(monkeypatch):
    from sglang_exl3.knobs import KnobError

    monkeypatch.setenv("SGLANG_EXL3_BACKEND", "cuda-magic")
    with pytest.raises(KnobError, match="SGLANG_EXL3_BACKEND must be one of auto, cuda, exllamav3, torch"):
        exl3_config(DATA / "exllamav3" / DENSE_CKPTS[0].name)


def test_unclaimed_exl3_module_is_a_load_time_error(tmp_path):
    """An EXL3 matrix no SGLang layer loads would be silently skipped by SGLang's loaders."""
    from sglang.srt.layers.linear import RowParallelLinear

    path = _tp_ckpt(tmp_path)
    _, cfg = exl3_config(path)
    ckpt = load_checkpoint(path)
    key = "model.layers.0.mlp.down_proj"
    layer = RowParallelLinear(512, 256, bias=False, quant_config=cfg, prefix=key, reduce_results=False)
    for suffix in ("trellis", "suh", "svh", "mcg"):
        getattr(layer, suffix).weight_loader(getattr(layer, suffix), ckpt.load_tensor(f"{key}.{suffix}"))
    with pytest.raises(ValueError, match=r"EXL3 module\(s\) of .* have no EXL3 layer in the SGLang model"):
        process(layer)  # only down_proj was built: q/k/v/o/gate/up of layer 0 are unclaimed


def test_layer_apply_traces_under_torch_compile_fullgraph():
    """SGLang's tc_piecewise / --enable-torch-compile trace linear layers with fullgraph=True and a
    dynamic token count: the EXL3 apply must not break the graph."""
    model, _ = load_model(DENSE_CKPTS[0])
    layer = model.model.layers[0].self_attn.qkv_proj
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: layer.quant_method.apply(layer, x), fullgraph=True, dynamic=True,
                             backend="eager")
    for m in (1, 3, 17):
        x = torch.randn(m, 256).to(torch.bfloat16)
        assert torch.equal(compiled(x), layer.quant_method.apply(layer, x))


def test_qwen2_qkv_bias(tmp_path):
    """Qwen2's q/k/v biases live in the EXL3 modules; SGLang's own bias parameter loads them and
    the EXL3 apply adds them."""
    from sglang_exl3.synth.exl3_writer import ModelDims, write_exl3_checkpoint

    path = write_exl3_checkpoint(tmp_path / "q2", "qwen2", dims=ModelDims(num_hidden_layers=1), bits=4,
                                 codebook="mul1", with_tokenizer=False)
    model, _ = load_model(path)
    ckpt = load_checkpoint(path)
    layer = model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(4, 256).to(torch.bfloat16)
    y, _ = layer(x)
    p = "model.layers.0.self_attn"
    want = torch.cat([_reference(ckpt, f"{p}.{s}_proj", x, None).float()
                      + ckpt.load_tensor(f"{p}.{s}_proj.bias").float() for s in "qkv"], dim=-1)
    assert ((y.float() - want).norm() / want.norm()) < 1e-2


def _rank_sliced_folder(tmp_path, **tail_overrides):
    import json

    from sglang_exl3.format.rank_sliced import TENSOR_SCHEMA
    from sglang_exl3.synth.exl3_writer import ModelDims, hf_config

    cfg = hf_config("qwen3_moe", ModelDims(num_hidden_layers=1))
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8"}  # what the rest uses
    cfg["hybrid_tr3_tail"] = {"format": "exl3-trellis", "bits": 3, "codebook": "mcg", "experts_per_layer": 4,
                              "moe_layers": [0, 0], "tensor_schema": TENSOR_SCHEMA, "tp": 1, **tail_overrides}
    path = tmp_path / "rank-sliced"
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def test_rank_sliced_metadata_is_claimed_and_validated_at_load(tmp_path):
    """hybrid_tr3_tail makes a checkpoint EXL3 although quantization_config says modelopt (else its experts
    would silently load as modelopt), and its metadata is validated when the quantization config is built."""
    from sglang.srt.configs.model_config import ModelConfig

    from sglang_exl3.format.rank_sliced import RankSlicedError
    from sglang_exl3.layers.exl3_config import Exl3Config

    config = ModelConfig(_rank_sliced_folder(tmp_path))
    assert config.quantization == "exl3"
    parsed = config._parse_quant_hf_config()
    assert parsed["quant_method"] == "exl3" and parsed["checkpoint_quant_method"].startswith("modelopt")
    bad = ModelConfig(_rank_sliced_folder(tmp_path / "b", codebook="mul1"))
    with pytest.raises(RankSlicedError, match="requires the MCG codebook"):
        Exl3Config.from_config({**bad._parse_quant_hf_config(), "hf_config": bad.hf_config})


MIXED = {0: [3, 5, 3, 4], 1: [4, 4, 2, 3]}


@pytest.mark.parametrize("layout, mixed", [("per_expert_v1", False), ("shared_h_v1", False), ("shared_h_v1", True)])
def test_rank_sliced_checkpoint_loads_and_matches_its_slices(tmp_path, layout, mixed):
    """A rank-sliced Qwen3-MoE checkpoint (the reference layout, written by the project's writer) through SGLang's
    real model class and loader: every MoE layer's output equals the codec run on this rank's .rank0 slices
    (with the layer's shared hidden-side rotations under shared_h_v1, and per-expert bitrates from the
    bits_per_expert map when mixed); the rest is per-module EXL3."""
    from sglang_exl3.synth.exl3_writer import ModelDims
    from sglang_exl3.synth.rank_sliced_writer import write_rank_sliced_checkpoint

    path = write_rank_sliced_checkpoint(tmp_path / "rs", dims=ModelDims(num_hidden_layers=2), bits=3, tp=1,
                                        rotation_layout=layout, seed=3, expert_bits=MIXED if mixed else None)
    model, cfg = load_as_server(path)
    if mixed:
        assert cfg.rank_sliced.bits == "mixed"
        recs = model.model.layers[1].mlp.experts.quant_method.records
        assert [recs[(e, "w2")].bits for e in range(4)] == MIXED[1]
    assert cfg.rank_sliced is not None and cfg.rank_sliced_rank == 0
    _check_moe_against_slices(model, path, layout)


def _check_moe_against_slices(model, path, layout):
    from test_sglang_moe import _dispatch

    ckpt = load_checkpoint(path)

    def t(name):
        return ckpt.load_tensor(name)

    def expert(layer, e, proj, x):
        base = f"model.layers.{layer}.mlp.experts.{e}.{proj}.rank0"
        side = "svh" if proj == "down_proj" else "suh"
        shared = f"model.layers.{layer}.mlp.experts.shared_h.{proj}.rank0.{side}"
        rot = {f: t(shared if layout == "shared_h_v1" and f == side else f"{base}.{f}") for f in ("suh", "svh")}
        return exl3_linear_reference(x, t(f"{base}.trellis"), rot["suh"], rot["svh"], Codebook.MCG).float()

    gen = torch.Generator().manual_seed(1)
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        assert type(experts.quant_method).__name__ == "Exl3MoEMethod" and experts.quant_method.pre_sliced
        x = torch.randn(5, 256, generator=gen).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(5)]).to(torch.int32)
        w = torch.rand(5, 2, generator=gen)
        out = experts.quant_method.apply(experts, _dispatch(x, w, ids)).hidden_states
        want = torch.zeros(5, 256)
        for r in range(5):
            xr = x[r:r + 1].half()
            for k in range(2):
                e = int(ids[r, k])
                h = (torch.nn.functional.silu(expert(i, e, "gate_proj", xr)) * expert(i, e, "up_proj", xr)).half()
                want[r] += w[r, k] * expert(i, e, "down_proj", h)[0]
        assert ((out.float() - want).norm() / want.norm()) < 1e-2, (layout, i)


def _hybrid_checkpoint(tmp_path, extra: dict | None = None):
    """What the reference's hybrid checkpoints look like: rank-sliced EXL3 routed experts, every other layer in
    plain BF16, quantization_config naming another method (modelopt), no per-module sidecar."""
    import json

    from safetensors.torch import load_file, save_file

    from sglang_exl3.format.rank_sliced import RANK_SLICED_WEIGHT_RE, SHARED_H_WEIGHT_RE
    from sglang_exl3.synth.exl3_writer import ModelDims
    from sglang_exl3.synth.rank_sliced_writer import write_rank_sliced_checkpoint
    from sglang_exl3.tools.dequantize import dequantize_checkpoint

    rs = write_rank_sliced_checkpoint(tmp_path / "rs", dims=ModelDims(num_hidden_layers=2), bits=3, tp=1,
                                      rotation_layout="shared_h_v1", seed=8, with_tokenizer=True)
    dequantize_checkpoint(rs, tmp_path / "dq", dtype="bfloat16", progress=False)
    dense = load_file(str(tmp_path / "dq" / "model.safetensors"))
    sliced = load_file(str(rs / "model.safetensors"))
    tensors = {n: t for n, t in dense.items() if ".mlp.experts." not in n}
    tensors.update({n: t for n, t in sliced.items() if RANK_SLICED_WEIGHT_RE.match(n) or SHARED_H_WEIGHT_RE.match(n)})
    tensors.update(extra or {})
    out = tmp_path / "hybrid"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((rs / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8"}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_hybrid_checkpoint_serves_its_plain_layers_unquantized(tmp_path):
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    path = _hybrid_checkpoint(tmp_path)
    model, cfg = load_as_server(path)
    assert not cfg.checkpoint.modules  # no per-module EXL3 at all
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj.quant_method, UnquantizedLinearMethod)
    from safetensors.torch import load_file

    q = load_file(str(tmp_path / "dq" / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(attn.qkv_proj.weight[: q.shape[0]].to(q.dtype), q)  # the plain BF16 weight, loaded as is
    _check_moe_against_slices(model, path, "shared_h_v1")


def test_hybrid_checkpoint_with_foreign_quantized_layers_is_refused(tmp_path):
    from sglang_exl3.format import Exl3FormatError

    path = _hybrid_checkpoint(tmp_path, {"model.layers.0.self_attn.q_proj.weight_scale": torch.ones(1)})
    with pytest.raises(Exl3FormatError, match=r"quantized in another format.*weight_scale"):
        load_as_server(path)


def test_rank_sliced_bitrate_disagreeing_with_the_map_is_refused_at_load(tmp_path):
    import json

    from sglang_exl3.format.rank_sliced import RankSlicedError
    from sglang_exl3.synth.exl3_writer import ModelDims
    from sglang_exl3.synth.rank_sliced_writer import write_rank_sliced_checkpoint

    path = write_rank_sliced_checkpoint(tmp_path / "rs", dims=ModelDims(num_hidden_layers=1), bits=3, tp=1,
                                        expert_bits={0: [3, 4, 3, 4]})
    (path / "expert_bits.json").write_text(json.dumps({"0": {"k": [3, 3, 3, 4]}}))  # expert 1 is really K=4
    with pytest.raises(RankSlicedError, match=r"experts\.1\.gate_proj\.rank0\.trellis: 4 bits .* expert 1 of "
                                              r"layer 0 has K=3"):
        load_as_server(path)


def test_rank_sliced_records_of_rank_1_are_its_own_slices(tmp_path):
    """At tp=2, rank 1's records point at the .rank1 tensors, each half the intermediate size."""
    from sglang_exl3.format.rank_sliced import expert_records, parse
    from sglang_exl3.synth.exl3_writer import ModelDims
    from sglang_exl3.synth.rank_sliced_writer import write_rank_sliced_checkpoint

    path = write_rank_sliced_checkpoint(tmp_path / "rs", dims=ModelDims(num_hidden_layers=1), bits=3, tp=2,
                                        rotation_layout="shared_h_v1")
    ckpt = load_checkpoint(path)
    records = expert_records(ckpt.tensors, parse(ckpt.config, path), "model.layers.0.mlp.experts", 0, rank=1)
    assert len(records) == 4 * 3
    gate, down = records[(2, "w1")], records[(2, "w2")]
    assert gate.out_features == 128 and gate.in_features == 256 and down.in_features == 128
    assert gate.tensors["trellis"].name == "model.layers.0.mlp.experts.2.gate_proj.rank1.trellis"
    assert gate.tensors["suh"].name == "model.layers.0.mlp.experts.shared_h.gate_proj.rank1.suh"
    assert down.tensors["svh"].name == "model.layers.0.mlp.experts.shared_h.down_proj.rank1.svh"
    assert down.tensors["suh"].name == "model.layers.0.mlp.experts.2.down_proj.rank1.suh"


def test_rank_sliced_checkpoint_for_another_tp_is_refused_at_load(tmp_path):
    from sglang_exl3.format.rank_sliced import RankSlicedError
    from sglang_exl3.synth.exl3_writer import ModelDims
    from sglang_exl3.synth.rank_sliced_writer import write_rank_sliced_checkpoint

    path = write_rank_sliced_checkpoint(tmp_path / "rs", dims=ModelDims(num_hidden_layers=1), bits=3, tp=2)
    with pytest.raises(RankSlicedError, match=r"TP does not match runtime.*tp=2.*tp=1.*--tp 2"):
        load_as_server(path)


def test_rank_sliced_checkpoint_is_not_claimed_when_the_user_asks_for_another_method(tmp_path):
    from sglang.srt.configs.model_config import ModelConfig

    path = _rank_sliced_folder(tmp_path)
    try:
        quantization = ModelConfig(path, quantization="modelopt_fp8").quantization
    except ValueError:  # SGLang's own check of the user's method against the checkpoint
        return
    assert quantization != "exl3"


def test_rank_sliced_tensors_without_their_claim_fail_at_load(tmp_path):
    """SGLang's loader builds the quantization config from hf_config.quantization_config, which lacked the
    hybrid_tr3_tail claim: the `.rank{r}` expert tensors then matched no layer, the experts were built unquantized
    and the server answered NaN. The server's path now carries the claim (first half); a config
    that still arrives without it stops the load, naming what is missing (second half)."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import _get_quantization_config

    from sglang_exl3.format.rank_sliced import RankSlicedError
    from sglang_exl3.layers.exl3_config import Exl3Config
    from sglang_exl3.synth.exl3_writer import ModelDims
    from sglang_exl3.synth.rank_sliced_writer import write_rank_sliced_checkpoint

    path = write_rank_sliced_checkpoint(tmp_path / "rs", dims=ModelDims(num_hidden_layers=2), bits=3, tp=1,
                                        rotation_layout="shared_h_v1", seed=3)
    assert _get_quantization_config(ModelConfig(str(path)), LoadConfig()).rank_sliced is not None
    with pytest.raises(RankSlicedError, match="received no hybrid_tr3_tail"):
        Exl3Config.from_config({"quant_method": "exl3", "model_path": str(path)})


def test_rank_sliced_layers_without_the_exl3_moe_method_fail_at_load(tmp_path):
    """After loading, every built layer whose rank-sliced experts the checkpoint holds must run them as EXL3: a layer
    SGLang built otherwise (a dense MLP there, an MoE class the plugin does not know) has its expert tensors skipped
    by the loader. The loader hook runs this check; here it also runs on a model with one MoE layer's EXL3 experts
    taken away, which it must name."""
    from sglang_exl3.format.rank_sliced import RankSlicedError
    from sglang_exl3.synth.exl3_writer import ModelDims
    from sglang_exl3.synth.rank_sliced_writer import write_rank_sliced_checkpoint

    path = write_rank_sliced_checkpoint(tmp_path / "rs", dims=ModelDims(num_hidden_layers=2), bits=3, tp=1,
                                        rotation_layout="shared_h_v1", seed=3)
    model, cfg = load_as_server(path)
    cfg.check_rank_sliced_layers(model)
    del model.model.layers[1].mlp.experts.exl3_experts
    with pytest.raises(RankSlicedError, match=r"layers \[1\] hold rank-sliced EXL3 experts"):
        cfg.check_rank_sliced_layers(model)
