"""EXL3 checkpoint format: schema, safetensors headers, fail-closed validation.

No torch import at module level beyond what reading marker scalars needs; no SGLang import.
"""

from sglang_exl3.format.checkpoint import Exl3Checkpoint, Exl3ModuleRecord
from sglang_exl3.format.constants import Codebook
from sglang_exl3.format.errors import Exl3FormatError, Problem
from sglang_exl3.format.load import load_checkpoint

__all__ = [
    "Codebook",
    "Exl3Checkpoint",
    "Exl3FormatError",
    "Exl3ModuleRecord",
    "Problem",
    "load_checkpoint",
]
