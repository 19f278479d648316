"""Synthetic checkpoints: tokenizers, random-weight HF models and EXL3 fixtures in exllamav3's layout.

Above the codec layer, below kernels; no SGLang import.
"""
