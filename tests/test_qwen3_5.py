"""Qwen3.5 (dense, text) in exllamav3's layout through SGLang's own classes: the target (`Qwen3_5ForCausalLM`: Gated
DeltaNet and gated full attention) and its MTP draft (`Qwen3_5ForCausalLMMTP`, what `--speculative-algorithm NEXTN`
builds), each against the same checkpoint dequantized to fp16, loaded the same way.

exllamav3 stores the trunk under `model.language_model.*`, one `in_proj_qkv` matrix for three outputs of SGLang's
`in_proj_qkvz` (shard id (0, 1, 2)) and, at its default `--mtp_bits 4`, an EXL3 `mtp.fc` where SGLang's draft builds
a plain `nn.Linear`: each must load, and compute what the twin computes.
"""

from __future__ import annotations

import pytest
import torch
from twin_checks import exl3_linears, exl3_moe_layers, moe_against_twin, plain_tensors_identical, rel

from sglang_cpu import draft_hand_over, load_as_server, process, sglang_runtime
from sglang_exl3.format import load_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
REL_TOL = 1e-2  # the twin holds fp16 weights; ours decode and rotate with fp16 roundings of their own


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime()


# the text class, and the VL class Qwen3.5 releases name (a vision tower, unquantized as exllamav3 keeps it by default)
TARGETS = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_vl": "Qwen3_5ForConditionalGeneration",
           "qwen3_5_moe": "Qwen3_5MoeForCausalLM", "qwen3_5_moe_vl": "Qwen3_5MoeForConditionalGeneration"}


def _write(path, mtp_bits, arch="qwen3_5", **extra):
    from sglang_exl3.synth.exl3_writer import ModelDims, write_exl3_checkpoint

    return write_exl3_checkpoint(path, arch, dims=ModelDims(extra=extra), bits=4, codebook="mul1", mtp_bits=mtp_bits)


@pytest.fixture(scope="module", params=list(TARGETS))
def models(request, tmp_path_factory):
    """(target, draft, twin target, twin draft) of a two-layer Qwen3.5 (linear attention, then full attention) with
    its MTP block at 4 bits."""
    from sglang_exl3.tools.dequantize import dequantize_checkpoint

    root = tmp_path_factory.mktemp(request.param)
    path = _write(root / "exl3", mtp_bits=4, arch=request.param)
    dequantize_checkpoint(path, root / "twin", dtype="float16", progress=False)
    target, cfg = load_as_server(path)
    draft, draft_cfg = load_as_server(path, draft=True)
    twin, twin_cfg = load_as_server(root / "twin")
    twin_draft, _ = load_as_server(root / "twin", draft=True)
    assert cfg is not None and draft_cfg is not None and twin_cfg is None
    return target, draft, twin, twin_draft


def _exl3_layers_equal_the_twin(model, twin) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    checked = []
    for name, layer, weight in exl3_linears(model, twin):
        x = torch.randn(5, weight.shape[1], generator=gen).half()
        got = layer.quant_method.apply(layer, x).float()
        assert got.shape[1] == weight.shape[0], name
        assert rel(got, x.float() @ weight.float().T) < REL_TOL, (name, rel(got, x.float() @ weight.float().T))
        checked.append(name)
    return checked


def _experts_equal_the_twin(model, twin) -> list[str]:
    """Every EXL3 MoE layer computes the twin's experts on the same routing (rows 1 and 6)."""
    gen = torch.Generator().manual_seed(1)
    checked = []
    for name, experts, theirs in exl3_moe_layers(model, twin):
        for m in (1, 6):
            got, want = moe_against_twin(experts, theirs, m, torch.float16, gen, "cpu")
            assert rel(got, want) < REL_TOL, (name, m, rel(got, want))
        checked.append(name)
    return checked


def test_the_target_computes_what_its_twin_computes(models):
    target, _, twin, _ = models
    assert type(target).__name__ in TARGETS.values()
    checked = _exl3_layers_equal_the_twin(target, twin)
    assert {"model.layers.0.linear_attn.in_proj_qkvz", "model.layers.0.linear_attn.out_proj",
            "model.layers.1.qkv_proj", "model.layers.1.o_proj", "lm_head"} <= set(checked)
    moe = "Moe" in type(target).__name__
    down = "mlp.shared_expert.down_proj" if moe else "mlp.down_proj"
    assert {f"model.layers.0.{down}", f"model.layers.1.{down}"} <= set(checked)
    assert _experts_equal_the_twin(target, twin) == (["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
                                                     if moe else [])
    qkvz = target.model.layers[0].linear_attn.in_proj_qkvz
    assert [s.key.rsplit(".", 1)[1] for s in qkvz.exl3_shards] == ["in_proj_qkv", "in_proj_z"]
    plain = plain_tensors_identical(target, twin)  # the layers the checkpoint keeps unquantized, loaded as stored
    for name in ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.conv1d.weight",
                 "linear_attn.in_proj_ba.weight", "linear_attn.norm.weight"):
        assert f"model.layers.0.{name}" in plain, name
    if type(target).__name__ == TARGETS["qwen3_5_vl"]:
        assert {"visual.blocks.0.attn.qkv_proj.weight", "visual.merger.linear_fc2.bias"} <= set(plain)
    assert not any(n.startswith("mtp") or ".fc." in n for n, _ in target.named_parameters())


def test_the_mtp_draft_computes_what_its_twin_computes(models):
    from sglang_exl3.layers.plain_linear import Exl3PlainLinear

    _, draft, _, twin_draft = models
    assert type(draft).__name__ == "Qwen3_5ForCausalLMMTP"
    assert isinstance(draft.fc, Exl3PlainLinear) and type(twin_draft.fc) is torch.nn.Linear
    checked = _exl3_layers_equal_the_twin(draft, twin_draft)
    moe = "moe" in draft.config.model_type
    down = "mlp.shared_expert.down_proj" if moe else "mlp.down_proj"
    assert {"fc", "model.layers.0.qkv_proj", f"model.layers.0.{down}"} <= set(checked)
    assert _experts_equal_the_twin(draft, twin_draft) == (["model.layers.0.mlp.experts"] if moe else [])
    x = torch.randn(3, 2 * draft.config.hidden_size).half()
    got = draft.fc(x)  # called as the class calls its nn.Linear: the output alone
    assert isinstance(got, torch.Tensor) and rel(got, twin_draft.fc(x.float())) < REL_TOL
    # the embedding and head are the target's, handed over by SGLang's draft worker (the MTP loader reads neither)
    plain = plain_tensors_identical(draft, twin_draft, skip=("model.embed_tokens.weight", "lm_head.weight"))
    assert {"pre_fc_norm_hidden.weight", "pre_fc_norm_embedding.weight", "model.norm.weight"} <= set(plain)


def test_the_draft_takes_the_targets_exl3_head(models, monkeypatch):
    """The MTP loader reads no `lm_head.*`: the draft's head is a placeholder until the hand-over gives it the target's
    head module, and refuses to compute before."""
    from sglang_exl3.layers.qwen3_5_mtp import MtpError

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)  # the class's set_embed_and_head syncs CUDA

    target, draft, _, _ = models
    assert type(draft.lm_head.quant_method).__name__ == "TargetHeadMethod" and draft.lm_head.weight.numel() == 0
    with pytest.raises(MtpError, match="set_lm_head_from_target"):
        draft.lm_head.quant_method.apply(draft.lm_head, torch.zeros(1, draft.config.hidden_size))
    draft_hand_over(target, draft, with_head=True)
    assert draft.lm_head is target.lm_head


def test_mtp_stored_unquantized_keeps_the_plain_fc(tmp_path):
    """exllamav3 --mtp_bits 16: the whole block in 16 bits; the draft's own nn.Linear loads it."""
    from safetensors.torch import load_file

    path = _write(tmp_path / "c", mtp_bits=16)
    draft, _ = load_as_server(path, draft=True)
    assert type(draft.fc) is torch.nn.Linear
    assert torch.equal(draft.fc.weight, load_file(str(path / "model.safetensors"))["mtp.fc.weight"].float())
    assert not any(hasattr(m, "exl3_shards") for m in draft.modules())


def test_nextn_without_the_mtp_block_names_the_missing_tensors(tmp_path):
    from sglang_exl3.layers.qwen3_5_mtp import MtpError

    path = _write(tmp_path / "c", mtp_bits=None)
    with pytest.raises(MtpError, match=r"lacks \['mtp\.fc', 'mtp\.pre_fc_norm_hidden\.weight'.*--mtp_bits"):
        load_as_server(path, draft=True)
    target, _ = load_as_server(path)  # the target alone serves
    assert type(target).__name__ == "Qwen3_5ForCausalLM"


def test_in_proj_qkvz_at_tp2_keeps_each_ranks_heads(tmp_path):
    """Tensor parallelism cuts each of q, k, v and z per rank: one checkpoint matrix (in_proj_qkv) becomes three
    column slices of it, each on 128-element boundaries."""
    from sglang.srt.layers.linear import MergedColumnParallelLinear
    from sglang.srt.runtime_context import get_parallel

    from sglang_cpu import exl3_config
    from sglang_exl3.codec import exl3_linear_reference

    path = _write(tmp_path / "c", mtp_bits=None, linear_num_key_heads=4)  # key_dim 256, value_dim 256
    _, cfg = exl3_config(path)
    cfg._checked_claims = True  # a lone layer: the rest of the checkpoint is unclaimed on purpose
    ckpt = load_checkpoint(path)
    stem = "model.language_model.layers.0.linear_attn"
    x = torch.randn(3, 256, dtype=torch.float16)
    ref = {s: exl3_linear_reference(x, *(ckpt.load_module(f"{stem}.{s}")[k] for k in ("trellis", "suh", "svh")),
                                    ckpt.modules[f"{stem}.{s}"].codebook) for s in ("in_proj_qkv", "in_proj_z")}
    q, k, v = ref["in_proj_qkv"].split([256, 256, 256], dim=-1)
    for rank in range(2):
        with get_parallel().override(tp_size=2, tp_rank=rank):
            layer = MergedColumnParallelLinear(256, [256, 256, 256, 256], bias=False, quant_config=cfg,
                                               prefix="model.layers.0.linear_attn.in_proj_qkvz", tp_rank=rank,
                                               tp_size=2)
        for shard_id, source in (((0, 1, 2), "in_proj_qkv"), (3, "in_proj_z")):
            for suffix, info in ckpt.modules[f"{stem}.{source}"].tensors.items():
                param = getattr(layer, suffix)
                param.weight_loader(param, ckpt.load_tensor(info.name), shard_id)
        process(layer)
        cut = slice(rank * 128, (rank + 1) * 128)
        want = torch.cat([q[:, cut], k[:, cut], v[:, cut], ref["in_proj_z"][:, cut]], dim=-1)
        assert torch.equal(layer.quant_method.apply(layer, x), want), rank


def test_a_source_that_does_not_cover_whole_outputs_is_refused(tmp_path):
    from sglang_exl3.layers.linear import merged_sources

    records = load_checkpoint(_write(tmp_path / "c", mtp_bits=None)).modules
    stem = "model.language_model.layers.0.linear_attn"
    sources = {0: records[f"{stem}.in_proj_qkv"], 1: records[f"{stem}.in_proj_z"]}
    assert [(sid, parts) for sid, _, parts in merged_sources([128, 128, 256, 256], sources, "x")] == \
        [((0, 1, 2), [128, 128, 256]), (3, [256])]
    with pytest.raises(ValueError, match=r"in_proj_qkv has 512 output columns, which do not cover whole outputs"):
        merged_sources([384, 384, 256], sources, "x")
    with pytest.raises(ValueError, match=r"cover outputs \[128, 128, 256, 256\] of"):
        merged_sources([128, 128, 256, 256, 128], sources, "x")


@pytest.mark.parametrize("moe, vl", [(False, False), (True, False), (False, True)], ids=["dense", "moe", "vl"])
def test_the_converters_input_layout_loads_as_a_bf16_model(tmp_path, moe, vl):
    """A BF16 Qwen3.5 under `model.language_model.*` (exllamav3's layout, and the GPU step's converter input) loads in
    SGLang's text class with the plugin's rename (or its VL class), and its MTP block in the draft class."""
    from safetensors.torch import load_file

    from sglang_exl3.synth.hf_models import make_qwen3_5_source

    src = make_qwen3_5_source(tmp_path / "src", moe=moe, vl=vl)
    stored = load_file(str(src / "model.safetensors"))
    target, cfg = load_as_server(src)
    assert cfg is None and type(target).__name__ == ("Qwen3_5ForConditionalGeneration" if vl else
                                                     "Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM")
    stem = "model.language_model.layers.0.linear_attn"
    want = torch.cat([stored[f"{stem}.in_proj_qkv.weight"], stored[f"{stem}.in_proj_z.weight"]]).float()
    assert torch.equal(target.model.layers[0].linear_attn.in_proj_qkvz.weight, want)
    assert torch.equal(target.model.norm.weight, stored["model.language_model.norm.weight"].float())
    if moe:  # the routed experts, gate rows then up rows, as the MoE layer holds them
        w13 = target.model.layers[1].mlp.experts.w13_weight[3]
        mlp = "model.language_model.layers.1.mlp.experts.3"
        want = torch.cat([stored[f"{mlp}.gate_proj.weight"], stored[f"{mlp}.up_proj.weight"]]).float()
        assert torch.equal(w13, want)
    draft, _ = load_as_server(src, draft=True)
    assert torch.equal(draft.fc.weight, stored["mtp.fc.weight"].float())


def test_a_quantized_vision_tower_is_refused_naming_the_fix(tmp_path):
    """exllamav3 --vision_bits 1-8 quantizes the tower, which SGLang's vision layers cannot take: refused at startup."""
    from conftest import mutate
    from sglang_exl3.format import Codebook
    from sglang_exl3.format.shards import storage_entry
    from sglang_exl3.synth.exl3_writer import random_exl3_linear

    path = _write(tmp_path / "c", mtp_bits=None, arch="qwen3_5_vl")
    key = "model.visual.blocks.0.mlp.linear_fc1"

    def quantize_tower(tensors, sidecar, config):
        parts = {f"{key}.{s}": t for s, t in random_exl3_linear(128, 128, 4, Codebook.MUL1,
                                                                torch.Generator().manual_seed(0)).items()}
        del tensors[f"{key}.weight"]
        tensors.update(parts)
        sidecar["tensor_storage"][key] = storage_entry(parts, 4, Codebook.MUL1)

    mutate(path, quantize_tower)
    want = r"1 vision-tower module\(s\) as EXL3 \(\['model\.visual\.blocks\.0\.mlp\.linear_fc1'\]\).*--vision_bits 16"
    with pytest.raises(ValueError, match=want):
        load_as_server(path)


def test_the_vl_sources_processor_is_what_sglangs_tokenizer_manager_builds(tmp_path):
    """A VL server builds its processor before any model (TokenizerManager.init_tokenizer_and_processor: the HF
    processor, then SGLang's multimodal processor for the architecture, then the tokenizer from the processor). On the
    tiny VL source exllamav3 converts (its tokenizer and preprocessor files travel to the EXL3 checkpoint unchanged),
    each of SGLang's own steps must succeed, or the GPU step's server never starts. (The CPU's ServerArgs refuse the
    radix cache's mamba buffer without FLA, so it is off here; the processors do not read it.)"""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.managers.multimodal_processor import get_mm_processor, import_processors
    from sglang.srt.managers.tokenizer_manager import _get_processor_wrapper
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer_from_processor

    from sglang_exl3.synth.hf_models import make_qwen3_5_source

    src = make_qwen3_5_source(tmp_path / "src", vl=True)
    args = ServerArgs(model_path=str(src), device="cpu", attention_backend="torch_native",
                      sampling_backend="pytorch", disable_radix_cache=True)
    config = ModelConfig(str(src))
    assert config.is_multimodal
    import_processors("sglang.srt.multimodal.processors")
    processor = _get_processor_wrapper(args)
    mm = get_mm_processor(config.hf_config, args, processor, "default", model_config=config)
    assert type(mm).__module__.startswith("sglang.srt.multimodal.processors.")
    tokenizer = get_tokenizer_from_processor(processor)
    assert len(tokenizer("To be, or not to be").input_ids) > 3
