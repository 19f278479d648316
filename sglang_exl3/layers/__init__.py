"""SGLang layers for EXL3: `Exl3Config` (the `--quantization exl3` config) and its linear method.

This is the lowest layer that imports SGLang.
"""

from sglang_exl3.layers.exl3_config import Exl3Config
from sglang_exl3.layers.linear import Exl3LinearMethod

__all__ = ["Exl3Config", "Exl3LinearMethod"]
