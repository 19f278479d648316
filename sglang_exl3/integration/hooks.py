"""Plugin hooks (SGLang's HookRegistry; no SGLang file is edited).

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


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.layers.vocab_parallel_embedding.ParallelLMHead.__init__",
                          lm_head_quant_config, HookType.AROUND)
