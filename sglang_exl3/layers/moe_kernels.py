"""EXL3 experts on our CUDA kernels: how a MoE layer's experts are held and run.

Experts are grouped into tiers of one shape, bitrate and codebook per role (one tier unless the checkpoint mixes
bitrates; an R7 expert's gate, up and down may each have its own: a tier whose gate and up differ runs them as two
groups, unfused). Per tier and role the experts' weights are stacked into one tensor (each shard's trellis becomes a
view: no second copy) and described by an expert bank (GroupSource rows). Two capturable forwards:
- routed: `torch.ops.exl3.moe_decode` per tier, one m = 1 source per (token, expert) pair (decode) in two launches
  that find each pair's expert on the device, or from half a pair per expert `torch.ops.exl3.moe_sorted`
  (kernels/moe_sorted.py: pairs sorted by expert into tiles of 8-64 rows, one source per tile: a table launch and
  the fused five-launch forward); pairs routed to another tier (or another EP rank) carry id -1 and weigh 0.
- rotated slab (from rotated_min_rows(experts, top-k) rows; layers/moe_rotated.py): every expert's W_hat decoded
  into the model's fp16 slab (one launch per tier and role), SGLang's Triton grouped GEMM between per-pair
  rotations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_exl3.format.rank_sliced import ROLE_PROJECTIONS
from sglang_exl3.kernels.backends import Backend
from sglang_exl3.layers.shard import Exl3Shard

ROLES = tuple(role for role, _ in ROLE_PROJECTIONS)  # gate, up, down (SGLang's shard ids)
MIN_SLAB_ROWS = 32  # below this many rows no layer decodes its whole expert set, whatever its shape
# Rows from which the prefill plan runs the rotated slab (layers/moe_rotated.py: every expert's W_hat decoded once
# into the slab, SGLang's Triton grouped GEMM between our per-pair rotation launches) instead of expert-sorted tiles.
# Both costs scale with an expert's size, so the crossover is a number of (token, expert) pairs per expert. H100,
# Qwen3-30B-A3B layer, 4 bits, both paths in one run (benchmarks/results/moe-h100-80gb-hbm3.md, --both-paths): sorted
# 998 µs vs rotated 1,065 at 384 rows, 1,299 vs 1,081 at 512: crossing near 414 rows, ~26 pairs per expert.
ROTATED_PAIRS_PER_EXPERT = 26


def rotated_min_rows(experts: int, topk: int) -> int:
    """The first row count at which the rotated slab is cheaper than expert-sorted tiles for this layer."""
    return max(MIN_SLAB_ROWS, -(-ROTATED_PAIRS_PER_EXPERT * experts // max(topk, 1)))


@dataclass
class ExpertTier:
    experts: list[int]  # local expert ids, ascending
    dense: tuple  # per role: (stacked tiles, suh [E_t, K], svh [E_t * N], codebook)
    banks: tuple  # per role: Exl3ExpertBank
    counters: torch.Tensor | None = None  # the decode forward's arrival counters (zero between calls)


@dataclass
class ExpertTiers:
    tiers: list[ExpertTier]
    tier_of: torch.Tensor | None = None  # int64 [E]: tier of each local expert (None: one tier)
    local_of: torch.Tensor | None = None  # int64 [E]: index within its tier
    position: torch.Tensor | None = None  # int64 [E]: row in the tier-ordered slab
    rotations: tuple[torch.Tensor, ...] | None = None  # tier_rotations, made once by build_tiers

    @property
    def num_experts(self) -> int:
        return sum(len(t.experts) for t in self.tiers)

    def ids_in_tier(self, ids: torch.Tensor, tier: int) -> torch.Tensor:
        """Routing ids as tier `tier` sees them: its local index, or -1 (another tier, or another EP rank)."""
        if self.tier_of is None:
            return ids
        safe = ids.clamp(min=0).long()
        keep = (ids >= 0) & (self.tier_of[safe] == tier)
        return torch.where(keep, self.local_of[safe], -1)

    def slab_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if self.position is None:
            return ids
        return torch.where(ids >= 0, self.position[ids.clamp(min=0).long()], -1).to(ids.dtype)


def _expert_key(shards: dict[str, Exl3Shard]):
    """An expert's tier key (each role's kernel-layout shape, which holds its bitrate, and codebook), or None if our
    kernels cannot run it (widths whole Hadamard blocks and untrimmed; weights in the kernel layout). Gate and up
    may differ in bitrate (R7): such a tier runs them as two groups."""
    if not all(s.launch_ready for s in shards.values()):
        return None
    return tuple((tuple(shards[r].trellis.shape), int(shards[r].codebook)) for r in ROLES)


def tier_groups(experts: list[dict[str, Exl3Shard]]) -> list[list[int]] | None:
    """Local expert ids grouped by shape/bitrate/codebook, tiers in order of first appearance; None if any expert
    cannot run on our kernels."""
    groups: dict = {}
    for e, shards in enumerate(experts):
        key = _expert_key(shards)
        if key is None:
            return None
        groups.setdefault(key, []).append(e)
    return list(groups.values())


def stack_experts(experts: list[dict[str, Exl3Shard]]) -> tuple:
    """Per role, one tier's kernel-layout weights moved into one tensor stacked along N (each shard's trellis
    becomes a view of it), with suh [E, K] and svh [E*N]: what the rotated slab decodes in one launch per role."""
    out = []
    for role in ROLES:
        shards = [e[role] for e in experts]
        stacked = torch.cat([s.trellis for s in shards])
        nt = shards[0].trellis.shape[0]
        for i, s in enumerate(shards):
            s.trellis = stacked[i * nt:(i + 1) * nt]
        suh = torch.stack([s.suh for s in shards])
        out.append((stacked, suh, torch.cat([s.svh for s in shards]), shards[0].codebook))
    return tuple(out)


def expert_banks(experts: list[dict[str, Exl3Shard]]) -> tuple:
    """(gate, up, down) expert banks of one tier, for routed groups."""
    from sglang_exl3.kernels.moe_tables import make_expert_bank

    first = experts[0]
    return tuple(make_expert_bank([e[role].trellis for e in experts], [e[role].suh for e in experts],
                                  [e[role].svh for e in experts], first[role].codebook) for role in ROLES)


def build_tiers(experts: list[dict[str, Exl3Shard]], backend: Backend) -> ExpertTiers | None:
    """The layer's experts as our kernels run them; None for other backends or experts they cannot run."""
    if backend != Backend.CUDA or not experts:
        return None
    groups = tier_groups(experts)
    if groups is None:
        return None
    tiers = []
    for group in groups:
        sub = [experts[e] for e in group]
        dense = stack_experts(sub)  # first: the banks point at the stacked weights
        tiers.append(ExpertTier(group, dense, expert_banks(sub), decode_counters_for(sub)))
    if len(tiers) == 1:
        return ExpertTiers(tiers, rotations=tier_rotations(tiers))
    device = experts[0]["w1"].trellis.device
    tier_of, local_of, position = (torch.empty(len(experts), dtype=torch.int64) for _ in range(3))
    at = 0
    for t, group in enumerate(groups):
        for i, e in enumerate(group):
            tier_of[e], local_of[e], position[e] = t, i, at + i
        at += len(group)
    return ExpertTiers(tiers, tier_of.to(device), local_of.to(device), position.to(device), tier_rotations(tiers))


def tier_rotations(tiers: list[ExpertTier]) -> tuple[torch.Tensor, ...]:
    """Per role, suh [E, K] and svh [E, N] of every expert in slab order, for the rotated slab: (gate suh, gate svh,
    up suh, up svh, down suh, down svh). One tier's are views of its stacked tables; several tiers' are joined here,
    once at load (a few MB per layer that a forward would otherwise copy, and never inside a graph capture, where
    the copy would not run)."""
    out = []
    for role in range(len(ROLES)):
        parts = [(t.dense[role][1], t.dense[role][2].view(len(t.experts), -1)) for t in tiers]
        out += [torch.cat([p[i] for p in parts]) if len(parts) > 1 else parts[0][i] for i in (0, 1)]
    return tuple(out)


def decode_counters_for(experts: list[dict[str, Exl3Shard]]) -> torch.Tensor:
    """Counters for the decode forward of a tier: per-pair sources run below E/2 pairs (sorted_rows), so fewer than
    E pairs (and tokens) ever reach it; sized for 1.5 E, the margin kept should the threshold move up again."""
    from sglang_exl3.kernels.moe_ops import decode_counters

    gate = experts[0]["w1"]
    bound = 3 * len(experts) // 2 + 1
    return decode_counters(bound, bound, gate.trellis.shape[1] * 16, gate.trellis.shape[0] * 16,
                           gate.trellis.device)


def sorted_rows(rows: int, topk: int, experts: int) -> bool:
    """Whether routed rows go to expert-sorted tiles (an expert read once per tile) rather than one source per
    (token, expert) pair: from E/2 pairs. On the Qwen3-30B-A3B layer (E = 128, top-8) the two tie at 64 pairs (m = 8:
    sorted 119.1 µs, the two-launch decode forward 119.6), sorted wins above (m = 12: 154.9 against 171.1) and loses
    below (m = 4: 81.3 against 68.2), where the per-pair sources still read fewer weights (H100,
    benchmarks/results/moe-h100-80gb-hbm3.md, moe-decode-forward-h100-80gb-hbm3.md)."""
    return 2 * rows * topk >= experts


def routed_forward(tiers: ExpertTiers, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   gelu: bool, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[m, H] in fp32, or in `out_dtype` where the forward can round into it itself (one tier on the two-launch
    decode forward): the routed experts only, tier by tier (per pair, or over expert-sorted tiles). The fused
    forwards read fp16 or bf16 x themselves (rounding bf16 to fp16 as a cast would: one launch fewer at decode);
    other dtypes, and the staged forward above MAX_FUSED_TOPK, get fp16."""
    from sglang_exl3.kernels.moe_ops import DECODE_OUT_DTYPES, MAX_FUSED_TOPK

    topk = topk_ids.shape[1]
    if x.dtype != torch.float16 and (x.dtype != torch.bfloat16 or topk > MAX_FUSED_TOPK):
        x = x.to(torch.float16)
    x = x.contiguous()
    out = None
    for t, tier in enumerate(tiers.tiers):
        gate, up, down = tier.banks
        ids = tiers.ids_in_tier(topk_ids, t)
        if sorted_rows(x.shape[0], topk, len(tier.experts)):
            y = torch.ops.exl3.moe_sorted(x, ids, topk_weights, gate.rows, up.rows, down.rows, gate.meta, up.meta,
                                          down.meta, gelu)
        elif topk <= MAX_FUSED_TOPK and tier.counters is not None and gate.runs_with(up):
            kind = DECODE_OUT_DTYPES.index(out_dtype) if len(tiers.tiers) == 1 and out_dtype in DECODE_OUT_DTYPES \
                else 0
            y = torch.ops.exl3.moe_decode(x, ids, topk_weights, gate.rows, up.rows, down.rows, gate.meta,
                                          down.meta, gelu, tier.counters, kind)
        else:
            y = torch.ops.exl3.moe_routed(x, ids, topk_weights, gate.rows, up.rows, down.rows, gate.meta, up.meta,
                                          down.meta, gelu)
        out = y if out is None else out + y
    return out


def reserve_slab(owner, experts: int, inter: int, hidden: int, device) -> None:
    """The model's one fp16 slab for dense expert weights (the largest layer's), allocated at load so that it is
    counted before the KV cache is sized and captured graphs point at one fixed buffer."""
    need = {"w13": experts * 2 * inter * hidden, "w2": experts * hidden * inter}
    slab = getattr(owner, "exl3_moe_slab", None) or {}
    for key, numel in need.items():
        if key not in slab or slab[key].numel() < numel:
            slab[key] = torch.empty(numel, dtype=torch.float16, device=device)
    owner.exl3_moe_slab = slab
