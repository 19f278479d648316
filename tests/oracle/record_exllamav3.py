"""Record exllamav3 1.6.5's own outputs as oracles for the CPU test suite (runs on the GPU machine).

Phases (the extension JIT-build takes ~6 min, so `build` runs in its own call):
  build   import exllamav3 (compiles exllamav3_ext into torch's extension cache)
  golden  decode / codebook / Hadamard / exl3_gemm golden vectors on fresh random inputs
  convert run exllamav3's converter on the tiny source models in SRC and record, per checkpoint,
          exllamav3's decoded trellis (SHA-256), full weights (get_weight_tensor) and logits

Usage on the GPU machine (see tests/oracle/README.md for the exact calls):
  python tests/oracle/record_exllamav3.py build
  python tests/oracle/record_exllamav3.py golden OUT_DIR
  python tests/oracle/record_exllamav3.py convert SRC_DIR OUT_DIR
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

# (source model, codebook, bits) converted by exllamav3; each output stays well under 5 MB.
CONVERSIONS = [
    ("llama", "mul1", 4.0),
    ("llama", "mcg", 3.0),
    ("llama", "3inst", 2.0),
    ("qwen3", "mul1", 2.5),
    ("qwen3", "mcg", 4.0),
    ("qwen3", "3inst", 3.0),
    ("qwen3_moe", "mul1", 4.0),
    ("mixtral", "mcg", 3.0),
]
VARIANTS = [(cb, k) for cb in ("3inst", "mcg", "mul1") for k in range(1, 9)] + [
    ("mul1", 1.5), ("mul1", 2.5), ("mul1", 3.5)]
PROMPT_IDS = [5, 17, 200, 31, 999, 64, 128, 7, 300, 511, 12, 86, 640, 2, 90, 1000]


def ext():
    from exllamav3.ext import exllamav3_ext
    return exllamav3_ext


def flags(cb: str) -> tuple[bool, bool]:
    return cb == "mcg", cb == "mul1"


def record_golden(out: Path) -> None:
    from safetensors.torch import save_file

    e = ext()
    gen = torch.Generator(device="cpu").manual_seed(int(time.time()))
    tensors: dict[str, torch.Tensor] = {}
    # Whole codebooks: every 16-bit state.
    states = torch.arange(65536, dtype=torch.int32).view(256, 256)
    states16 = (states - ((states >> 15) << 16)).to(torch.int16).cuda()
    for cb in ("3inst", "mcg", "mul1"):
        table = torch.empty(256, 256, dtype=torch.float16, device="cuda")
        e.decode(states16, table, *flags(cb))
        tensors[f"codebook.{cb}"] = table.flatten().cpu()
    # Reconstruct of random trellises, every (codebook, bitrate) exllamav3 writes.
    for cb, k in VARIANTS:
        words = int(k * 16)
        trellis = torch.randint(-32768, 32768, (3, 16, words), generator=gen, dtype=torch.int32).to(torch.int16)
        w = torch.empty(3 * 16, 16 * 16, dtype=torch.float16, device="cuda")
        e.reconstruct(w, trellis.cuda(), float(k), *flags(cb))
        tensors[f"reconstruct.{cb}.{k}.trellis"] = trellis
        tensors[f"reconstruct.{cb}.{k}.w_hat"] = w.cpu()
    # Hadamard: pre-scale, post-scale, plain fp16 and fp32.
    x = (torch.randn(8, 384, generator=gen) * 3).half()
    sign = torch.where(torch.rand(384, generator=gen) < 0.5, -1, 1).half()
    scale = (torch.rand(384, generator=gen) + 0.5).half() * sign
    tensors["had.x"], tensors["had.scale"] = x, scale
    for name, pre, post in (("pre", scale, None), ("post", None, scale), ("plain", None, None)):
        y = torch.empty_like(x).cuda()
        e.had_r_128(x.cuda(), y, None if pre is None else pre.cuda(), None if post is None else post.cuda(), 1.0)
        tensors[f"had.y_{name}"] = y.cpu()
    xf = torch.randn(8, 384, generator=gen) * 5
    yf = torch.empty_like(xf).cuda()
    e.had_r_128(xf.cuda(), yf, None, None, 1.0)
    tensors["had.xf32"], tensors["had.yf32"] = xf, yf.cpu()
    # exl3_gemm on a 256 x 384 layer, three row counts, every codebook at 4 bits and MUL1 at 2.
    for cb, k in (("3inst", 4), ("mcg", 4), ("mul1", 4), ("mul1", 2)):
        trellis = torch.randint(-32768, 32768, (16, 24, k * 16), generator=gen, dtype=torch.int32).to(torch.int16)
        suh = (torch.randn(256, generator=gen) * 0.05).half()
        svh = (torch.randn(384, generator=gen) * 0.05).half()
        pre = f"gemm.{cb}.{k}"
        tensors[f"{pre}.trellis"], tensors[f"{pre}.suh"], tensors[f"{pre}.svh"] = trellis, suh, svh
        for m in (1, 8, 33):
            a = torch.randn(m, 256, generator=gen).half()
            c = torch.empty(m, 384, dtype=torch.float16, device="cuda")
            a_had = torch.empty_like(a).cuda()
            e.exl3_gemm(a.cuda(), trellis.cuda(), c, suh.cuda(), a_had, svh.cuda(), -1, *flags(cb), 0)
            tensors[f"{pre}.m{m}.x"], tensors[f"{pre}.m{m}.y"] = a, c.cpu()
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "exllamav3_golden.safetensors"),
              metadata={"exllamav3": _exl_version(), "torch": torch.__version__,
                        "gpu": torch.cuda.get_device_name()})
    print(f"golden: {len(tensors)} tensors")


def _exl_version() -> str:
    import exllamav3.version as v
    return v.__version__


def record_checkpoint(ckpt: Path, store_full_weights: bool) -> None:
    """Oracle of one converted checkpoint, written beside it as exllamav3_oracle.{json,safetensors}."""
    from exllamav3 import Config, Model
    from safetensors.torch import save_file

    config = Config.from_directory(str(ckpt))
    model = Model.from_config(config)
    model.load()
    meta: dict[str, dict] = {}
    tensors: dict[str, torch.Tensor] = {}
    for module in model:
        inner = getattr(module, "inner", None)
        if type(inner).__name__ != "LinearEXL3":
            continue
        w_hat = inner.get_inner_weight_tensor().cpu().contiguous()
        full = inner.get_weight_tensor().cpu().contiguous()
        meta[module.key] = {
            "w_hat_sha256": hashlib.sha256(w_hat.view(torch.int16).numpy().tobytes()).hexdigest(),
            "weight_sha256": hashlib.sha256(full.view(torch.int16).numpy().tobytes()).hexdigest(),
            "shape": list(full.shape),
            "K": inner.K, "mcg": bool(inner.mcg), "mul1": bool(inner.mul1),
        }
        if store_full_weights:
            tensors[f"{module.key}.weight"] = full
    ids = torch.tensor([PROMPT_IDS], dtype=torch.long)
    with torch.inference_mode():
        logits = model.forward(ids)
    tensors["input_ids"] = ids
    tensors["logits"] = logits.float().cpu().contiguous()
    # Kept in a subfolder: a stray *.safetensors beside the shards would be read as a shard.
    (ckpt / "oracle").mkdir(exist_ok=True)
    save_file(tensors, str(ckpt / "oracle" / "exllamav3_oracle.safetensors"))
    (ckpt / "oracle" / "exllamav3_oracle.json").write_text(json.dumps(
        {"exllamav3": _exl_version(), "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
         "modules": meta}, indent=1))
    model.unload()
    print(f"oracle: {ckpt.name}: {len(meta)} EXL3 linears")


def convert_all(src: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    log = []
    for arch, cb, bits in CONVERSIONS:
        name = f"tiny-{arch.replace('_', '')}-{cb}-{bits:g}bpw"
        dst, work = out / name, Path("/tmp/exl3_work") / name
        cmd = [sys.executable, "-m", "exllamav3.conversion.convert_model", "-i", str(src / arch),
               "-o", str(dst), "-w", str(work), "-b", str(bits), "-cb", cb, "-hb", "6",
               "-cr", "32", "-cc", "512"]
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        took = time.time() - t0
        if proc.returncode:
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            log.append({"name": name, "cmd": cmd, "rc": proc.returncode, "seconds": took})
            continue
        (dst / "CONVERSION.txt").write_text(
            "python -m exllamav3.conversion.convert_model " + " ".join(cmd[3:]) + "\n")
        record_checkpoint(dst, store_full_weights="moe" not in name and "mixtral" not in name)
        log.append({"name": name, "cmd": cmd, "rc": 0, "seconds": round(took, 1)})
        print(f"converted {name} in {took:.0f}s")
    (out / "conversions.json").write_text(json.dumps(log, indent=1))


def main() -> None:
    phase = sys.argv[1]
    t0 = time.time()
    if phase == "build":
        import exllamav3  # noqa: F401  (JIT-builds the extension)
        ext()
    elif phase == "golden":
        record_golden(Path(sys.argv[2]))
    elif phase == "convert":
        convert_all(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        raise SystemExit(f"unknown phase {phase!r}")
    print(f"{phase}: {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
