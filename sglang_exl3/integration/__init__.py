"""Integration with SGLang's process model: plugin registration (runs in every SGLang process)."""

from sglang_exl3.integration.plugin import register

__all__ = ["register"]
