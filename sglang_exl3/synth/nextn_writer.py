"""Turn a checkpoint's last decoder layer into a DeepSeek-V3 / GLM-4.5 NextN (MTP) layer, as those checkpoints
store it: `model.layers.{N}.*` with N = the new num_hidden_layers, plus the parts only the NextN module has (enorm,
hnorm, eh_proj, shared_head.norm / head, its own embed_tokens), in BF16. The layer's attention and MLP stay as they
were written (EXL3 experts included), so a model built with one more layer is the oracle for what the draft loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def write_nextn_from_last_layer(src_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    src, out = Path(src_dir), Path(out_dir)
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    layer = config["num_hidden_layers"] - 1
    config.update(num_hidden_layers=layer, num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    shards = sorted(out.glob("*.safetensors"))
    tensors = {}
    for f in shards:
        tensors.update(load_file(str(f)))
        f.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    hidden, gen = config["hidden_size"], torch.Generator().manual_seed(seed)
    stem = f"model.layers.{layer}."
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{stem}{norm}.weight"] = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16)
    tensors[f"{stem}eh_proj.weight"] = (torch.randn(hidden, 2 * hidden, generator=gen) * 0.02).to(torch.bfloat16)
    tensors[f"{stem}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"{stem}shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
