"""An EXL3 matrix where an SGLang model class builds a plain `nn.Linear`, which no quantization method reaches:
speculative drafts' input projections (Qwen3.5's `mtp.fc`, DeepSeek / GLM NextN `eh_proj`), which exllamav3
quantizes at `--mtp_bits`. The layer is replaced after the class's `__init__` (a plugin hook), before the weights
load, by an EXL3 layer of the same name, so SGLang's loader routes the checkpoint's `.trellis` tensors to it."""

from __future__ import annotations

import torch
from sglang.srt.layers.linear import ReplicatedLinear


class Exl3PlainLinear(ReplicatedLinear):
    """Called as the class calls its `nn.Linear`: the output alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[0]


def quantize_plain_linear(module: torch.nn.Module, attr: str, config, key: str, tuple_output: bool = False) -> bool:
    """Replace `module.<attr>` (an `nn.Linear`) by an EXL3 layer when the checkpoint stores `key` as EXL3; a class
    that calls a `ReplicatedLinear` there as such (`tuple_output`) gets one. Returns whether it did."""
    linear = getattr(module, attr, None)
    if not isinstance(linear, torch.nn.Linear) or config is None or config.record_for(key) is None:
        return False
    cls = ReplicatedLinear if tuple_output else Exl3PlainLinear
    setattr(module, attr, cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              quant_config=config, prefix=key, params_dtype=linear.weight.dtype))
    return True
