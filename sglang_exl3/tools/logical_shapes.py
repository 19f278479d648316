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
    }
    return table.get(name, (None, None))


def trimmed_size(logical: int | None, packed: int) -> int:
    """The logical size when it is consistent with 128-padding of `packed`, else `packed`."""
    if logical is not None and packed - 128 < logical <= packed:
        return logical
    return packed
