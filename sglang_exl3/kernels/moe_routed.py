"""MoE experts per (token, expert) pair: one m = 1 group source per pair (decode: few pairs, mostly distinct
experts). One table launch for both projections, then the fused forward's five launches (`moe_fused`), or unfused:
three launches per projection with act * up and the weighted top-k combine between and after them. Device ops
only, so CUDA graphs capture it."""

from __future__ import annotations

import torch

from sglang_exl3.kernels.groups import group_run
from sglang_exl3.kernels.moe_ops import MAX_FUSED_TOPK, MoeTables, act_mul, moe_combine, moe_fused
from sglang_exl3.kernels.moe_tables import Exl3ExpertBank, flat_routing_ids, routed_table_builder, routed_tables


def routed_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate: Exl3ExpertBank,
               up: Exl3ExpertBank, down: Exl3ExpertBank, gelu: bool, run=group_run, build=None,
               fused: bool = True) -> torch.Tensor:
    """fp32 [m, H] = sum_j w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j] (ids below 0: another
    expert-parallel rank's, weight 0). `fused`: the five-launch forward (x fp16 or bf16); else the stages one by one
    (x fp16), where `run` runs a group table and `build` fills the tables (tests pass an emulator of the kernels and
    the host-run table code). Gate and up of other bitrates (R7) run as two groups, unfused."""
    m, topk = topk_ids.shape
    split = not gate.runs_with(up)
    fused = fused and topk <= MAX_FUSED_TOPK and not split
    ids = flat_routing_ids(topk_ids)
    pairs, inter, hidden = ids.numel(), gate.n_tiles * 16, down.n_tiles * 16
    if pairs == 0:
        return x.new_zeros((m, hidden), dtype=torch.float32)
    weights = topk_weights.reshape(-1).to(torch.float32)
    if split:  # all three tables in one launch; gate and up then run one group each
        x = x.to(torch.float16)
        table, (g, u, dn) = routed_tables([([gate], topk), ([up], topk), ([down], 1)], ids,
                                          build or routed_table_builder())
        gate_up = torch.cat([run(x, table[b.start:b.start + b.num], b.num, 1, bank.k_tiles, b.items, b.cols,
                                 b.partial, bank.k2, bank.codebook) for b, bank in ((g, gate), (u, up))], dim=1)
        return _down_and_combine(gate_up, table[dn.start:dn.start + dn.num], dn, down, weights, ids, topk, inter,
                                 gelu, run)
    # both launches' tables in one launch: gate/up read token rows (pair // top-k), down reads pair rows
    table, (gu, dn) = routed_tables([([gate, up], topk), ([down], 1)], ids, build or routed_table_builder())
    if fused:
        tables = MoeTables(gate_up=table[gu.start:gu.start + gu.num], down=table[dn.start:dn.start + dn.num],
                           sources=pairs, rows=1, gate_up_items=gu.items, gate_up_partial=gu.partial,
                           down_items=dn.items, down_partial=dn.partial,
                           gate_up_slice=-(-gate.k_tiles // min(gate.splits, up.splits)),  # the longest
                           down_slice=-(-down.k_tiles // down.splits))
        return moe_fused(x, tables, gate, down, weights, ids, topk, gelu)
    gate_up = run(x, table[gu.start:gu.start + gu.num], gu.num, 1, gate.k_tiles, gu.items, gu.cols, gu.partial,
                  gate.k2, gate.codebook)  # [1, 2 * P * I]
    return _down_and_combine(gate_up, table[dn.start:dn.start + dn.num], dn, down, weights, ids, topk, inter, gelu,
                             run)


def _down_and_combine(gate_up: torch.Tensor, table: torch.Tensor, dn, down: Exl3ExpertBank, weights: torch.Tensor,
                      ids: torch.Tensor, topk: int, inter: int, gelu: bool, run) -> torch.Tensor:
    """The unfused tail from the [1, 2 * P * I] gate/up output: act * up, the down group, the weighted combine."""
    pairs = ids.numel()
    act = act_mul(gate_up, pairs, inter, gelu)  # [P, I]
    y = run(act, table, dn.num, 1, down.k_tiles, dn.items, dn.cols, dn.partial, down.k2, down.codebook)  # [1, P * H]
    return moe_combine(y, weights, ids, topk, down.n_tiles * 16)
