"""Logical (unpadded) [in, out] sizes of EXL3 linears, from the model's config.json.

exllamav3 pads in/out features to multiples of 128 and keeps the logical sizes in its architecture
definitions, not in the checkpoint. Dequantizing to a plain HF checkpoint must trim the padding, so
the usual projection names are mapped to config fields here; anything unknown keeps its packed size.
"""

from __future__ import annotations

import re

_SUFFIX = re.compile(r"(?:^|\.)([a-z0-9_]+)$")


def _text_config(config: dict) -> dict:
    return config.get("text_config") or config.get("language_config") or config


def _intermediate(key: str, cfg: dict) -> int | None:
    if ".shared_expert." in key or ".shared_experts." in key:
        if "shared_expert_intermediate_size" in cfg:
            return cfg["shared_expert_intermediate_size"]
        if "moe_intermediate_size" in cfg:
            return cfg["moe_intermediate_size"] * cfg.get("n_shared_experts", 1)
    if ".experts." in key:
        return cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")
    return cfg.get("intermediate_size")


def logical_in_out(key: str, config: dict) -> tuple[int | None, int | None]:
    """Logical (in, out) of the linear `key`, None where the config does not say."""
    cfg = _text_config(config)
    hidden = cfg.get("hidden_size")
    heads = cfg.get("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or (hidden // heads if hidden and heads else None)
    match = _SUFFIX.search(key)
    name = match.group(1) if match else key
    q = heads * head_dim if heads and head_dim else None
    kv = kv_heads * head_dim if kv_heads and head_dim else None
    inter = _intermediate(key, cfg)
    heads_qk = heads * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) if "qk_rope_head_dim" in cfg else None
    heads_kv = heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]) if "v_head_dim" in cfg else None
    mla_kv_a = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] if "kv_lora_rank" in cfg else None
    if "v_head_dim" in cfg:  # MLA: o_proj reads heads * v_head_dim
        q = heads * cfg["v_head_dim"]
    table = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
        "w1": (hidden, inter),
        "w3": (hidden, inter),
        "w2": (inter, hidden),
        "lm_head": (hidden, cfg.get("vocab_size")),
        # DeepSeek/GLM-style multi-head latent attention
        "q_a_proj": (hidden, cfg.get("q_lora_rank")),
        "q_b_proj": (cfg.get("q_lora_rank"), heads_qk),
        "kv_a_proj_with_mqa": (hidden, mla_kv_a),
        "kv_b_proj": (cfg.get("kv_lora_rank"), heads_kv),
    }
    if name == "q_proj" and heads_qk:
        return hidden, heads_qk
    return table.get(name, (None, None))


def trimmed_size(logical: int | None, packed: int) -> int:
    """The logical size when it is consistent with 128-padding of `packed`, else `packed`."""
    if logical is not None and packed - 128 < logical <= packed:
        return logical
    return packed


def meta_model_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of the transformers model for this config, built on the meta device.

    Exact for every architecture transformers knows, as long as its parameter names equal the
    checkpoint's (per-expert MoE weights are fused in transformers 5, so those use the table).
    Returns {} when transformers cannot build the model.
    """
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = {k: v for k, v in config.items() if k != "quantization_config"}
        hf_config = AutoConfig.for_model(**cfg) if "model_type" in cfg else None
        if hf_config is None:
            return {}
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        return {name: tuple(p.shape) for name, p in model.state_dict().items()}
    except Exception:  # noqa: BLE001 - any failure means "unknown": fall back to the table
        return {}


def logical_sizes(key: str, config: dict, packed_in: int, packed_out: int,
                  meta_shapes: dict[str, tuple[int, ...]] | None = None) -> tuple[int, int]:
    """Trimmed (in, out) for module `key`: the meta model's shape when it has one, else the table."""
    shape = (meta_shapes or {}).get(f"{key}.weight")
    if shape is not None and len(shape) == 2:
        out_l, in_l = shape
    else:
        in_l, out_l = logical_in_out(key, config)
    return trimmed_size(in_l, packed_in), trimmed_size(out_l, packed_out)
