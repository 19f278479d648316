"""`python -m sglang_exl3 demo`: serve a small EXL3 model with SGLang and chat with it, no download.

Writes a random-weight EXL3 Llama in exllamav3's layout (so the answer is gibberish: the point is
the path, not the words), launches `sglang.launch_server --quantization exl3` on it, sends one chat
request and prints the answer and the decode speed.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path


def run_demo(port: int = 30117, workdir: str | None = None, max_tokens: int = 64) -> int:
    import torch

    if not torch.cuda.is_available():
        print("sglang-exl3 demo: no CUDA GPU found on this machine, so SGLang cannot serve here.\n"
              "It needs an NVIDIA GPU (compute capability 8.0 or newer). Without one you can still run\n"
              "  python -m sglang_exl3 write-fixture OUT   # an EXL3 checkpoint in exllamav3's layout\n"
              "  python -m sglang_exl3 inspect OUT\n"
              "  python -m sglang_exl3 dequantize OUT OUT-fp16")
        return 2
    from sglang_exl3.integration.server import launch, post, stop, wait_ready
    from sglang_exl3.synth.exl3_writer import write_exl3_checkpoint

    root = Path(workdir or tempfile.mkdtemp(prefix="sglang-exl3-demo-"))
    ckpt = write_exl3_checkpoint(root / "tiny-llama-exl3-4bpw", "llama", bits=4, codebook="mul1")
    print(f"wrote a random-weight EXL3 Llama (4 bits, MUL1) to {ckpt}")
    proc = launch(ckpt, port, ["--quantization", "exl3"], log_path=root / "server.log")
    base = f"http://127.0.0.1:{port}"
    try:
        print(f"starting SGLang (log: {root / 'server.log'}); the first start compiles kernels (~2 min)")
        ready = wait_ready(base, proc)
        print(f"server ready after {ready:.0f}s")
        t0 = time.time()
        answer = post(base + "/v1/chat/completions", {
            "model": "default", "messages": [{"role": "user", "content": "Say hello to EXL3."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        took = time.time() - t0
        tokens = answer["usage"]["completion_tokens"]
        print(f"answer (random weights, so not words): {answer['choices'][0]['message']['content']!r}")
        print(f"{tokens} tokens in {took:.2f}s = {tokens / took:.1f} tokens/s (one request, incl. HTTP)")
        return 0
    finally:
        stop(proc)
