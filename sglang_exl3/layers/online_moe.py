"""A BF16 MoE layer's routed experts encoded to EXL3 while the model loads (SGLANG_EXL3_ONLINE_BITS): SGLang's
unquantized expert weights and loaders (w13 = [gate; up], w2 = down, this rank's experts and intermediate slice), then
each expert's gate, up and down encoded as EXL3 shards through the cache (layers/online_linear.py) and installed as
the EXL3 MoE method installs a checkpoint's (same plans, tiers, slab and forwards). A layer whose expert width or
hidden size is not whole 128-element blocks stays BF16 on SGLang's own MoE method."""

from __future__ import annotations

import logging

import torch
from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

from sglang_exl3.format.constants import ALIGN
from sglang_exl3.kernels.backends import resolve_backend
from sglang_exl3.layers.linear import prepare_for_backend
from sglang_exl3.layers.moe import Exl3MoEMethod, local_experts
from sglang_exl3.layers.online_linear import OnlineProgress, encode_shard

logger = logging.getLogger(__name__)
PROJECTIONS = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))


class Exl3OnlineMoEMethod(Exl3MoEMethod):
    def __init__(self, prefix: str, bits: int, config, progress: OnlineProgress | None = None):
        super().__init__({}, prefix, config)
        self.bits, self.progress = bits, progress
        self.bf16 = UnquantizedFusedMoEMethod()  # the weights' loaders, and the forward of a layer left unencoded
        self.encoded = False

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra) -> None:
        self.bf16.create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                                 **extra)

    def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config) -> None:
        self.bf16.create_moe_runner(layer, moe_runner_config)
        super().create_moe_runner(layer, moe_runner_config)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        inter, hidden = layer.intermediate_size_per_partition, layer.hidden_size
        if inter % ALIGN or hidden % ALIGN:
            logger.warning("EXL3 online: %s stays %s: expert width %d / hidden size %d are not whole %d-element "
                           "blocks", self.prefix, layer.w13_weight.dtype, inter, hidden, ALIGN)
            return self.bf16.process_weights_after_loading(layer)
        self._attach_plan(layer)
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data  # [E, 2I, H], [E, H, I]
        world, rank = getattr(layer, "moe_tp_size", 1), getattr(layer, "moe_tp_rank", 0)
        if self.progress is not None:
            self.progress.begin()
        experts, hits, global_of = [], [], local_experts(layer, range(layer.num_experts))
        for e in range(w13.shape[0]):
            global_e = global_of[e]
            parts = {"w1": w13[e, :inter], "w3": w13[e, inter:], "w2": w2[e]}
            shards = {}
            for role, name in PROJECTIONS:
                shards[role], hit = encode_shard(parts[role], f"{self.prefix}.{global_e}.{name}", self.bits, world,
                                                 rank)
                hits.append(hit)
            experts.append(shards)
        if self.progress is not None:
            self.progress.step(all(hits))
        backend = resolve_backend(w13.device)
        for shards in experts:
            prepare_for_backend(shards.values(), backend)
        self._install(layer, experts, w13.device, backend)
        for name in ("w13_weight", "w2_weight"):  # the BF16 experts are freed
            setattr(layer, name, torch.nn.Parameter(torch.empty(0, dtype=w13.dtype, device=w13.device),
                                                    requires_grad=False))
        self.encoded = True

    def apply(self, layer: torch.nn.Module, dispatch_output):
        if not self.encoded:
            return self.bf16.apply(layer, dispatch_output)
        return super().apply(layer, dispatch_output)
