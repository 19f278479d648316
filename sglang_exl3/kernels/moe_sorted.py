"""MoE experts over expert-sorted rows: one group source per (expert, tile of rows).

The routed path (`torch.ops.exl3.moe_routed`) runs one m = 1 source per (token, expert) pair, so an expert
routed p times is read p times: fine at decode (few pairs, mostly distinct experts), wasteful once pairs share
experts (H200, Qwen3-30B-A3B layer: 14.6 µs per row of top-8 from m = 16 to 64). Here the pairs are sorted by
expert on the device, their input rows gathered into tiles of 8-64 rows per expert, and each tile is one
source of the same grouped kernels, so an expert is read once per tile. Everything is device ops with static
shapes (tile rows from the mean pairs per expert; the tile count's bound P / tile + min(E, P), surplus sources
marked empty), so CUDA graphs capture it. The sources run unsplit along K (the tiles give the parallelism), or
with `split_k` split while the tiles' column strips fill less than a wave (few tiles of large experts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_exl3.kernels.dispatch import decode_splits
from sglang_exl3.kernels.groups import group_run, pack_tiles_splits
from sglang_exl3.kernels.moe_ops import MAX_FUSED_TOPK, MoeTables, act_mul, moe_combine, moe_fused
from sglang_exl3.kernels.moe_tables import (
    MAX_PLAN_EXPERTS,
    Exl3ExpertBank,
    flat_routing_ids,
    sorted_gather,
    sorted_plan_launch,
    sorted_table_builder,
)

MIN_TILE_ROWS, MAX_TILE_ROWS = 8, 64  # the fused kernel's row groups: 8 .. 64 rows per source


def tile_rows(pairs: int, experts: int) -> int:
    """Rows per tile from the mean pairs per expert (a power of two in [8, 64]): small tiles while experts see few
    rows (less padding), large ones for long prefills (each expert read once per tile)."""
    mean = max(1, -(-pairs // max(experts, 1)))
    return min(MAX_TILE_ROWS, max(MIN_TILE_ROWS, 1 << (mean - 1).bit_length()))


@dataclass(frozen=True)
class SortedPlan:
    rows: torch.Tensor  # int64 [P]: each pair's row in the sorted, tiled input (the dump row for ids below 0)
    experts: torch.Tensor  # int64 [S]: each source's expert (sources past `filled` are empty)
    filled: torch.Tensor  # int64 []: tiles in use
    sources: int  # S: the static bound on tiles
    tile: int


def max_tiles(pairs: int, experts: int, tile: int) -> int:
    """At most one partial tile per routed expert on top of the full ones, and never more tiles than pairs."""
    return min(pairs, -(-pairs // tile) + min(experts, pairs))


def sorted_plan(ids: torch.Tensor, experts: int, tile: int) -> SortedPlan:
    """Where each (token, expert) pair goes: experts in order, each one's pairs in tiles of `tile` rows, in their
    order (int32/int64 ids [pairs]; outside [0, experts): another EP rank's expert, no tile). CUDA ids: one library
    launch (sorted_plan_launch); otherwise, and for no pairs at all, the torch ops of torch_sorted_plan, its
    reference."""
    if not ids.is_cuda or experts > MAX_PLAN_EXPERTS or ids.numel() == 0:
        return torch_sorted_plan(ids, experts, tile)
    sources = max_tiles(ids.numel(), experts, tile)
    rows, src_expert, filled = sorted_plan_launch(ids.reshape(-1).contiguous(), experts, tile, sources)
    return SortedPlan(rows=rows, experts=src_expert, filled=filled, sources=sources, tile=tile)


def torch_sorted_plan(ids: torch.Tensor, experts: int, tile: int) -> SortedPlan:
    """sorted_plan in torch ops (~25 launches on a GPU)."""
    pairs = ids.numel()
    dev = ids.device
    e = ids.reshape(-1).to(torch.int64)
    valid = (e >= 0) & (e < experts)
    e = torch.where(valid, e, experts)  # another EP rank's expert counts as expert E: no tile
    # each pair's rank among the earlier pairs of its expert (a stable order) from running counts per expert: a
    # compare, a scan and a gather, where a stable sort took 27 µs of the layer's 460 at 64 rows (H200, moe-profile)
    hit = e[:, None] == torch.arange(experts + 1, device=dev)  # [P, E + 1]
    seen = hit.cumsum(0, dtype=torch.int32)
    rank = seen.gather(1, e[:, None]).squeeze(1).to(torch.int64) - 1
    counts = hit[:, :experts].sum(0)  # not seen[-1]: no row there when no pair is routed
    tiles = (counts + tile - 1) // tile
    tile_end = torch.cumsum(tiles, 0)
    start = torch.cat([tile_end - tiles, tile_end.new_zeros(1)])
    rows = start[e] * tile + rank
    sources = max_tiles(pairs, experts, tile)
    rows = torch.where(valid, rows, sources * tile)
    src = torch.arange(sources, device=dev)
    src_expert = torch.searchsorted(tile_end, src, right=True).clamp(max=experts - 1)
    return SortedPlan(rows=rows, experts=src_expert, filled=tile_end[-1], sources=sources, tile=tile)


@dataclass(frozen=True)
class SortedTable:
    table: torch.Tensor  # int64 [banks * S, 8]: GroupSource rows, bank by bank
    items: int  # static totals of the group: work items, output columns and partial elements per row
    cols: int
    part: int


def sorted_tables(groups: list[list[Exl3ExpertBank]], plan: SortedPlan, build=None,
                  splits: list[int] | None = None) -> list[SortedTable]:
    """GroupSource rows for every (group, bank, tile): the tile's expert, x rows [s * tile, (s + 1) * tile), K cut
    into the group's `splits` (default: unsplit). Columns and partials ([splits, tile, N] per source) are laid out
    for all S sources (static); work items only for the filled ones, numbered bank by bank, and the empty sources
    (n_tiles = 0) own none; each group's from 0. `build(banks, experts, filled, tile, params, table)` fills one
    table for every bank of every group, params holding per bank the items, columns and partial elements of the
    banks before it in its group and its splits (default: the torch reference; `sorted_table_builder` is the
    library's one launch)."""
    s, banks, params, sizes = plan.sources, [], [], []
    for group, k_splits in zip(groups, splits or [1] * len(groups), strict=True):
        items = cols = part = 0  # per filled tile, n_tiles x splits work items; per tile, splits [tile, N] partials
        for b in group:
            params.append((items, cols, part, k_splits))
            items, cols = items + b.n_tiles * k_splits, cols + s * b.n_tiles * 16
            part += s * b.n_tiles * 16 * k_splits
        sizes.append((len(group), s * items, cols, part))
        banks += group
    table = torch.empty(len(banks) * s, 8, dtype=torch.int64, device=plan.experts.device)
    (build or _torch_sorted_rows)(banks, plan.experts, plan.filled, plan.tile, params, table)
    out, at = [], 0
    for num, items, cols, part in sizes:
        out.append(SortedTable(table=table[at * s:(at + num) * s], items=items, cols=cols, part=part))
        at += num
    return out


def _torch_sorted_rows(banks: list[Exl3ExpertBank], experts: torch.Tensor, filled: torch.Tensor, tile: int,
                       params: list[tuple[int, int, int, int]], table: torch.Tensor) -> None:
    """The reference for the library's sorted_tables_kernel (one launch for all banks)."""
    s = experts.shape[0]
    src = torch.arange(s, device=experts.device)
    live = src < filled
    for i, (b, (items_before, cols_before, parts_before, k_splits)) in enumerate(zip(banks, params, strict=True)):
        out = table[i * s:(i + 1) * s]
        out[:, :3] = b.rows.index_select(0, experts)[:, :3]
        out[:, 3] = torch.where(live, pack_tiles_splits(b.n_tiles, k_splits), pack_tiles_splits(0, k_splits))
        out[:, 4] = src * tile
        out[:, 5] = filled * items_before + torch.minimum(src, filled) * (b.n_tiles * k_splits)
        out[:, 6] = cols_before + src * (b.n_tiles * 16)
        out[:, 7] = parts_before + src * (b.n_tiles * 16 * k_splits)


def sorted_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate: Exl3ExpertBank,
               up: Exl3ExpertBank, down: Exl3ExpertBank, gelu: bool, tile: int | None = None,
               run=group_run, fused: bool = True, build=None, split_k: bool = False) -> torch.Tensor:
    """fp32 [m, H] = sum_j w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)) over expert-sorted tiles. `fused`: the
    five-launch forward after the sort and gather; else the stages one by one, where `run` runs a group table
    (tests pass an emulator of the kernels). Gate and up of other bitrates (R7) run as two groups, unfused. The
    tables come from `build` (sorted_tables; default: the library's one launch for CUDA x, torch for CPU x).
    `split_k`: each group's sources split along K (sorted_splits) rather than unsplit; not the dispatch's choice
    until measured (benchmarks/moe.py --both-paths times it as ours_sorted_split_us)."""
    m, topk = topk_ids.shape
    split = not gate.runs_with(up)
    fused = fused and topk <= MAX_FUSED_TOPK and not split
    ids = flat_routing_ids(topk_ids)
    experts = gate.rows.shape[0]
    plan = sorted_plan(ids, experts, tile or tile_rows(ids.numel(), experts))
    tile = plan.tile
    s, inter, hidden = plan.sources, gate.n_tiles * 16, down.n_tiles * 16
    xs = torch.empty(s * tile + 1, x.shape[1], dtype=x.dtype if fused else torch.float16, device=x.device)
    if fused and x.is_cuda:  # pair p's row is x[p // top-k]; ids of other ranks go to the dump row
        sorted_gather(x, plan.rows, topk, xs)
    else:
        xs.index_copy_(0, plan.rows, x.to(xs.dtype).unsqueeze(1).expand(-1, topk, -1).reshape(-1, x.shape[1]))
    weights = topk_weights.reshape(-1).to(torch.float32)
    build = build or (sorted_table_builder() if x.is_cuda else None)
    groups = [[gate], [up]] if split else [[gate, up]]  # [tile, 2 * S * I] either way: gate sources' columns first
    groups_dn = [*groups, [down]]
    splits = [sorted_splits(banks[0], s * len(banks), x.device) if split_k else 1 for banks in groups_dn]
    *gu, dn = sorted_tables(groups_dn, plan, build, splits)  # every table in one launch
    if fused:
        (gu,) = gu
        tables = MoeTables(gate_up=gu.table, down=dn.table, sources=s, rows=tile, gate_up_items=gu.items,
                           gate_up_partial=gu.part, down_items=dn.items, down_partial=dn.part,
                           gate_up_slice=gate.k_tiles // splits[0], down_slice=down.k_tiles // splits[-1])
        return moe_fused(xs, tables, gate, down, weights, ids, topk, gelu, pair_rows=plan.rows)
    gate_up = torch.cat([_run_group(run, xs, banks, t, tile) for banks, t in zip(groups, gu, strict=True)], dim=1)
    act = act_mul(gate_up, s, inter, gelu)  # [S * tile, I]: source-major, the sorted row order again
    y = run(act, dn.table, s, tile, down.k_tiles, dn.items, dn.cols, dn.part, down.k2, down.codebook)  # [tile, S * H]
    offsets = (plan.rows % tile) * (s * hidden) + torch.div(plan.rows, tile, rounding_mode="floor") * hidden
    offsets = torch.where(ids >= 0, offsets, 0)
    return moe_combine(y, weights, ids, topk, hidden, rows=offsets)


def sorted_splits(bank: Exl3ExpertBank, sources: int, device: torch.device) -> int:
    """K splits for `sources` sorted sources of `bank`'s shape: the most (whole 128-blocks each) that keep their
    column strips within one wave of resident warps, as the decode forward's launches (decode_splits). The static
    source count bounds the filled tiles, so the split count is the one for every tile in use. Mixtral's down
    projection (K = 14336, 256 column strips) at 2 tiles: 8 splits; the Qwen3-30B-A3B layer from 8 rows: 1."""
    return decode_splits(bank.k_tiles, bank.n_tiles, sources, device)


def _run_group(run, xs: torch.Tensor, banks: list[Exl3ExpertBank], table: SortedTable, tile: int) -> torch.Tensor:
    """One group launch over the sorted tiles for banks that share bits and codebook."""
    first = banks[0]
    return run(xs, table.table, table.table.shape[0], tile, first.k_tiles, table.items, table.cols, table.part,
               first.k2, first.codebook)
