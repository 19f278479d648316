"""`Exl3MoEMethod`: EXL3 experts inside SGLang's FusedMoE (per-expert checkpoint tensors).

Loading: placeholders `w13_<suffix>` / `w2_<suffix>` catch the stock expert mapping
(`experts.{e}.gate_proj.` / `up_proj.` -> `experts.w13_`, `down_proj.` -> `experts.w2_`; Mixtral's
w1/w3/w2 likewise); the loader maps global to local experts (expert parallelism: other ranks'
experts are dropped) and keeps each expert's matrices apart (own suh/svh/codebook/bits).
`process_weights_after_loading` validates them against the checkpoint records and slices the
intermediate dimension for MoE tensor parallelism in 128-element units.

Forward: the model's MoE dispatch plan (`sglang_exl3.runtime.moe_plan`, built once per model scope and
role after loading, knobs validated then) sends a batch of m rows to the decode plan, the prefill plan (in
slices of its capacity) or the eager parity path. On our CUDA kernels the decode and prefill plans read only
the routed experts, and from rotated_min_rows(experts, top-k) rows decode every expert's W_hat into one fp16 slab
for SGLang's Triton grouped GEMM between per-pair rotations (`layers/moe_rotated.py`; experts of mixed bitrates
run tier by tier). Elsewhere
(torch/exllamav3 backends) they run every local expert on all rows through `torch.ops.exl3.gemm`, weighted by
its routing weight (capturable, E x the dense FLOPs). The parity path runs only the routed experts on their
rows (data-dependent shapes: eager only, and refused during graph capture).
"""

from __future__ import annotations

import torch
from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase

from sglang_exl3 import knobs
from sglang_exl3.format import Exl3ModuleRecord
from sglang_exl3.format.rank_sliced import ROLE_H_SIDE
from sglang_exl3.kernels.backends import resolve_backend
from sglang_exl3.layers import output_check
from sglang_exl3.layers.linear import (
    build_shard,
    prepare_for_backend,
    register_placeholders,
    release_placeholders,
    run_shard,
)
from sglang_exl3.layers.moe_kernels import (
    ROLES,
    build_tiers,
    reserve_slab,
    rotated_min_rows,
    routed_forward,
)
from sglang_exl3.layers.moe_rotated import rotated_slab_forward
from sglang_exl3.layers.shard import Exl3Shard
from sglang_exl3.layers.tp_slicing import Exl3Slice, Exl3SliceError

GROUPS = ("w13_", "w2_")  # parameter-name prefixes of SGLang's expert mapping


class Exl3MoEMethod(FusedMoEMethodBase):
    def __init__(self, records: dict[tuple[int, str], Exl3ModuleRecord], prefix: str, config=None,
                 pre_sliced: bool = False, shared_h: bool = False, base_digest: str | None = None):
        self.records = records  # (global expert id, role) -> record
        self.prefix = prefix
        self.config = config
        self.pre_sliced = pre_sliced  # rank-sliced checkpoint: the records are this rank's slices already
        self.shared_h = shared_h  # hidden-side rotations stored once per layer (loaded into expert 0's slot)
        self.base_digest = base_digest  # a cartridge base's layer digest, verified on the loaded tensors
        self.moe_runner_config = None
        self.runners = {}  # plan path -> forward, set with the plan after loading

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra) -> None:
        if extra.get("with_bias"):
            raise ValueError(f"EXL3 MoE {self.prefix}: per-expert biases are not supported")
        inter_pp = intermediate_size_per_partition
        if getattr(layer, "moe_tp_size", 1) > 1 and inter_pp % 128:
            raise Exl3SliceError(
                f"EXL3 MoE {self.prefix}: the expert intermediate size per rank ({inter_pp}) is not a multiple of "
                f"128 at moe_tp_size={layer.moe_tp_size}; EXL3 slices fall on 128-wide Hadamard blocks. Use expert "
                "parallelism (--ep-size) so each expert stays whole on one rank")
        layer.exl3_moe_loaded = {}
        for group in GROUPS:
            register_placeholders(layer, self._make_loader(layer), group)

    def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config) -> None:
        cfg = moe_runner_config
        if cfg.apply_router_weight_on_input or not cfg.is_gated or cfg.activation not in ("silu", "gelu"):
            raise ValueError(f"EXL3 MoE {self.prefix}: only gated silu/gelu experts with weights applied to the "
                             f"output are supported (got activation={cfg.activation}, gated={cfg.is_gated}, "
                             f"apply_router_weight_on_input={cfg.apply_router_weight_on_input})")
        self.moe_runner_config = cfg

    def _make_loader(self, layer: torch.nn.Module):
        def load(param, loaded, weight_name=None, shard_id=None, expert_id=None, *args, **kwargs) -> None:
            if shard_id not in ROLES or expert_id is None:
                raise ValueError(f"EXL3 MoE {self.prefix}: unexpected shard {shard_id!r} / expert {expert_id!r}")
            if layer._map_global_expert_id_to_local_expert_id(expert_id) < 0:
                return  # another expert-parallel rank owns it
            layer.exl3_moe_loaded.setdefault((int(expert_id), shard_id), {})[param.exl3_suffix] = loaded
        return load

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.config is not None:
            self.config.check_all_claimed()
        if self.base_digest is not None:
            from sglang_exl3.layers.base_identity import verify_base_layer

            layer.exl3_base_layer = verify_base_layer(layer.exl3_moe_loaded, self.prefix,
                                                      self.config.rank_sliced.bits, self.base_digest)
            layer.exl3_base_digest = self.base_digest
            layer.exl3_base_identity = (self.config.rank_sliced.compatibility_sha256,
                                        self.config.rank_sliced.compatibility_by_layer)  # root, per-layer map
        self._attach_plan(layer)
        device = layer.w13_trellis.device
        backend = resolve_backend(device)
        local = local_experts(layer, sorted({e for e, _ in self.records}))
        if sorted(local) != list(range(layer.num_local_experts)):
            raise ValueError(f"EXL3 MoE {self.prefix}: the checkpoint holds experts {sorted(local.values())} for "
                             f"this rank, expected {layer.num_local_experts} local experts")
        inter_pp, tp_rank = layer.intermediate_size_per_partition, getattr(layer, "moe_tp_rank", 0)
        total = inter_pp * getattr(layer, "moe_tp_size", 1)
        cut = Exl3Slice(tp_rank * inter_pp, inter_pp, total)
        experts = []
        for local_e in range(layer.num_local_experts):
            shards = {role: self._build(layer, local[local_e], role, cut, device) for role in ROLES}
            prepare_for_backend(shards.values(), backend)
            experts.append(shards)
        self._install(layer, experts, device, backend)
        del layer.exl3_moe_loaded
        for group in GROUPS:
            release_placeholders(layer, device, group)

    def _install(self, layer: torch.nn.Module, experts: list[dict[str, Exl3Shard]], device, backend) -> None:
        """The layer's experts, ready to serve: tiers and banks for our kernels, the model's slab, a resident
        cartridge slot where asked for (all before SGLang sizes the KV cache)."""
        layer.exl3_experts = experts
        layer.exl3_backend = int(backend)
        layer.exl3_tiers = build_tiers(experts, backend)
        if layer.exl3_tiers is not None:
            self._reserve_slab(layer, device)
        if self.base_digest is not None and layer.exl3_role == "target" and knobs.get("CARTRIDGES") == "resident":
            from sglang_exl3.layers.cartridge import base_cartridge

            layer.exl3_cartridge = base_cartridge(layer, self.prefix)

    def _attach_plan(self, layer: torch.nn.Module) -> None:
        """The model's dispatch plan (one per config scope and role; knob errors surface here, at load)."""
        from sglang_exl3.runtime.moe_plan import DECODE, PARITY, PLANS, PREFILL, build_moe_plan, layer_role

        self.runners = {DECODE: self._capturable, PREFILL: self._capturable, PARITY: self._routed_experts}
        layer.exl3_role = layer_role(self.prefix, getattr(layer, "exl3_is_draft", None))
        layer.exl3_plan = PLANS.plan_for(self._owner(layer), layer.exl3_role,
                                         lambda: build_moe_plan(scheduler_token_bound(self.config)))

    def _build(self, layer, global_e: int, role: str, cut: Exl3Slice, device) -> Exl3Shard:
        """gate/up keep this rank's intermediate columns, down its intermediate rows (a rank-sliced checkpoint
        stores exactly those)."""
        record = self.records[(global_e, role)]
        got = layer.exl3_moe_loaded.get((global_e, role), {})
        if self.shared_h:
            side = ROLE_H_SIDE[role]
            shared = layer.exl3_moe_loaded.get((0, role), {}).get(side)
            if shared is not None:
                got = {**got, side: shared}
        if self.pre_sliced:
            width = record.in_features if role == "w2" else record.out_features
            if width != cut.size:
                raise ValueError(f"EXL3 MoE {self.prefix}: expert {global_e} {role} slice is {width} wide, but this "
                                 f"rank runs {cut.size} intermediate features (rank-sliced checkpoint vs runtime TP)")
            out = layer.hidden_size if role == "w2" else cut.size
            return build_shard(record, got, self.prefix, device, out)
        if role == "w2":
            return build_shard(record, got, self.prefix, device, layer.hidden_size, rows=cut)
        return build_shard(record, got, self.prefix, device, cut.size, columns=cut)

    def apply(self, layer: torch.nn.Module, dispatch_output) -> StandardCombineInput:
        x = dispatch_output.hidden_states
        topk_weights, topk_ids = dispatch_output.topk_output[0], dispatch_output.topk_output[1]
        rows = x.reshape(-1, x.shape[-1])  # in the model's dtype: each path casts to fp16 only where it must
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        cartridge = getattr(layer, "exl3_cartridge", None)  # layers/cartridge_runtime.py (target layers only)
        if cartridge is not None:  # any m, capturable: the plan's paths serve the base weights only
            from sglang_exl3.layers.cartridge import cartridge_forward

            out = cartridge_forward(layer, cartridge, rows, topk_weights, topk_ids,
                                    self.moe_runner_config.activation == "gelu")
        else:
            out, paths = self._planned(layer, rows, topk_weights, topk_ids, capturing)
            if output_check.enabled(layer, rows):
                want = output_check.moe_reference(rows, layer.exl3_experts, topk_weights, topk_ids,
                                                  self.moe_runner_config.activation == "gelu")
                output_check.report(layer, f"EXL3 MoE {self.prefix}", paths, rows, out, want)
        scale = self.moe_runner_config.routed_scaling_factor
        # On CUDA SGLang's MoE runner applies routed_scaling_factor, so this method does; elsewhere its models scale
        # the routed output themselves (DeepSeek-V2/V3, GLM-4.5 MoE: `if not _is_cuda: final *= routed_scaling_factor`)
        if scale is not None and x.is_cuda:
            out *= scale
        return StandardCombineInput(hidden_states=out.to(x.dtype))

    def _planned(self, layer, rows, topk_weights, topk_ids, capturing: bool) -> tuple[torch.Tensor, str]:
        """The rows through the dispatch plan's segments (decode / prefill plan / parity path); the paths taken."""
        m = rows.shape[0]
        segments = list(layer.exl3_plan.segments(m, capturing, self.prefix, layer.exl3_role))
        paths = "+".join(s[0] for s in segments)
        if len(segments) == 1 and segments[0][1:] == (0, m):  # one plan for all rows: no staging buffer and copy
            return self.runners[segments[0][0]](layer, rows, topk_weights, topk_ids), paths
        out = torch.zeros(m, layer.hidden_size, dtype=torch.float32, device=rows.device)
        for path, r0, r1 in segments:
            out[r0:r1] = self.runners[path](layer, rows[r0:r1], topk_weights[r0:r1], topk_ids[r0:r1])
        return out, paths

    def _expert(self, layer, e: int, x16: torch.Tensor) -> torch.Tensor:
        """fp32 down(act(gate(x)) * up(x)) of local expert e."""
        shards, where = layer.exl3_experts[e], f"EXL3 MoE {self.prefix}"
        gate = run_shard(x16, shards["w1"], layer.exl3_backend, where).float()
        up = run_shard(x16, shards["w3"], layer.exl3_backend, where).float()
        if self.moe_runner_config.activation == "silu":
            hidden = torch.nn.functional.silu(gate) * up
        else:
            hidden = torch.nn.functional.gelu(gate, approximate="tanh") * up
        return run_shard(hidden.to(torch.float16), shards["w2"], layer.exl3_backend, where).float()

    def _owner(self, layer):
        """The model scope that owns plans and scratch: its quantization config (one per model)."""
        return self.config if self.config is not None else layer

    def _reserve_slab(self, layer, device) -> None:
        reserve_slab(self._owner(layer), len(layer.exl3_experts), layer.intermediate_size_per_partition,
                     layer.hidden_size, device)

    def _capturable(self, layer, x, topk_weights, topk_ids) -> torch.Tensor:
        """Decode and prefill plans on our CUDA kernels: routed groups (only the routed experts' weights are read;
        they take bf16 x as it comes), or from rotated_min_rows rows the rotated slab (every expert's W_hat decoded
        once, SGLang's Triton grouped GEMM in fp16 between our per-pair rotations, which read bf16 x as it comes);
        elsewhere every expert on every row."""
        tiers = layer.exl3_tiers
        if tiers is None:
            return self._all_experts(layer, x, topk_weights, topk_ids)
        if x.shape[0] >= rotated_min_rows(tiers.num_experts, self.moe_runner_config.top_k):
            return rotated_slab_forward(tiers, self._owner(layer).exl3_moe_slab,
                                        layer.intermediate_size_per_partition, layer.hidden_size,
                                        x, topk_weights, topk_ids,
                                        self.moe_runner_config.activation == "gelu")
        # with no routed scaling to apply in fp32 afterwards, the decode forward may round into x's dtype itself
        fold = self.moe_runner_config.routed_scaling_factor is None
        return routed_forward(tiers, x, topk_weights, topk_ids, self.moe_runner_config.activation == "gelu",
                              x.dtype if fold else torch.float32)

    def _all_experts(self, layer, x, topk_weights, topk_ids) -> torch.Tensor:
        """Capturable: every local expert on every row, weighted (0 where the expert is not routed)."""
        x16 = x.to(torch.float16)
        out = torch.zeros(x16.shape[0], layer.hidden_size, dtype=torch.float32, device=x16.device)
        for e in range(len(layer.exl3_experts)):
            weight = (topk_weights.float() * (topk_ids == e)).sum(-1)
            out += weight[:, None] * self._expert(layer, e, x16)
        return out

    def _routed_experts(self, layer, x, topk_weights, topk_ids) -> torch.Tensor:
        """Eager parity path: each routed expert on its own rows only (host sync on the routing)."""
        x16 = x.to(torch.float16)
        out = torch.zeros(x16.shape[0], layer.hidden_size, dtype=torch.float32, device=x16.device)
        for e in torch.unique(topk_ids[topk_ids >= 0]).tolist():  # -1: an expert on another EP rank
            rows, slot = (topk_ids == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, topk_weights[rows, slot].float()[:, None] * self._expert(layer, e, x16[rows]))
        return out


def local_experts(layer: torch.nn.Module, global_ids) -> dict[int, int]:
    """local expert id -> global id, for the global ids this rank holds (expert parallelism keeps a range)."""
    local = {}
    for global_e in global_ids:
        local_e = layer._map_global_expert_id_to_local_expert_id(global_e)
        if 0 <= local_e < layer.num_local_experts:
            local[local_e] = global_e
    return local


def scheduler_token_bound(config=None) -> int:
    """The most rows one forward can carry, from SGLang's server arguments: chunked-prefill and prefill budgets,
    the captured graph sizes (decode batch x draft tokens), and, with chunked prefill off, the context length."""
    from sglang.srt.server_args import get_global_server_args

    args = get_global_server_args()
    draft_tokens = max(1, getattr(args, "speculative_num_draft_tokens", None) or 1)
    graphs = getattr(args, "cuda_graph_config", None)  # resolved per-phase capture sizes (prefill: tokens)
    prefill, decode = getattr(graphs, "prefill", None), getattr(graphs, "decode", None)
    bounds = [getattr(args, "max_prefill_tokens", None) or 0,
              getattr(args, "cuda_graph_max_bs_prefill", None) or 0,
              getattr(prefill, "max_bs", None) or 0, max(getattr(prefill, "bs", None) or [0]),
              (getattr(args, "cuda_graph_max_bs_decode", None) or 0) * draft_tokens,
              max(getattr(decode, "max_bs", None) or 0, *(getattr(decode, "bs", None) or [0])) * draft_tokens,
              (getattr(args, "max_running_requests", None) or 0) * draft_tokens]
    chunk = getattr(args, "chunked_prefill_size", None)
    if chunk is not None and chunk > 0:
        bounds.append(chunk)
    else:  # one prompt may fill the context
        hf = config.checkpoint.config if config is not None and getattr(config, "checkpoint", None) else {}
        bounds.append(getattr(args, "context_length", None) or hf.get("max_position_embeddings") or 0)
    return max(bounds)
