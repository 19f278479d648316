"""Where a NextN (MTP) draft's one layer sits in the checkpoint.

SGLang's DeepSeek-V3 / GLM-4.5 NextN draft classes build their single decoder layer as `model.decoder.*`, and their
loaders read it from `model.layers.{N}.*` with N = num_hidden_layers (0 for a checkpoint of that layer alone,
num_hidden_layers == 1), renaming as they go. The EXL3 config must look its modules up under the checkpoint's
name; otherwise the draft's experts and projections are built unquantized and the loader drops their EXL3 tensors
("not found in params_dict"), serving a layer of uninitialised weights.
"""

from __future__ import annotations

# SGLang 0.5.17 classes whose layer is `model.decoder` and whose loader maps it from `model.layers.{N}`
# (deepseek_common/deepseek_weight_loader.py: nextn_layer_id = 0 if num_hidden_layers == 1 else num_hidden_layers)
DECODER_NEXTN_CLASSES = frozenset({"DeepseekV3ForCausalLMNextN", "GlmMoeDsaForCausalLMNextN",
                                   "Glm4MoeForCausalLMNextN", "Glm4MoeLiteForCausalLMNextN"})
# What the NextN module builds itself besides its decoder layer. The norms are plain torch layers and must be stored
# unquantized; an EXL3 eh_proj (exllamav3 quantizes it at --mtp_bits) gets an EXL3 layer in place of the module's
# nn.Linear (layers/plain_linear.py, through a plugin hook)
NEXTN_PARTS = ("eh_proj", "enorm", "hnorm", "shared_head.norm")
PLAIN_PARTS = ("enorm", "hnorm", "shared_head.norm")


class NextNError(ValueError):
    """A NextN draft on an EXL3 checkpoint that cannot be served as stored; the message names the fix."""


def nextn_layer(hf_config) -> int | None:
    """The checkpoint layer index a NextN draft class loads, or None where the model is not such a draft."""
    archs = getattr(hf_config, "architectures", None) or []
    if not any(a in DECODER_NEXTN_CLASSES for a in archs):
        return None
    layers = int(hf_config.num_hidden_layers)
    return 0 if layers == 1 else layers


def checkpoint_prefix(prefix: str, layer: int | None) -> str:
    """`model.decoder.mlp.experts` -> `model.layers.{layer}.mlp.experts` for a NextN draft; other prefixes as they
    are."""
    if layer is None:
        return prefix
    for head in ("model.decoder.", "decoder."):
        if prefix.startswith(head) or prefix == head[:-1]:
            return f"model.layers.{layer}" + prefix[len(head) - 1:]
    return prefix


def check_stored(tensor_names, exl3_modules, layer: int, path, arch: str) -> None:
    """At config time: the MTP layer is in the checkpoint, and its norms (plain torch layers) are not EXL3."""
    stem = f"model.layers.{layer}."
    mine = sorted(n for n in tensor_names if n.startswith(stem))
    if not mine:
        wanted = ", ".join(f"{stem}{p}.weight" for p in NEXTN_PARTS)
        raise NextNError(f"{arch} loads the MTP layer {stem}* from {path}, but the checkpoint has no tensor under it "
                         f"(missing: {wanted}, and the layer's attention and MLP). Convert with the MTP layer kept "
                         "(exllamav3: --mtp_bits), or serve without --speculative-algorithm NEXTN")
    quantized = sorted(m for m in exl3_modules if any(m == stem + p for p in PLAIN_PARTS))
    if quantized:
        raise NextNError(f"{arch} builds {quantized} as plain torch layers, but {path} stores them as EXL3, so their "
                         "weights could not be loaded; store them unquantized (exllamav3: --mtp_bits 16 keeps the "
                         "whole MTP layer in 16 bits)")
