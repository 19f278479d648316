"""Online encoding at load (SGLANG_EXL3_ONLINE_BITS): a BF16 checkpoint served with --quantization exl3 through
SGLang's own model class and loader. The selected linear runs the EXL3 forward on its encoded weights (within the
4-bit trellis distortion of the BF16 product), its BF16 weight is freed, and a second load reads the cache instead of
encoding; fused shards that are not whole 128-element blocks are zero-padded; routed experts are encoded into the EXL3
MoE method; a module pattern that selects nothing stops the load. (One 128x128 module: ~6 s of encoding on the CPU.)"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file

from sglang_cpu import load_as_server, sglang_runtime, small_bf16_llama

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
KEY = "model.layers.0.self_attn.o_proj"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return small_bf16_llama(tmp_path_factory.mktemp("online") / "bf16", seed=3)


@pytest.fixture
def online(monkeypatch, tmp_path):
    from sglang_exl3.layers.online_linear import online_cache

    monkeypatch.setenv("SGLANG_EXL3_ONLINE_BITS", "4")
    monkeypatch.setenv("SGLANG_EXL3_ONLINE_CACHE_DIR", str(tmp_path / "cache"))
    online_cache.cache_clear()
    yield monkeypatch
    online_cache.cache_clear()


def _o_proj(model):
    return model.model.layers[0].self_attn.o_proj


def test_a_selected_linear_is_encoded_then_read_from_the_cache(source, online, caplog):
    online.setenv("SGLANG_EXL3_ONLINE_MODULES", r"o_proj$")
    sglang_runtime()
    caplog.set_level(logging.INFO, logger="sglang_exl3.layers.online_linear")
    model, _ = load_as_server(source, quantization="exl3")
    layer = _o_proj(model)
    assert layer.exl3_online and layer.weight.numel() == 0 and f"{KEY} 128x128 at 4 bits: encoded" in caplog.text
    assert "EXL3 online: 1/1 linears (0 from the cache)" in caplog.text
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want = x.float() @ load_file(str(source / "model.safetensors"))[f"{KEY}.weight"].float().t()
    got = layer.quant_method.apply(layer, x)
    assert float((got.float() - want).norm() / want.norm()) < 0.09
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert not getattr(qkv, "exl3_online", False) and qkv.weight.numel() > 0  # not selected: BF16

    caplog.clear()
    again, _ = load_as_server(source, quantization="exl3")
    assert f"{KEY} 128x128 at 4 bits: hit" in caplog.text
    assert torch.equal(_o_proj(again).quant_method.apply(_o_proj(again), x), got)


def test_shards_that_are_not_whole_blocks_are_padded(source, online):
    """q / k / v of 128 / 64 / 64 rows: k and v are zero-padded to 128 before encoding, their outputs trimmed."""
    online.setenv("SGLANG_EXL3_ONLINE_MODULES", r"qkv_proj$")
    sglang_runtime()
    model, _ = load_as_server(source, quantization="exl3")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.exl3_online and [s.out_features for s in qkv.exl3_shards] == [128, 64, 64]
    assert [tuple(s.trellis.shape[:2]) for s in qkv.exl3_shards] == [(8, 8)] * 3
    w = load_file(str(source / "model.safetensors"))
    weight = torch.cat([w[f"model.layers.0.self_attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj")])
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(2))
    got = qkv.quant_method.apply(qkv, x).float()
    want = x @ weight.float().t()
    assert got.shape == (4, 256) and float((got - want).norm() / want.norm()) < 0.09


def test_a_fused_shard_is_encoded_as_the_offline_encoder_encodes_its_module(source, online):
    """k_proj inside qkv_proj is keyed and seeded by its own checkpoint name, so the online shard equals what
    `python -m sglang_exl3 encode` writes for model.layers.0.self_attn.k_proj: one model, one encoding."""
    from sglang_exl3.format.constants import Codebook
    from sglang_exl3.tools.encode_checkpoint import encode_module

    online.setenv("SGLANG_EXL3_ONLINE_MODULES", r"qkv_proj$")
    sglang_runtime()
    model, _ = load_as_server(source, quantization="exl3")
    shard = model.model.layers[0].self_attn.qkv_proj.exl3_shards[1]
    key = "model.layers.0.self_attn.k_proj"
    offline = encode_module(load_file(str(source / "model.safetensors"))[f"{key}.weight"], None, key, 4,
                            Codebook.MCG, "cpu")
    assert shard.key == key
    for name in ("trellis", "suh", "svh"):
        assert torch.equal(getattr(shard, name).cpu(), offline[f"{key}.{name}"]), name


def test_a_pattern_that_selects_nothing_stops_the_load(source, online):
    online.setenv("SGLANG_EXL3_ONLINE_MODULES", r"no_such_module")
    sglang_runtime()
    with pytest.raises(ValueError, match="no linear of the model was selected"):
        load_as_server(source, quantization="exl3")


def test_routed_experts_are_encoded_into_the_exl3_moe_method(online, tmp_path):
    """A Qwen3-MoE layer's two experts (gate, up, down of 128x128 each) encoded at load and served by the EXL3 MoE
    method's own forward: within the 4-bit distortion of the BF16 experts (three projections deep)."""
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from sglang_exl3.synth.hf_models import make_random_hf_model

    path = make_random_hf_model("qwen3_moe", tmp_path / "moe", seed=4, hidden_size=128, intermediate_size=128,
                                moe_intermediate_size=128, num_experts=2, num_experts_per_tok=2,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_hidden_layers=1)
    online.setenv("SGLANG_EXL3_ONLINE_MODULES", r"experts$")
    sglang_runtime()
    model, _ = load_as_server(path, quantization="exl3")
    experts = model.model.layers[0].mlp.experts
    assert type(experts.quant_method).__name__ == "Exl3OnlineMoEMethod" and len(experts.exl3_experts) == 2
    assert experts.w13_weight.numel() == 0
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 128, generator=g)
    weights = torch.softmax(torch.randn(3, 2, generator=g), -1)
    ids = torch.tensor([[0, 1], [1, 0], [0, 1]])
    out = StandardDispatchOutput(hidden_states=x, hidden_states_scale=None,
                                 topk_output=StandardTopKOutput(weights, ids, torch.zeros(3, 2)))
    got = experts.quant_method.apply(experts, out).hidden_states.float()
    w = load_file(str(path / "model.safetensors"))
    want = torch.zeros(3, 128)
    for m in range(3):
        for j in range(2):
            p = f"model.layers.0.mlp.experts.{int(ids[m, j])}"
            gate, up, down = (w[f"{p}.{n}.weight"].float() for n in ("gate_proj", "up_proj", "down_proj"))
            h = torch.nn.functional.silu(x[m] @ gate.t()) * (x[m] @ up.t())
            want[m] += weights[m, j] * (h @ down.t())
    assert float((got - want).norm() / want.norm()) < 0.15


def _linears():
    from sglang.srt.layers.linear import QKVParallelLinear, RowParallelLinear

    return {"model.layers.0.self_attn.qkv_proj": QKVParallelLinear(128, 64, 2, 1, bias=False),
            "model.layers.0.self_attn.o_proj": RowParallelLinear(128, 128, bias=False),
            "model.layers.0.mlp.gate": RowParallelLinear(128, 128, bias=False)}


def _methods(monkeypatch, **env) -> dict[str, str]:
    from sglang_exl3.layers.exl3_config import Exl3Config

    for name in ("ONLINE_BITS", "ONLINE_MODULES", "ONLINE_FP8"):
        monkeypatch.delenv(f"SGLANG_EXL3_{name}", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(f"SGLANG_EXL3_{name}", value)
    sglang_runtime()
    cfg = Exl3Config()
    return {p: type(cfg.get_quant_method(layer, p)).__name__ for p, layer in _linears().items()}


def test_fp8_overlay_and_exl3_split_the_linears(monkeypatch):
    """SGLANG_EXL3_ONLINE_FP8 takes its linears to SGLang's FP8 method, ONLINE_BITS the rest to EXL3; routers stay
    BF16 whatever the patterns say."""
    got = _methods(monkeypatch, ONLINE_BITS="4", ONLINE_FP8=r"o_proj$", ONLINE_MODULES=r".")
    assert got == {"model.layers.0.self_attn.qkv_proj": "Exl3OnlineLinearMethod",
                   "model.layers.0.self_attn.o_proj": "Fp8LinearMethod",
                   "model.layers.0.mlp.gate": "UnquantizedLinearMethod"}
    assert _methods(monkeypatch, ONLINE_FP8=r"o_proj$")["model.layers.0.self_attn.qkv_proj"] == \
        "UnquantizedLinearMethod"  # FP8 alone: the rest stays BF16


def test_an_fp8_linear_whose_sizes_fp8_gemms_cannot_take_falls_back(monkeypatch, caplog):
    """FP8 GEMMs take multiples of 16: a 120-wide down_proj selected for FP8 goes to EXL3 when online encoding
    selects it (EXL3 pads any shape), else stays BF16; either way a warning names the layer and its size."""
    from sglang.srt.layers.linear import RowParallelLinear

    from sglang_exl3.layers.exl3_config import Exl3Config

    prefix = "model.layers.0.mlp.down_proj"
    caplog.set_level(logging.WARNING, logger="sglang_exl3.layers.exl3_config")
    for env, want in (({"ONLINE_FP8": "proj"}, "UnquantizedLinearMethod"),
                      ({"ONLINE_FP8": "proj", "ONLINE_BITS": "4"}, "Exl3OnlineLinearMethod")):
        _methods(monkeypatch, **env)
        method = Exl3Config().get_quant_method(RowParallelLinear(120, 128, bias=False), prefix)
        assert type(method).__name__ == want
        assert f"selects {prefix}, but FP8 GEMMs need whole multiples of 16 and its input size 120 per rank" \
            in caplog.text
    _methods(monkeypatch, ONLINE_FP8="proj")
    assert type(Exl3Config().get_quant_method(RowParallelLinear(128, 128, bias=False), prefix)).__name__ == \
        "Fp8LinearMethod"


def test_a_pattern_that_splits_a_fused_module_is_refused(monkeypatch):
    assert _methods(monkeypatch, ONLINE_BITS="4", ONLINE_MODULES=r"\.(q|k|v)_proj$")[
        "model.layers.0.self_attn.qkv_proj"] == "Exl3OnlineLinearMethod"  # all the fused parts: selected
    with pytest.raises(ValueError, match=r"SGLANG_EXL3_ONLINE_MODULES='q_proj\$' selects \['model.layers.0.self_attn"
                                         r".q_proj'\] but not .*k_proj.*v_proj.* one quantization scheme"):
        _methods(monkeypatch, ONLINE_BITS="4", ONLINE_MODULES=r"q_proj$")
