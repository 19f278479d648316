"""User-facing tools over the format and codec layers (no SGLang import): inspect, dequantize."""
