"""Write a Qwen3-MoE-shaped checkpoint with R7 routed experts (`quantization_config.r7_routed_experts`), the
reference implementation's per-projection K3/K4/K5 layout, since its producer is not available here.

Each routed expert projection is a whole (unsliced) EXL3 tensor set at its own bitrate, named without a rank
segment and listed nowhere in `quantization_config.json`; the hidden-side rotations are stored once per layer under
`experts.r7_shared` (`gate_up_suh` for gate and up, `down_svh` for down), so every expert's is the shared one.
Everything else is ordinary per-module EXL3. Built from `write_exl3_checkpoint` output at each bitrate, so the
dequantized twin (`python -m sglang_exl3 dequantize`) is exact.
"""

from __future__ import annotations

import json
from pathlib import Path

from sglang_exl3.format import r7
from sglang_exl3.format.constants import SIDECAR_NAME
from sglang_exl3.format.shards import ShardPacker
from sglang_exl3.synth.exl3_writer import ModelDims
from sglang_exl3.synth.rank_sliced_writer import PROJECTIONS, expert_donors, moe_base

# (gate, up, down) K per expert, cycled over the experts: gate and up at one bitrate (the fused forwards) and at two
# (gate and up run as two groups), every K of {3, 4, 5} in every role.
DEFAULT_PATTERN = ((3, 3, 4), (4, 5, 3), (5, 4, 5), (4, 4, 3))


def write_r7_checkpoint(out_dir: str | Path, dims: ModelDims | None = None,
                        pattern: tuple[tuple[int, int, int], ...] = DEFAULT_PATTERN, bits: int = 4, seed: int = 0,
                        with_tokenizer: bool = False, quant_method: str = "exl3") -> Path:
    """`pattern[e % len(pattern)]` is expert e's (gate, up, down) K in every layer; `bits` the rest of the model's
    bitrate; `quant_method` the label config.json carries (the reference's R7 checkpoints say `modelopt`)."""
    dims = dims or ModelDims()
    ks = sorted({k for triple in pattern for k in triple})
    if not set(ks) <= set(r7.ALLOWED_K):
        raise ValueError(f"R7 bitrates must lie in {r7.ALLOWED_K}, got {ks}")
    out = Path(out_dir)
    sidecar, tensors = moe_base(out, dims, bits, seed, with_tokenizer)
    donors = expert_donors(dims, ks, seed)
    packer = ShardPacker()
    for key in list(sidecar["tensor_storage"]):
        parts = key.split(".")
        if len(parts) < 7 or parts[3:5] != ["mlp", "experts"]:
            packer.add({n: t for n, t in tensors.items() if n.startswith(key + ".")})
            continue
        del sidecar["tensor_storage"][key]  # R7 experts live outside tensor_storage
        expert, proj = int(parts[5]), parts[6]
        k = pattern[expert % len(pattern)][PROJECTIONS.index(proj)]
        group = {f"{key}.{fld}": donors[k][f"{key}.{fld}"] for fld in ("trellis", r7.OWN_SIDE[proj], "mcg")}
        if expert == 0:  # the layer's shared hidden-side rotation: expert 0's, at its bitrate
            experts = ".".join(parts[:5])
            group[f"{experts}.r7_shared.{r7.SHARED_FIELD[proj]}"] = donors[k][f"{key}.{r7.SHARED_SIDE[proj]}"]
        packer.add(group)
    packer.save(out)
    (out / SIDECAR_NAME).write_text(json.dumps(sidecar, indent=4))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"].update(quant_method=quant_method, **{r7.BLOCK: {
        "schema": r7.SCHEMA, "codebook": "mcg", "bits": "mixed_tensor",
        "moe_layers": [0, dims.num_hidden_layers - 1], "k_values": ks}})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
