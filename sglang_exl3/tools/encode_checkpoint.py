"""`python -m sglang_exl3 encode IN OUT --bits K`: a BF16 / FP16 Hugging Face checkpoint rewritten as EXL3 in
exllamav3's layout, with the project's uncalibrated encoder (codec/encode.py: signs, Hadamard rotations, one scale,
tail-biting Viterbi per tile; no Hessian, so no LDLQ). Every linear of the decoder layers whose key matches
`--modules` (default: all of them) is encoded; `--head-bits` encodes the lm_head too; everything else (embeddings,
norms, routers, modules left out) is copied unchanged and listed in the sidecar as a plain module. In and out
features are zero-padded to multiples of 128, as exllamav3 pads them.

The encoder runs on `--device`: in torch on the CPU (about 0.09 s per 16x16 tile on two cores: small models only),
as our CUDA kernel on a GPU (43k tiles/s at K = 4 on the H200: ~20 s per Llama-3-8B decoder layer).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from sglang_exl3.format.constants import SIDECAR_NAME, Codebook, padded
from sglang_exl3.format.safetensors_index import safetensors_files
from sglang_exl3.format.shards import ShardPacker, marker_tensor, storage_entry

LINEARS = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)$")
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
          "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


def _load_all(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for f in safetensors_files(src):
        tensors.update(load_file(str(f)))
    return tensors


def encode_module(weight: torch.Tensor, bias: torch.Tensor | None, key: str, bits: int, codebook: Codebook,
                  device: str, encoder=None) -> dict[str, torch.Tensor]:
    """One linear ([out, in] weight, HF layout) as exllamav3 stores it: suh, svh, marker, trellis (+ bias)."""
    from sglang_exl3.codec.encode import encode_linear, module_seed

    enc = encode_linear(weight.to(device), bits, codebook, seed=module_seed(key), encoder=encoder)
    out = {f"{key}.suh": enc["suh"].cpu(), f"{key}.svh": enc["svh"].cpu()}
    if codebook.marker:
        out[f"{key}.{codebook.marker}"] = marker_tensor(codebook)
    out[f"{key}.trellis"] = enc["trellis"].cpu()
    if bias is not None:
        out[f"{key}.bias"] = torch.zeros(padded(bias.shape[0]), dtype=torch.float16)
        out[f"{key}.bias"][:bias.shape[0]] = bias.half()
    return out


def encode_checkpoint(src: str | Path, out: str | Path, bits: int, codebook: Codebook | str = Codebook.MCG,
                      head_bits: int | None = None, modules: str | None = None, device: str = "cpu",
                      progress: bool = True, encoder=None) -> dict:
    """`encoder`: the per-tile search (codec.encode.encode_tiles by default; the CLI passes the CUDA kernel's on a
    GPU)."""
    src, out = Path(src), Path(out)
    codebook = Codebook.from_label(codebook) if isinstance(codebook, str) else Codebook(codebook)
    config = json.loads((src / "config.json").read_text())
    if "quantization_config" in config:
        raise ValueError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')}); "
                         "encode a BF16 / FP16 checkpoint")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    selected = re.compile(modules) if modules else None
    tensors = _load_all(src)
    keys = sorted({n.rsplit(".", 1)[0] for n in tensors})
    encode = [k for k in keys if f"{k}.weight" in tensors and tensors[f"{k}.weight"].dim() == 2
              and ((LINEARS.search(k) and k.startswith("model.layers.")) or (k == "lm_head" and head_bits))
              and (selected is None or selected.search(k))]
    if selected is not None and not encode:
        raise ValueError(f"--modules {modules!r} matches no linear of {src}")
    out.mkdir(parents=True, exist_ok=True)
    storage, packer = {}, ShardPacker()
    todo = encode
    if progress:
        from tqdm import tqdm

        todo = tqdm(encode, desc="encoding EXL3 linears", unit="module")
    for key in todo:
        rate = head_bits if key == "lm_head" else bits
        parts = encode_module(tensors.pop(f"{key}.weight"), tensors.pop(f"{key}.bias", None), key, rate, codebook,
                              device, encoder)
        storage[key] = storage_entry(parts, rate, codebook)
        packer.add(parts)
    for key in keys:
        plain = {n: t for n, t in tensors.items() if n.rsplit(".", 1)[0] == key}
        if plain:
            storage[key] = storage_entry(plain, None)
            packer.add(plain)
    packer.save(out)
    qcfg = {"quant_method": "exl3", "version": "1.6.5", "bits": float(bits), "head_bits": head_bits or 16,
            "calibration": {"rows": 0, "cols": 0}, "out_scales": "never", "codebook": codebook.label,
            "producer": "sglang-exl3 encode (uncalibrated: no Hessian, no LDLQ)"}
    config["quantization_config"] = qcfg
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / SIDECAR_NAME).write_text(json.dumps({**qcfg, "tensor_storage": storage}, indent=4))
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    return {"encoded": len(encode), "plain": len(storage) - len(encode), "bits": bits, "codebook": codebook.label}
