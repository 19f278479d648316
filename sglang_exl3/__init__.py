"""sglang-exl3: EXL3 (exllamav3 trellis quantization) served by SGLang.

Layers, each importing only from the ones below it (tests/test_layering.py, docs/architecture.md):
knobs -> format -> codec -> kernels, synth, tools -> runtime -> layers -> integration -> cli.
Importing this package imports nothing heavy (no torch, no SGLang).
"""

__version__ = "0.1.0"
