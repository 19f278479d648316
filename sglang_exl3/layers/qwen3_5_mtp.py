"""Qwen3.5's MTP draft (`Qwen3_5ForCausalLMMTP`, what `--speculative-algorithm NEXTN` builds for a Qwen3.5 target) on
an EXL3 checkpoint.

exllamav3 writes the MTP block under `mtp.*` at `--mtp_bits` (default 4): `mtp.fc` (2H -> H), its two pre-fc norms,
`mtp.layers.{i}` (full-attention decoder layers) and `mtp.norm`. SGLang's draft class builds `fc` as a plain
`nn.Linear`, which no quantization method reaches, so an EXL3 `fc` gets an EXL3 layer of the same name in its place
(layers/plain_linear.py: SGLang's loader then routes `mtp.fc.trellis` to it). The draft's lm_head is the target's:
SGLang's draft worker hands it over (`set_lm_head_from_target`) and the MTP loader reads no `lm_head.*` tensor, so an
EXL3 head is built as a placeholder (`TargetHeadMethod`) instead of a second copy that would wait for tensors never
sent.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.quantization.base_config import LinearMethodBase

MTP_DRAFT_CLASSES = frozenset({"Qwen3_5ForCausalLMMTP"})
PREFIX = "mtp."
# what the draft class loads besides its decoder layers (`mtp.layers.{i}.*`)
REQUIRED = ("mtp.fc", "mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.norm.weight")


class MtpError(ValueError):
    """A Qwen3.5 MTP draft on an EXL3 checkpoint that cannot be served as stored; the message names the fix."""


def is_mtp_draft(hf_config) -> bool:
    return any(a in MTP_DRAFT_CLASSES for a in getattr(hf_config, "architectures", None) or [])


def check_stored(tensor_names, path, arch: str, layers: int) -> None:
    """At config time: every tensor the draft class loads is in the checkpoint (the MTP loader skips names it does
    not find, which would serve uninitialised weights)."""
    names = set(tensor_names)
    wanted = [*REQUIRED, *(f"mtp.layers.{i}." for i in range(layers))]
    missing = [w for w in wanted if not any(n == w or n.startswith(w if w.endswith(".") else w + ".") for n in names)]
    if missing:
        raise MtpError(f"{arch} loads the MTP block from {path}, but the checkpoint lacks {missing}. Convert with the "
                       "MTP layers kept (exllamav3: --mtp_bits, on a source model that has them), or serve without "
                       "--speculative-algorithm NEXTN")


class TargetHeadMethod(LinearMethodBase):
    """The lm_head of an MTP draft whose target's head is EXL3: a [0, H] placeholder until SGLang's draft worker gives
    the draft the target's head module (layers/draft_sharing.py); computing with it before then is an error."""

    def __init__(self, key: str):
        self.key = key

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        weight = torch.nn.Parameter(torch.empty(0, input_size_per_partition, dtype=params_dtype), requires_grad=False)
        weight.weight_loader = self._refuse
        layer.register_parameter("weight", weight)

    def _refuse(self, param, loaded, *args, **kwargs) -> None:
        raise MtpError(f"the MTP draft's lm_head is the target's EXL3 {self.key}; it takes no tensor of its own")

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise MtpError(f"the MTP draft computed logits before SGLang handed it the target's EXL3 {self.key} "
                       "(set_lm_head_from_target); serve it through --speculative-algorithm NEXTN")
