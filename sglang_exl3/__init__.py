"""sglang-exl3: EXL3 (exllamav3 trellis quantization) served by SGLang.

Layers, each importable without the ones above it:
format -> codec -> kernels -> layers -> runtime -> integration.
Importing this package imports nothing heavy (no torch, no SGLang).
"""

__version__ = "0.1.0"
