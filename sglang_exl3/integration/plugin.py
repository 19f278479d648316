"""The `sglang.srt.plugins` entry point: makes `--quantization exl3` exist in every SGLang process.

SGLang calls every plugin in the `sglang.srt.plugins` entry-point group from `load_plugins()`, in
the launcher before argument parsing and first thing in each scheduler/TP process. Registration is
idempotent and never edits SGLang's files: the name->class registry dict is mutated in place (the
model config holds the same dict) and the argparse choices list is extended.

SGLang logs and swallows exceptions raised by plugins, so a bad `SGLANG_EXL3_*` value is logged
here and raised again by `Exl3Config.from_config`, which runs while the model loads at startup.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    import sglang.srt.layers.quantization as quantization
    from sglang.srt.server_args import QUANTIZATION_CHOICES, add_quantization_method_choices

    import sglang_exl3.kernels.ops  # noqa: F401  (registers torch.ops.exl3.gemm)
    from sglang_exl3 import knobs
    from sglang_exl3.layers import Exl3Config

    quantization.QUANTIZATION_METHODS["exl3"] = Exl3Config
    if "exl3" not in QUANTIZATION_CHOICES:
        add_quantization_method_choices(["exl3"])
    from sglang_exl3.integration.hooks import register_hooks, register_model_overrides

    register_hooks()  # applied by load_plugins() right after the plugins run
    from sglang_exl3.integration.cartridge_server import register_types

    register_types()  # cartridge control requests: decodable in every process, a communicator in the tokenizer's
    register_model_overrides()  # collected when the launcher builds its ServerArgs, after load_plugins()
    try:
        knobs.validate_all()
    except knobs.KnobError as e:
        logger.error("sglang-exl3: %s", e)
