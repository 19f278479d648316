"""The test environment is the real stack, and the lower layers stay free of SGLang."""

import subprocess
import sys

LOWER_LAYERS = ["sglang_exl3", "sglang_exl3.format", "sglang_exl3.codec", "sglang_exl3.synth.exl3_writer",
                "sglang_exl3.tools.dequantize", "sglang_exl3.tools.inspect_checkpoint", "sglang_exl3.cli.main",
                "sglang_exl3.kernels.dense", "sglang_exl3.kernels.groups", "sglang_exl3.kernels.moe_ops",
                "sglang_exl3.runtime"]  # runtime: plans are pure Python


def test_real_sglang_imports_on_cpu():
    import sglang
    import torch
    import transformers
    from sglang.srt.layers.quantization.base_config import QuantizationConfig  # noqa: F401

    assert sglang.__version__ == "0.5.17"
    assert torch.__version__.startswith("2.11.0")
    assert transformers.__version__ == "5.12.1"


def test_lower_layers_do_not_import_sglang():
    code = "import sys\n" + "".join(f"import {m}\n" for m in LOWER_LAYERS) + \
        "bad = [m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')]\nprint(bad)\nassert not bad"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_format_layer_does_not_import_codec():
    code = ("import sys, sglang_exl3.format\n"
            "assert not [m for m in sys.modules if m.startswith('sglang_exl3.codec')]")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_plugin_registers_in_a_fresh_process_and_bench_wrapper_accepts_exl3():
    code = ("from sglang.srt.plugins import load_plugins; load_plugins();"
            "import sglang.srt.layers.quantization as q; from sglang.srt.server_args import QUANTIZATION_CHOICES;"
            "assert q.QUANTIZATION_METHODS['exl3'].__name__ == 'Exl3Config'; assert 'exl3' in QUANTIZATION_CHOICES")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "sglang_exl3.integration.bench", "one_batch", "--help"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "exl3" in proc.stdout
