"""`Exl3LinearMethod`: EXL3 linear layers (and the quantized lm_head) inside SGLang.

Fused layers (`qkv_proj`, `gate_up_proj`) keep one EXL3 matrix per source ("shard"): each source
has its own suh/svh, codebook and bitrate, and they are never merged. Loading: placeholder
parameters named like the checkpoint suffixes (`trellis`, `suh`, `svh`, `su`, `sv`, `mcg`, `mul1`)
receive whole tensors per shard; `process_weights_after_loading` checks them against the
checkpoint's records (so a silently skipped tensor is an error at load time), slices them for this
tensor-parallel rank in 128-element units, moves them to the device and, for the torch backend,
caches the decoded W_hat. `apply` runs `torch.ops.exl3.gemm` per shard, or, on our CUDA kernels, one
`torch.ops.exl3.gemm_group` for all the same-input shards of a fused layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from sglang.srt.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.srt.layers.quantization.base_config import LinearMethodBase
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

from sglang_exl3 import knobs
from sglang_exl3.codec.linear import pad_input
from sglang_exl3.codec.signs import input_output_scales
from sglang_exl3.codec.trellis import reconstruct
from sglang_exl3.format import Exl3ModuleRecord
from sglang_exl3.format.constants import padded
from sglang_exl3.kernels.backends import Backend, resolve_backend
from sglang_exl3.layers import output_check
from sglang_exl3.layers.shard import Exl3Shard
from sglang_exl3.layers.tp_slicing import Exl3Slice, slice_columns, slice_rows

logger = logging.getLogger(__name__)

SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1")
_PLACEHOLDER_DTYPES = {"trellis": torch.int16, "suh": torch.float16, "svh": torch.float16, "su": torch.int16,
                       "sv": torch.int16, "mcg": torch.int32, "mul1": torch.int32}


@dataclass(frozen=True)
class ShardPlan:
    """Where shard `shard_id` of a layer comes from and which part of it this rank keeps."""

    shard_id: object
    record: Exl3ModuleRecord
    columns: Exl3Slice | None  # None: keep all columns (row-parallel / replicated)
    rows: Exl3Slice | None  # None: keep all rows
    out_features: int


def register_placeholders(layer: torch.nn.Module, loader, prefix: str = "") -> None:
    """Empty parameters named like the checkpoint suffixes (`{prefix}trellis`, ...) so that SGLang's
    weight routing finds them; `loader` receives every tensor."""
    for suffix in SUFFIXES:
        param = torch.nn.Parameter(torch.empty(0, dtype=_PLACEHOLDER_DTYPES[suffix]), requires_grad=False)
        param.exl3_suffix = suffix
        param.weight_loader = loader
        layer.register_parameter(prefix + suffix, param)


def release_placeholders(layer: torch.nn.Module, device: torch.device, prefix: str = "") -> None:
    """Drop the placeholders' references to the loaded checkpoint tensors."""
    for suffix in SUFFIXES:
        getattr(layer, prefix + suffix).data = torch.empty(0, dtype=_PLACEHOLDER_DTYPES[suffix], device=device)


def build_shard(record: Exl3ModuleRecord, got: dict[str, torch.Tensor], layer_prefix: str, device: torch.device,
                out_features: int, rows: Exl3Slice | None = None, columns: Exl3Slice | None = None) -> Exl3Shard:
    """Check the tensors loaded for one source matrix against its checkpoint record (a tensor SGLang's
    loader skipped is an error here, at load time), slice them for this rank and move them to `device`."""
    name = record.key
    missing = [s for s in ("trellis",) if s not in got]
    if "suh" not in got and "su" not in got:
        missing.append("suh")
    if "svh" not in got and "sv" not in got:
        missing.append("svh")
    if record.codebook.marker and record.codebook.marker not in got:
        missing.append(record.codebook.marker)
    unexpected = [m for m in ("mcg", "mul1") if m in got and m != record.codebook.marker]
    if missing or unexpected:
        raise ValueError(f"Missing or inconsistent EXL3 tensors for {name} (layer {layer_prefix}): "
                         f"missing {missing}, unexpected {unexpected}; the checkpoint's records say "
                         f"codebook {record.codebook.label}. Re-download the checkpoint or check the "
                         "model's weight-name mapping")
    trellis = got["trellis"]
    if tuple(trellis.shape) != (record.in_features // 16, record.out_features // 16, int(record.bits * 16)):
        raise ValueError(f"EXL3 {name}: trellis shape {tuple(trellis.shape)} disagrees with the checkpoint "
                         f"record ({record.in_features}x{record.out_features}, {record.bits} bits)")
    suh, svh = input_output_scales(got)
    if rows is not None:
        trellis, suh = slice_rows(trellis, suh, rows, name)
    if columns is not None:
        trellis, svh = slice_columns(trellis, svh, columns, name)
    return Exl3Shard(
        key=name,
        trellis=trellis.to(device=device, dtype=torch.int16).contiguous(),
        suh=suh.to(device=device, dtype=torch.float16).contiguous(),
        svh=svh.to(device=device, dtype=torch.float16).contiguous(),
        codebook=record.codebook,
        out_features=out_features,
    )


def prepare_for_backend(shards, backend: Backend) -> None:
    """Per-backend load-time preparation. The torch backend decodes each trellis once (its forward is then two
    rotations and a matmul); our CUDA kernels take the trellis with each column strip's tiles contiguous."""
    for shard in shards:
        if backend == Backend.TORCH:
            shard.w_hat = reconstruct(shard.trellis, shard.codebook)
        elif backend == Backend.CUDA and not shard.kernel_layout:
            from sglang_exl3.kernels.dense import prepare

            shard.trellis = prepare(shard.trellis)
            shard.kernel_layout = True


def _share_launches(shards: list[Exl3Shard]) -> bool:
    """Whether the sources can share launches: the same K, bits and codebook, output widths untrimmed and whole
    Hadamard blocks."""
    first = shards[0]
    return all(s.launch_ready and s.trellis.shape[1:] == first.trellis.shape[1:] and s.codebook == first.codebook
               for s in shards)


def group_shards(shards: list[Exl3Shard], backend: Backend):
    """One same-input group for a fused layer's sources (q/k/v, gate/up) on our CUDA kernels, so small-m forwards
    take 3 launches instead of 3 per source; None where the sources cannot share launches."""
    if backend != Backend.CUDA or len(shards) < 2 or not _share_launches(shards):
        return None
    from sglang_exl3.kernels.groups import make_group

    return make_group([s.trellis for s in shards], [s.suh for s in shards], [s.svh for s in shards],
                      shards[0].codebook)


def rotating_shard(shards: list[Exl3Shard], backend: Backend):
    """A single linear as a one-source group for the wgmma ring's rotating form (its output rotated inside the GEMM's
    launch), so that its 33-64 rows skip the split-K partials as a group's do; None with SGLANG_EXL3_DEV_WG_ROTATING
    off (read at load), for several shards (their group has the form), or where the source's wgmma rows are not at
    one split (an lm_head has none; o and down keep 8 on the H100)."""
    if backend != Backend.CUDA or len(shards) != 1 or knobs.get("DEV_WG_ROTATING") == "off" or \
            not _share_launches(shards):
        return None
    from sglang_exl3.kernels.dispatch import single_wg_one_split
    from sglang_exl3.kernels.groups import make_group

    s = shards[0]
    if not single_wg_one_split(s.trellis.shape[1], s.trellis.shape[0], s.trellis.device):
        return None
    return make_group([s.trellis], [s.suh], [s.svh], s.codebook)


def layer_weights(shards: list[Exl3Shard]) -> int:
    """K x N summed over the shards' packed trellis (this rank's slice): the weights one launch would decode."""
    return sum(s.trellis.shape[0] * s.trellis.shape[1] * 256 for s in shards)


def one_launch_shards(shards: list[Exl3Shard], backend: Backend, lm_head: bool = False):
    """The layer's one-launch form on our CUDA kernels, for up to SGLANG_EXL3_DEV_ONE_LAUNCH_MAX_M rows (read once,
    at load: the environment costs ~2 us per read): its sources, or its one source, as one launch with the rotations
    folded in; None where the knob is 0, they cannot share it, and for the lm_head: each of its ~2,400 blocks
    re-rotates all of x (one split), which measured 7% slower than three launches at m = 1
    (benchmarks/results/kernels-one-launch-h200.md, 4096 x 151936); and for layers of more than
    SGLANG_EXL3_DEV_ONE_LAUNCH_MAX_WEIGHTS weights (4194304 by default), where three programmatic launches are faster
    (benchmarks/results/e2e-pdl-ab-h100-80gb-hbm3.md)."""
    max_m = knobs.get("DEV_ONE_LAUNCH_MAX_M")
    if backend != Backend.CUDA or lm_head or max_m == 0 or not _share_launches(shards):
        return None
    if layer_weights(shards) > knobs.get("DEV_ONE_LAUNCH_MAX_WEIGHTS"):
        return None
    from sglang_exl3.kernels.groups import make_one_launch

    return make_one_launch([s.trellis for s in shards], [s.suh for s in shards], [s.svh for s in shards],
                           shards[0].codebook, max_m)


def run_group(x: torch.Tensor, shards: list[Exl3Shard], group) -> torch.Tensor:
    return torch.ops.exl3.gemm_group(x.contiguous(), [s.trellis for s in shards], [s.suh for s in shards],
                                     [s.svh for s in shards], group.table, group.meta, group.codebook)


def run_shard(x16: torch.Tensor, s: Exl3Shard, backend: int, where: str) -> torch.Tensor:
    """x [m, <=K] -> [m, s.out_features] of x's dtype (fp16, or bf16 on our CUDA kernels): input zero-padded to the
    packed K, output trimmed to the logical width (or zero-padded, for an lm_head partition wider than the packed
    vocab)."""
    x16 = pad_input(x16, s.in_features, where).contiguous()
    y = torch.ops.exl3.gemm(x16, s.trellis, s.suh, s.svh, s.w_hat, int(s.codebook), backend)
    n = y.shape[-1]
    if n > s.out_features:
        return y[:, : s.out_features]
    if n < s.out_features:
        return torch.nn.functional.pad(y, (0, s.out_features - n))
    return y


def merged_sources(output_sizes: list[int], records: dict[object, Exl3ModuleRecord],
                   prefix: str) -> list[tuple[object, Exl3ModuleRecord, list[int]]]:
    """(the shard id SGLang's loader passes, record, the outputs it holds) per source matrix of a merged layer. A source
    may hold several consecutive outputs: Qwen3.5's `in_proj_qkv` is outputs 0-2 of `in_proj_qkvz` (SGLang loads it
    with shard id (0, 1, 2)), `in_proj_z` output 3. Each source's outputs are matched against its packed width."""
    ordered = [records[sid] for sid in sorted(records)]
    if len(ordered) == len(output_sizes):
        return [(i, record, [size]) for i, (record, size) in enumerate(zip(ordered, output_sizes, strict=True))]
    out, i = [], 0
    for record in ordered:
        first = i
        while i < len(output_sizes) and padded(sum(output_sizes[first:i])) < record.out_features:
            i += 1
        parts = list(output_sizes[first:i])
        if not parts or padded(sum(parts)) != record.out_features:
            raise ValueError(f"EXL3 {prefix}: {record.key} has {record.out_features} output columns, which do not "
                             f"cover whole outputs of the fused layer (outputs {list(output_sizes)} from output "
                             f"{first}); the checkpoint does not match the model config")
        out.append((first if len(parts) == 1 else tuple(range(first, i)), record, parts))
    if i != len(output_sizes):
        raise ValueError(f"EXL3 {prefix}: the source matrices {[r.key for r in ordered]} cover outputs "
                         f"{list(output_sizes[:i])} of {list(output_sizes)}; the checkpoint does not match the model "
                         "config")
    return out


def attach_shards(layer: torch.nn.Module, shards: list[Exl3Shard], backend: Backend) -> None:
    """What `apply_shards` runs: the layer's shards, their group and one-launch forms, the backend."""
    layer.exl3_shards = shards
    layer.exl3_group = group_shards(shards, backend)
    layer.exl3_rotating = rotating_shard(shards, backend) if layer.exl3_group is None else None
    layer.exl3_one_launch = one_launch_shards(shards, backend, lm_head=isinstance(layer, ParallelLMHead))
    layer.exl3_backend = int(backend)


def plan_shards(layer: torch.nn.Module, records: dict[object, Exl3ModuleRecord], prefix: str) -> list[ShardPlan]:
    """Per-rank slices for every source matrix of `layer` (SGLang's layer topology)."""
    plans = []
    if isinstance(layer, ParallelLMHead):
        (record,) = records.values()
        size, tp = layer.num_embeddings_per_partition, layer.tp_size
        cut = Exl3Slice(layer.shard_indices.org_vocab_start_index if tp > 1 else 0, size,
                        layer.num_embeddings_padded)
        return [ShardPlan(None, record, cut, None, size)]
    tp_rank, tp_size = getattr(layer, "tp_rank", 0), getattr(layer, "tp_size", 1)
    if isinstance(layer, ReplicatedLinear) or tp_size == 1:
        tp_rank, tp_size = 0, 1
    if isinstance(layer, RowParallelLinear):
        (record,) = records.values()
        size = layer.input_size_per_partition
        rows = Exl3Slice(tp_rank * size, size, layer.input_size) if tp_size > 1 else None
        return [ShardPlan(None, record, None, rows, layer.output_size)]
    if isinstance(layer, QKVParallelLinear):
        sizes = {"q": layer.num_heads * layer.head_size, "k": layer.num_kv_heads * layer.head_size,
                 "v": layer.num_kv_heads * layer.v_head_size}
        totals = {"q": layer.total_num_heads * layer.head_size,
                  "k": layer.total_num_kv_heads * layer.head_size,
                  "v": layer.total_num_kv_heads * layer.v_head_size}
        for sid in ("q", "k", "v"):
            source_rank = tp_rank if sid == "q" else tp_rank // layer.num_kv_head_replicas
            cut = Exl3Slice(source_rank * sizes[sid], sizes[sid], totals[sid])
            plans.append(ShardPlan(sid, records[sid], cut, None, sizes[sid]))
        return plans
    if isinstance(layer, MergedColumnParallelLinear):
        for loader_id, record, parts in merged_sources(layer.output_sizes, records, prefix):
            total = sum(parts)
            if tp_size == 1:
                plans.append(ShardPlan(loader_id, record, Exl3Slice(0, total, total), None, total))
                continue
            for i, part in enumerate(parts):  # this rank's cut of each output the source matrix holds
                size = part // tp_size
                plans.append(ShardPlan(loader_id, record, Exl3Slice(sum(parts[:i]) + tp_rank * size, size, total),
                                       None, size))
        return plans
    if isinstance(layer, LinearBase):  # plain column-parallel or replicated
        (record,) = records.values()
        size = layer.output_partition_sizes[0] if hasattr(layer, "output_partition_sizes") else layer.output_size
        return [ShardPlan(None, record, Exl3Slice(tp_rank * size, size, layer.output_size), None, size)]
    raise TypeError(f"EXL3 cannot quantize {type(layer).__name__} at {prefix}")


class Exl3LinearMethod(LinearMethodBase):
    """Linear method for EXL3 modules; `records` maps shard id (None, "q"/"k"/"v", 0/1) to the
    checkpoint record of that source matrix."""

    def __init__(self, records: dict[object, Exl3ModuleRecord], prefix: str, config=None):
        self.records = records
        self.prefix = prefix
        self.config = config

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        if isinstance(layer, ParallelLMHead) and layer.num_added_embeddings > 0:
            raise ValueError(
                f"EXL3 lm_head with added vocabulary is unsupported ({layer.num_added_embeddings} added "
                "tokens): tensor-parallel slicing would silently misalign. Strip --lora-extra-vocab-size / "
                "added tokens, or keep lm_head unquantized (exllamav3 -hb 16)")
        layer.exl3_plans = plan_shards(layer, self.records, self.prefix)
        layer.exl3_loaded = {plan.shard_id: {} for plan in layer.exl3_plans}
        register_placeholders(layer, self._make_loader(layer))

    def _make_loader(self, layer: torch.nn.Module):
        def load(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id=None, *args, **kwargs) -> None:
            if shard_id not in layer.exl3_loaded:
                raise ValueError(f"EXL3 {self.prefix}: unexpected shard {shard_id!r} for .{param.exl3_suffix} "
                                 f"(expected {list(layer.exl3_loaded)})")
            layer.exl3_loaded[shard_id][param.exl3_suffix] = loaded
        return load

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.config is not None:
            self.config.check_all_claimed()
        device = layer.trellis.device
        backend = resolve_backend(device)
        shards = [build_shard(plan.record, layer.exl3_loaded[plan.shard_id], self.prefix, device,
                              plan.out_features, rows=plan.rows, columns=plan.columns)
                  for plan in layer.exl3_plans]
        prepare_for_backend(shards, backend)
        attach_shards(layer, shards, backend)
        del layer.exl3_loaded
        release_placeholders(layer, device)
        if isinstance(layer, ParallelLMHead):
            # what SGLang hands a speculative draft (`get_embed_and_head`): a stub naming this head, which the
            # plugin's hook swaps for the head itself (layers/draft_sharing.py)
            stub = torch.nn.Parameter(torch.empty(0, layer.embedding_dim, dtype=torch.float16, device=device),
                                      requires_grad=False)
            stub.exl3_head = layer
            layer.register_parameter("weight", stub)
        if knobs.get("LOG_PATH_SELECTION"):
            logger.info("EXL3 path %s -> %s (%s)", self.prefix, Backend(backend).name.lower(),
                        ", ".join(f"{s.key}: {s.codebook.label}" for s in shards))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return apply_shards(layer, x, bias, f"EXL3 {self.prefix}")


def apply_shards(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, where: str) -> torch.Tensor:
    """A linear layer's EXL3 forward over its shards (`attach_shards`): one launch for decode-sized m where the
    one-launch form is on, else one group's launches or one GEMM per shard, then the bias."""
    lead, width = x.shape[:-1], x.shape[-1]
    # our CUDA kernels read and write bf16 activations themselves (the values of casting around an fp16 call)
    act = torch.bfloat16 if x.dtype == torch.bfloat16 and layer.exl3_backend == Backend.CUDA else torch.float16
    xa = pad_input(x.reshape(-1, width).to(act), layer.exl3_shards[0].in_features, where)
    one = layer.exl3_one_launch
    one_launch = one is not None and one.serves(xa.shape[0])
    rotating = layer.exl3_rotating is not None and layer.exl3_rotating.rotating_serves(xa.shape[0])
    if one_launch:
        y = torch.ops.exl3.one_launch(xa, one.group.table, one.counters, one.group.meta, one.group.codebook)
    elif layer.exl3_group is not None:
        y = run_group(xa, layer.exl3_shards, layer.exl3_group)
    elif rotating:
        y = run_group(xa, layer.exl3_shards, layer.exl3_rotating)
    else:
        outs = [run_shard(xa, s, layer.exl3_backend, where) for s in layer.exl3_shards]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    if output_check.enabled(layer, xa):
        want = torch.cat([output_check.shard_reference(xa, s) for s in layer.exl3_shards], dim=-1)
        path = "one-launch" if one_launch else "group" if layer.exl3_group is not None else "rotating" if rotating \
            else Backend(layer.exl3_backend).name.lower()
        output_check.report(layer, where, path, xa, y, want)
    if bias is not None:
        y = y.float() + bias.float()
    return y.to(x.dtype).reshape(*lead, y.shape[-1])
