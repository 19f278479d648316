"""Qwen3.5 (dense and MoE, text and VL) in exllamav3 1.6.5's layout, for the EXL3 writer.

exllamav3 stores the trunk under `model.language_model.*` (its `Qwen3_5Model` for both the text and the VL
architecture), quantizes a Gated DeltaNet layer's `in_proj_qkv`, `in_proj_z` and `out_proj` and keeps `in_proj_b` /
`in_proj_a`, `conv1d`, `A_log`, `dt_bias` and the gated norm unquantized; full-attention layers carry a gated q
projection (2 x heads x head_dim: query and output gate interleaved per head) and q / k norms. An MoE layer is a
router, per-expert projections and a shared expert with its sigmoid gate. The MTP block (`mtp.*`) is written at
`mtp_bits`: `fc` (2H -> H) and the decoder layers' linears and experts EXL3, or all of it unquantized at 16
(exllamav3's `--mtp_bits 16`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from sglang_exl3.synth.moe_layout import linear_entry, sparse_mlp


@dataclass(frozen=True)
class Variant:
    architecture: str
    model_type: str  # the text config's (the VL config's own is this without `_text`)
    vl: bool  # the VL architecture (what Qwen3.5 releases name): the trunk plus a vision tower
    moe: bool


VARIANTS = {"qwen3_5": Variant("Qwen3_5ForCausalLM", "qwen3_5_text", False, False),
            "qwen3_5_vl": Variant("Qwen3_5ForConditionalGeneration", "qwen3_5_text", True, False),
            "qwen3_5_moe": Variant("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", False, True),
            "qwen3_5_moe_vl": Variant("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_text", True, True)}
# a one-block vision tower (exllamav3 keeps it unquantized unless --vision_bits is given)
TINY_VISION = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, num_position_embeddings=64,
                   patch_size=16, temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
                   hidden_act="gelu_pytorch_tanh", model_type="qwen3_5_vision", deepstack_visual_indexes=[])
TRUNK = "model.language_model"
# the tiny model's linear-attention shape: key_dim 128, value_dim 256, every projection whole 128-wide blocks
TINY_LINEAR_ATTENTION = dict(linear_num_key_heads=2, linear_key_head_dim=64, linear_num_value_heads=4,
                             linear_value_head_dim=64, linear_conv_kernel_dim=4)


def config_fields(arch: str, dims) -> dict:
    """config.json fields beyond the common ones (SGLang's Qwen3.5 config reads `full_attention_interval`)."""
    interval = dims.extra.get("full_attention_interval", 2)
    moe = dict(num_experts=dims.num_experts, num_experts_per_tok=dims.num_experts_per_tok,
               moe_intermediate_size=dims.moe_intermediate_size, norm_topk_prob=True,
               shared_expert_intermediate_size=dims.shared_expert_intermediate_size)
    return {**TINY_LINEAR_ATTENTION, **(moe if VARIANTS[arch].moe else {}), "full_attention_interval": interval,
            "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                            for i in range(dims.num_hidden_layers)],
            "mtp_num_hidden_layers": 1, "attn_output_gate": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}}


def vl_config(arch: str, text: dict) -> dict:
    """The VL architecture's config.json around a text config (Qwen3.5 releases: `text_config`, `vision_config`)."""
    outer = ("architectures", "quantization_config", "tie_word_embeddings", "bos_token_id", "eos_token_id",
             "pad_token_id", "dtype")
    vision = {**TINY_VISION, "out_hidden_size": text["hidden_size"]}
    variant = VARIANTS[arch]
    return {**{k: text[k] for k in outer if k in text}, "architectures": [variant.architecture],
            "model_type": variant.model_type.removesuffix("_text"),
            "text_config": {k: v for k, v in text.items() if k not in outer or k == "tie_word_embeddings"},
            "vision_config": vision, "image_token_id": text["vocab_size"] - 4, "video_token_id": text["vocab_size"] - 3,
            "vision_start_token_id": text["vocab_size"] - 6, "vision_end_token_id": text["vocab_size"] - 5}


def vision_plan(out_hidden: int) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """The tower's tensors under `model.visual.*`, unquantized ('param': stored under the key itself)."""
    v, p = TINY_VISION, "model.visual"
    hid, merged = v["hidden_size"], v["hidden_size"] * v["spatial_merge_size"] ** 2
    yield f"{p}.patch_embed.proj", "dense", (hid, v["in_channels"], v["temporal_patch_size"], v["patch_size"],
                                             v["patch_size"])
    yield f"{p}.patch_embed.proj.bias", "param", (hid,)
    yield f"{p}.pos_embed", "dense", (v["num_position_embeddings"], hid)
    linears = {"attn.qkv": (3 * hid, hid), "attn.proj": (hid, hid), "mlp.linear_fc1": (v["intermediate_size"], hid),
               "mlp.linear_fc2": (hid, v["intermediate_size"])}
    for i in range(v["depth"]):
        for name, shape in [("norm1", (hid,)), ("norm2", (hid,)), *linears.items()]:
            yield f"{p}.blocks.{i}.{name}", "norm" if len(shape) == 1 else "dense", shape
            yield f"{p}.blocks.{i}.{name}.bias", "param", (shape[0],)
    yield f"{p}.merger.norm", "norm", (hid,)
    yield f"{p}.merger.norm.bias", "param", (hid,)
    for name, shape in (("linear_fc1", (merged, merged)), ("linear_fc2", (out_hidden, merged))):
        yield f"{p}.merger.{name}", "dense", shape
        yield f"{p}.merger.{name}.bias", "param", (shape[0],)


def module_plan(arch: str, dims, mtp_bits: float | None) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """(module key, kind, shape) as in exl3_writer.module_plan; kind 'mtp' is EXL3 at mtp_bits. `mtp_bits` None: no MTP
    block (a checkpoint converted from a source without one)."""
    fields, moe = {**config_fields(arch, dims), **dims.extra}, VARIANTS[arch].moe
    h = dims.hidden_size
    if VARIANTS[arch].vl:
        yield from vision_plan(h)
    yield f"{TRUNK}.embed_tokens", "embed", (dims.vocab_size, h)
    for i, kind in enumerate(fields["layer_types"]):
        p = f"{TRUNK}.layers.{i}"
        yield f"{p}.input_layernorm", "norm", (h,)
        if kind == "linear_attention":
            yield from _gated_delta_net(f"{p}.linear_attn", h, fields)
        else:
            yield from _attention(f"{p}.self_attn", dims, "exl3")
        yield f"{p}.post_attention_layernorm", "norm", (h,)
        yield from _mlp(f"{p}.mlp", dims, "exl3", moe)
    yield f"{TRUNK}.norm", "norm", (h,)
    yield "lm_head", "head", (h, dims.vocab_size)
    if mtp_bits is None:
        return
    quantized = "mtp" if mtp_bits != 16 else "dense"
    yield "mtp.pre_fc_norm_hidden", "norm", (h,)
    yield "mtp.pre_fc_norm_embedding", "norm", (h,)
    yield ("mtp.fc", quantized, (2 * h, h)) if quantized == "mtp" else ("mtp.fc", "dense", (h, 2 * h))
    for i in range(fields["mtp_num_hidden_layers"]):
        p = f"mtp.layers.{i}"
        yield f"{p}.input_layernorm", "norm", (h,)
        yield from _attention(f"{p}.self_attn", dims, quantized)
        yield f"{p}.post_attention_layernorm", "norm", (h,)
        yield from _mlp(f"{p}.mlp", dims, quantized, moe)
    yield "mtp.norm", "norm", (h,)


def _attention(p: str, dims, kind: str):
    h, hd = dims.hidden_size, dims.head_dim
    q_out, kv_out = dims.num_attention_heads * hd, dims.num_key_value_heads * hd
    yield linear_entry(f"{p}.q_proj", kind, h, 2 * q_out)  # query and output gate
    yield linear_entry(f"{p}.k_proj", kind, h, kv_out)
    yield linear_entry(f"{p}.v_proj", kind, h, kv_out)
    yield linear_entry(f"{p}.o_proj", kind, q_out, h)
    yield f"{p}.q_norm", "norm", (hd,)
    yield f"{p}.k_norm", "norm", (hd,)


def _gated_delta_net(p: str, h: int, f: dict):
    key_dim = f["linear_num_key_heads"] * f["linear_key_head_dim"]
    value_dim = f["linear_num_value_heads"] * f["linear_value_head_dim"]
    heads = f["linear_num_value_heads"]
    yield f"{p}.A_log", "param", (heads,)
    yield f"{p}.dt_bias", "param", (heads,)
    yield f"{p}.conv1d", "dense", (2 * key_dim + value_dim, 1, f["linear_conv_kernel_dim"])
    yield f"{p}.in_proj_qkv", "exl3", (h, 2 * key_dim + value_dim)
    yield f"{p}.in_proj_z", "exl3", (h, value_dim)
    yield f"{p}.in_proj_b", "dense", (heads, h)
    yield f"{p}.in_proj_a", "dense", (heads, h)
    yield f"{p}.norm", "norm", (f["linear_value_head_dim"],)
    yield f"{p}.out_proj", "exl3", (value_dim, h)


def _mlp(p: str, dims, kind: str, moe: bool):
    h, inter = dims.hidden_size, dims.intermediate_size
    if moe:
        yield from sparse_mlp(p, h, dims.moe_intermediate_size, dims.num_experts, kind=kind,
                              shared=dims.shared_expert_intermediate_size, shared_kind=kind)
        return
    yield linear_entry(f"{p}.up_proj", kind, h, inter)
    yield linear_entry(f"{p}.gate_proj", kind, h, inter)
    yield linear_entry(f"{p}.down_proj", kind, inter, h)
