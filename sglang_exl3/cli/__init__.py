"""Command line: `python -m sglang_exl3 {inspect,dequantize,write-fixture}`."""
