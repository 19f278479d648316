"""MoE experts as banks of group sources, and the tables that route tokens to them: per (token, expert) pair, or
per tile of expert-sorted rows, built on the device from the routing (capturable) by one library launch each, with
torch references for the tests.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from sglang_exl3.format.constants import Codebook
from sglang_exl3.kernels.checks import check_source, ids_bytes, k2_of
from sglang_exl3.kernels.dispatch import default_splits
from sglang_exl3.kernels.groups import pack_tiles_splits
from sglang_exl3.kernels.library import check, load_library, stream


@dataclass(frozen=True)
class Exl3ExpertBank:
    """One role (gate, up or down) of a MoE layer's local experts as GroupSource rows [E, 8] in device memory, for
    routed groups: one source per (token, expert) pair, gathered on the device from the routing (capturable).
    Every expert of a bank shares K, N, bits and codebook."""

    rows: torch.Tensor  # int64 [E, 8]: tiles, suh, svh, n_tiles | splits << 32, then 4 fields set per pair
    n_tiles: int
    k_tiles: int
    splits: int
    k2: int
    codebook: int
    sources: tuple = ()

    @property
    def meta(self) -> list[int]:
        return [self.n_tiles, self.k_tiles, self.splits, self.k2, self.codebook]

    @classmethod
    def from_meta(cls, rows: torch.Tensor, meta: list[int]) -> Exl3ExpertBank:
        n_tiles, k_tiles, splits, k2, codebook = meta
        return cls(rows=rows, n_tiles=n_tiles, k_tiles=k_tiles, splits=splits, k2=k2, codebook=codebook)

    def runs_with(self, other: Exl3ExpertBank) -> bool:
        """Whether one launch can run both banks (the fused forwards run gate and up as one group): same shape,
        bits and codebook. R7 checkpoints give an expert's gate and up their own bitrates."""
        return (self.n_tiles, self.k_tiles, self.k2, self.codebook) == (other.n_tiles, other.k_tiles, other.k2,
                                                                         other.codebook)


def make_expert_bank(tiles: list[torch.Tensor], suh: list[torch.Tensor], svh: list[torch.Tensor],
                     codebook: Codebook, splits: int | None = None) -> Exl3ExpertBank:
    if not tiles or not (len(tiles) == len(suh) == len(svh)):
        raise ValueError("an expert bank needs matching, non-empty lists of tiles, suh and svh")
    nt, kt, k2 = tiles[0].shape[0], tiles[0].shape[1], k2_of(tiles[0])
    for i, t in enumerate(tiles):
        check_source(f"expert {i}", t, suh[i], svh[i])
        if tuple(t.shape) != tuple(tiles[0].shape):
            raise ValueError(f"expert {i}: weights {tuple(t.shape)}, expert 0 {tuple(tiles[0].shape)} (the experts "
                             "of one bank share K, N and bits)")
    sp = splits or default_splits(kt, nt, tiles[0].device)
    rows = bank_rows([(t.data_ptr(), u.data_ptr(), v.data_ptr()) for t, u, v in zip(tiles, suh, svh, strict=True)],
                     nt, sp)
    return Exl3ExpertBank(rows=rows.to(tiles[0].device), n_tiles=nt, k_tiles=kt, splits=sp, k2=k2,
                          codebook=int(codebook), sources=(tuple(tiles), tuple(suh), tuple(svh)))


def bank_rows(pointers: list[tuple[int, int, int]], n_tiles: int, splits: int) -> torch.Tensor:
    """int64 [E, 8] GroupSource rows of one bank (per-pair fields left 0: routed_table fills them)."""
    return torch.tensor([[t, u, v, pack_tiles_splits(n_tiles, splits), 0, 0, 0, 0] for t, u, v in pointers],
                        dtype=torch.int64)


@dataclass(frozen=True)
class RoutedBlock:
    """One group's block of a routed table: its rows [start, start + num) and the totals its launch needs."""

    start: int
    num: int
    items: int
    cols: int
    partial: int
    widths: tuple[int, ...]


def routed_tables(groups: list[tuple[list[Exl3ExpertBank], int]], ids: torch.Tensor,
                  build=None) -> tuple[torch.Tensor, list[RoutedBlock]]:
    """GroupSource rows for every (group, bank, pair): bank b's expert ids[p] reading x row p // x_row_div (the
    group's), numbered bank by bank, pair by pair, each group's work items, columns and partials from 0; an id below
    0 (another EP rank's expert) reads expert 0, to be weighed 0 by the caller. `build(banks, ids, params, table)`
    fills the table, params holding per bank (item0, col0, base0, x_row_div) (default: the torch reference;
    `routed_table_builder` is the library's one launch for all banks of all groups)."""
    pairs = ids.shape[0]
    banks, params, blocks = [], [], []
    for group, x_row_div in groups:
        item = col = base = 0
        for b in group:
            params.append((item, col, base, x_row_div))
            items, cols, part = source_sizes(b)
            item, col, base = item + pairs * items, col + pairs * cols, base + pairs * part
        blocks.append(RoutedBlock(start=len(banks) * pairs, num=len(group) * pairs, items=item, cols=col,
                                  partial=base, widths=tuple(b.n_tiles * 16 for b in group)))
        banks += group
    table = torch.empty(len(banks) * pairs, 8, dtype=torch.int64, device=ids.device)
    (build or _torch_routed_rows)(banks, ids, params, table)
    return table, blocks


def routed_table(banks: list[Exl3ExpertBank], ids: torch.Tensor, x_row_div: int,
                 build=None) -> tuple[torch.Tensor, int, int, int, list[int]]:
    """One group's routed table: the table, total work items, output columns, partial elements and each bank's
    output width."""
    table, (block,) = routed_tables([(banks, x_row_div)], ids, build)
    return table, block.items, block.cols, block.partial, list(block.widths)


def source_sizes(bank: Exl3ExpertBank) -> tuple[int, int, int]:
    """Work items, output columns and partial elements of one source of the bank."""
    n = bank.n_tiles * 16
    return bank.n_tiles * bank.splits, n, bank.splits * n


def _torch_routed_rows(banks: list[Exl3ExpertBank], ids: torch.Tensor, params: list[tuple[int, int, int, int]],
                       table: torch.Tensor) -> None:
    """The reference builder (torch ops): what the kernel's routed_source computes per pair."""
    pairs = ids.shape[0]
    arange = torch.arange(pairs, device=ids.device, dtype=torch.int64)
    experts = ids.to(torch.int64).clamp(min=0)
    for i, (b, (item0, col0, base0, x_row_div)) in enumerate(zip(banks, params, strict=True)):
        items, cols, part = source_sizes(b)
        out = table[i * pairs:(i + 1) * pairs]
        out[:, :4] = b.rows.index_select(0, experts)[:, :4]
        out[:, 4] = arange // x_row_div
        out[:, 5] = item0 + arange * items
        out[:, 6] = col0 + arange * cols
        out[:, 7] = base0 + arange * part


def flat_routing_ids(topk_ids: torch.Tensor) -> torch.Tensor:
    """[tokens * top-k] routing ids as the MoE kernels read them: SGLang's int32 (or int64) as they come, anything
    else as int32; ids below 0 (another expert-parallel rank's experts) are kept, the kernels skip them."""
    ids = topk_ids.reshape(-1)
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.to(torch.int32)
    return ids.contiguous()


def routed_table_builder(on_host: bool = False):
    """The library's one-launch builder for all banks (`on_host`: the same code over host memory, for tests without
    a GPU)."""
    lib = load_library()

    def build(banks, ids, params, table):
        flat = []
        for b, (item0, col0, base0, x_row_div) in zip(banks, params, strict=True):
            flat += [b.rows.data_ptr(), item0, col0, base0, *source_sizes(b), x_row_div]
        host = (ctypes.c_longlong * len(flat))(*flat)
        on = None if on_host else stream(ids)
        check(lib.exl3_routed_tables(host, len(banks), ids.data_ptr(), ids_bytes(ids), ids.shape[0],
                                      table.data_ptr(), int(on_host), on), "routed tables")
    return build


def sorted_table_builder(on_host: bool = False):
    """The library's one-launch builder of expert-sorted tables for all banks (kernels/moe_sorted.py sorted_tables;
    `on_host`: the same code over host memory, for tests without a GPU)."""
    lib = load_library()

    def build(banks, experts, filled, tile, params, table):
        flat = []
        for b, (items_before, cols_before, parts_before, splits) in zip(banks, params, strict=True):
            flat += [b.rows.data_ptr(), b.n_tiles, items_before, cols_before, parts_before, splits]
        host = (ctypes.c_longlong * len(flat))(*flat)
        check(lib.exl3_sorted_tables(host, len(banks), experts.data_ptr(), filled.data_ptr(), experts.shape[0], tile,
                                      table.data_ptr(), int(on_host), None if on_host else stream(table)),
               "sorted tables")
    return build


MAX_PLAN_EXPERTS = 1024  # the library's one-block plan keeps per-expert counts in shared memory


def sorted_plan_launch(ids: torch.Tensor, experts: int, tile: int,
                       sources: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The library's expert-sorted plan in one launch, in place of kernels/moe_sorted.py torch_sorted_plan's ~25:
    int64 rows [pairs], each tile's expert [sources] and the filled tile count []. CPU ids: the same plan from the
    library's host code, for tests without a GPU."""
    pairs = ids.numel()
    if not 0 < experts <= MAX_PLAN_EXPERTS or tile <= 0 or sources <= 0 or pairs == 0:
        raise ValueError(f"sorted plan: 1-{MAX_PLAN_EXPERTS} experts, a positive tile and sources and some pairs, got "
                         f"{experts} experts, tile {tile}, {sources} sources, {pairs} pairs")
    rows = torch.empty(pairs, dtype=torch.int64, device=ids.device)
    src_expert = torch.empty(sources, dtype=torch.int64, device=ids.device)
    filled = torch.empty((), dtype=torch.int64, device=ids.device)
    on_host = not ids.is_cuda
    check(load_library().exl3_sorted_plan(ids.data_ptr(), ids_bytes(ids), pairs, experts, tile, sources,
                                           rows.data_ptr(), src_expert.data_ptr(), filled.data_ptr(), int(on_host),
                                           None if on_host else stream(ids)), "sorted plan")
    return rows, src_expert, filled


def sorted_gather(x: torch.Tensor, rows: torch.Tensor, topk: int, out: torch.Tensor) -> torch.Tensor:
    """out[rows[p]] = x[p // topk] for every pair p, in one launch (fp16 or bf16 x and out of one dtype)."""
    pairs = rows.numel()
    if x.dtype not in (torch.float16, torch.bfloat16) or out.dtype != x.dtype or x.dim() != 2 or \
            out.shape[1:] != x.shape[1:] or rows.dtype != torch.int64 or pairs != x.shape[0] * topk or \
            not out.is_contiguous():
        raise ValueError(f"sorted_gather: fp16/bf16 x [tokens, H] and contiguous out [*, H] of its dtype, int64 rows "
                         f"[tokens * {topk}]; got x {x.dtype} {tuple(x.shape)}, out {out.dtype} "
                         f"{tuple(out.shape)}, rows {rows.dtype} {pairs}")
    check(load_library().exl3_sorted_gather(x.contiguous().data_ptr(), rows.contiguous().data_ptr(), pairs, topk,
                                             x.shape[1], out.data_ptr(), stream(x)), "sorted gather")
    return out
