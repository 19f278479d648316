"""The experts SGLang routed each token to (`--enable-return-routed-experts`, `return_routed_experts`), for the GPU
checks that compare two MoE servers: a token whose router had its k-th and (k+1)-th experts within rounding may
route differently in the two, and every later position of that prompt then legitimately differs."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np


def routed_experts(meta: dict, layers: int, topk: int) -> np.ndarray | None:
    """Expert sets per token and layer, [tokens, layers, topk] sorted (SGLang: base64 int32 [tokens, layers, topk],
    one row per token but the last)."""
    raw = meta.get("routed_experts")
    if raw is None:
        return None
    arr = np.frombuffer(base64.b64decode(raw), dtype=np.int32).reshape(-1, layers, topk)
    return np.sort(arr, axis=-1)


def first_routing_difference(a: np.ndarray | None, b: np.ndarray | None) -> tuple[int | None, int]:
    """(first token routed differently in any layer or None, number of such tokens)."""
    if a is None or b is None:
        return None, 0
    n = min(len(a), len(b))
    differs = (a[:n] != b[:n]).any(axis=(1, 2))
    idx = np.flatnonzero(differs)
    return (int(idx[0]) if len(idx) else None), int(differs.sum())


# Models compared by the strict rule, without routing-aware excuses (none now). Mixtral was one while its EXL3
# server ran SGLang's QuantMixtralForCausalLM (no TopK, so no capture) and the fp16 twin MixtralForCausalLM; the
# plugin now keeps MixtralForCausalLM and hands its TopK the layer id.
NO_ROUTED_CAPTURE: set[str] = set()


def moe_shape(ckpt: Path) -> tuple[int, int] | None:
    """(layers, experts per token) of an MoE checkpoint whose SGLang model can return its routed experts, else
    None."""
    cfg = json.loads((ckpt / "config.json").read_text())
    if not (cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")):
        return None
    if set(cfg.get("architectures", [])) & NO_ROUTED_CAPTURE:
        return None
    return int(cfg["num_hidden_layers"]), int(cfg["num_experts_per_tok"])
