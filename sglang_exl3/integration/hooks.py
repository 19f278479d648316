"""Plugin hooks (SGLang's HookRegistry; no SGLang file is edited).

`rank_sliced_quant_config`: claims rank-sliced EXL3 MoE checkpoints (`hybrid_tr3_tail`) for `exl3`.

`lm_head_quant_config`: some SGLang model classes (Mixtral, ...) build `ParallelLMHead` without
passing `quant_config`, so an EXL3 `lm_head` would be built unquantized and its `.trellis` tensors
skipped by the loader. While a model is being built from an EXL3 checkpoint whose `lm_head` is EXL3,
the head gets the EXL3 config. The "active" config is the one SGLang created last in this process:
SGLang builds each model (target, then draft) right after creating its quantization config.
"""

from __future__ import annotations

ACTIVE_CONFIG = None  # the Exl3Config most recently created in this process


def set_active_config(config) -> None:
    global ACTIVE_CONFIG
    ACTIVE_CONFIG = config


def lm_head_quant_config(original, self, *args, **kwargs):
    config = ACTIVE_CONFIG
    if kwargs.get("quant_config") is None and config is not None and config.checkpoint is not None:
        if config.record_for(kwargs.get("prefix") or "lm_head") is not None:
            kwargs["quant_config"] = config
    return original(self, *args, **kwargs)


def rank_sliced_quant_config(original, self, *args, **kwargs):
    """AROUND `ModelConfig._parse_quant_hf_config`: a checkpoint with `hybrid_tr3_tail` (format exl3-trellis)
    is EXL3 even when its `quantization_config` names another method (the reference's rule; otherwise its
    experts would silently load as that method), unless the user asked for a different method. SGLang
    only shows `quantization_config` to the quantization classes, hence a hook on the parse."""
    from sglang_exl3.format.rank_sliced import override_quantization_method

    parsed = original(self, *args, **kwargs)
    tail = getattr(self.hf_config, "hybrid_tr3_tail", None)
    if override_quantization_method({"hybrid_tr3_tail": tail}, getattr(self, "quantization", None)) == "exl3":
        parsed = {**(parsed or {}), "quant_method": "exl3", "hybrid_tr3_tail": tail,
                  "checkpoint_quant_method": (parsed or {}).get("quant_method")}
    return parsed


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.layers.vocab_parallel_embedding.ParallelLMHead.__init__",
                          lm_head_quant_config, HookType.AROUND)
    HookRegistry.register("sglang.srt.configs.model_config.ModelConfig._parse_quant_hf_config",
                          rank_sliced_quant_config, HookType.AROUND)
