"""Same-input groups (q/k/v, gate/up) and the one-launch form of a linear or group on our kernels.

A group runs its sources as one: a multi-source input rotation, one GEMM launch over every source's work items and
one output rotation into the concatenated output (three launches, not three per source); on the wgmma ring at one
split per column block, the output rotation joins the GEMM's launch. The one-launch form folds both rotations into
the GEMM for decode-sized m. Tables are built once per layer at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_exl3.format.constants import Codebook
from sglang_exl3.kernels.checks import check_act, check_source, check_tiles, k2_of
from sglang_exl3.kernels.dispatch import (
    CROSSOVERS,
    WGMMA_RING_MODES,
    RingMode,
    default_splits,
    fused_crossover_m,
    launch_pdl,
    one_launch_splits,
    one_split,
    ring_mode,
    rotating_serves,
    use_xs,
    uses_ring,
    wg_splits,
    xs_fits,
)
from sglang_exl3.kernels.library import check, load_library, stream


@dataclass(frozen=True)
class Exl3Group:
    """Same-input sources that run as one. `table` (GroupSource[] in device memory) points into the source tensors,
    which `sources` keeps alive. On the wgmma ring a group made at the policy's splits runs a second set of rows at
    fewer splits (`wg_splits`: one where its columns fill the SMs, else half): `launch_rows`."""

    table: torch.Tensor  # int64 [num, 8], then the wgmma ring's [num, 8] where wg_items > 0
    num: int
    k_tiles: int
    total_items: int
    total_cols: int
    partial_per_row: int  # sum over sources of splits * N
    k2: int
    codebook: int
    sources: tuple = ()
    max_slice: int = 0  # the longest K slice of any source, in tiles (sizes x in shared memory)
    wg_items: int = 0  # the wgmma ring's rows (table[num:]): work items and partials per row; 0: none
    wg_partial_per_row: int = 0
    wg_one_split: int = 0  # 1 where those rows are all at one split (the rotating form serves them)

    @property
    def meta(self) -> list[int]:
        """The ints a registered op needs to rebuild this group around its table (see from_meta)."""
        return [self.num, self.k_tiles, self.total_items, self.total_cols, self.partial_per_row, self.k2,
                self.max_slice, self.wg_items, self.wg_partial_per_row, self.wg_one_split]

    @classmethod
    def from_meta(cls, table: torch.Tensor, meta: list[int], codebook: int) -> Exl3Group:
        num, k_tiles, total_items, total_cols, partial_per_row, k2, max_slice, wg_items, wg_partial, wg_one = meta
        return cls(table=table, num=num, k_tiles=k_tiles, total_items=total_items, total_cols=total_cols,
                   partial_per_row=partial_per_row, k2=k2, codebook=int(codebook), max_slice=max_slice,
                   wg_items=wg_items, wg_partial_per_row=wg_partial, wg_one_split=wg_one)

    def launch_rows(self, ring: int) -> tuple[torch.Tensor, int, int]:
        """The table rows, work items and partials per row that a launch on `ring` takes: the wgmma ring's own rows
        where the group has them, else the load-time rows."""
        if ring in WGMMA_RING_MODES and self.wg_items:
            return self.table[self.num:], self.wg_items, self.wg_partial_per_row
        return self.table[:self.num], self.total_items, self.partial_per_row

    def runs_fused(self, m: int) -> bool:
        """Whether m rows run as this group's fused launches: up to fused_crossover_m(); through the x ring from
        ring_min_m rows (the wgmma ring up to wg_group_max_m); otherwise above global_loads_max_m only where x can be
        staged (its splits are fixed at load; a gate/up group with long K slices cannot stage 64 rows). Otherwise
        each source runs as a single linear, by the single-linear policy."""
        if m > fused_crossover_m():
            return False
        ring = self.ring_mode(m)
        if ring in WGMMA_RING_MODES:
            return m <= CROSSOVERS.wg_group_max_m
        return bool(ring) or (m <= CROSSOVERS.global_loads_max_m or self.xs_slice(m) > 0)

    def ring_mode(self, m: int) -> int:
        """The x-ring mode for m rows, 0 where the ring does not serve them (every source's N is a multiple of 128,
        which the ring's 8-warp blocks need). The mma.sync ring runs at the group's load-time splits, the wgmma ring at
        launch_rows'."""
        return ring_mode(m) if uses_ring(m, 8) else 0

    def xs_slice(self, m: int) -> int:
        """The x slice to stage in shared memory for m rows (0: global loads): where use_xs says so and the
        slice fits (the group's splits are fixed at load, unlike a single linear's)."""
        return self.max_slice if use_xs(m, self.codebook) and xs_fits(m, self.max_slice) else 0

    def rotating_serves(self, m: int, ring: int | None = None) -> bool:
        """Whether m rows on `ring` (default ring_mode(m)) run in the rotating form (group_run_rotating): a wgmma
        mode, at most 64 rows, and wgmma rows all at one split."""
        ring = self.ring_mode(m) if ring is None else ring
        return ring in WGMMA_RING_MODES and m <= CROSSOVERS.fused_max_m and rotating_serves(bool(self.wg_one_split))


def make_group(tiles: list[torch.Tensor], suh: list[torch.Tensor], svh: list[torch.Tensor], codebook: Codebook,
               splits: list[int] | None = None) -> Exl3Group:
    """Sources must share K, bits and codebook; each source's N a multiple of 128 (its output Hadamard blocks)."""
    if not tiles or not (len(tiles) == len(suh) == len(svh)):
        raise ValueError("a group needs matching, non-empty lists of tiles, suh and svh")
    check_tiles(tiles[0])
    kt, k2 = tiles[0].shape[1], k2_of(tiles[0])
    sources = []
    for i, t in enumerate(tiles):
        nt = t.shape[0]
        if t.shape[1] != kt or k2_of(t) != k2:
            raise ValueError(f"group source {i}: K/16 = {t.shape[1]}, words = {t.shape[2]}; the group has K/16 = {kt}, "
                             f"words = {tiles[0].shape[2]} (sources of one group share K, bits and codebook)")
        check_source(f"group source {i}", t, suh[i], svh[i])
        sp = splits[i] if splits else default_splits(kt, nt, t.device)
        sources.append((t.data_ptr(), suh[i].data_ptr(), svh[i].data_ptr(), nt, sp))
    rows, item, col, base = group_table(sources)
    wg = None if splits else wg_splits([src[3] for src in sources], [src[4] for src in sources], tiles[0].device)
    wg_rows, wg_item, wg_base = [], 0, 0
    if wg:
        wg_rows, wg_item, _, wg_base = group_table([(*src[:4], sp) for src, sp in zip(sources, wg, strict=True)])
    table = torch.tensor(rows + wg_rows, dtype=torch.int64).to(tiles[0].device)
    return Exl3Group(table=table, num=len(tiles), k_tiles=kt, total_items=item, total_cols=col, partial_per_row=base,
                     k2=k2, codebook=int(codebook), sources=(tuple(tiles), tuple(suh), tuple(svh)),
                     max_slice=max(-(-kt // src[4]) for src in sources), wg_items=wg_item,
                     wg_partial_per_row=wg_base, wg_one_split=int(one_split(wg)))


def group_table(sources: list[tuple[int, int, int, int, int]]) -> tuple[list[list[int]], int, int, int]:
    """GroupSource rows for same-input sources (tiles, suh, svh pointers, n_tiles, splits), numbered in order: the
    rows, the total work items, output columns and partial elements per row."""
    rows, item, col, base = [], 0, 0, 0
    for tiles, suh, svh, nt, sp in sources:
        rows.append([tiles, suh, svh, pack_tiles_splits(nt, sp), 0, item, col, base])
        item, col, base = item + nt * sp, col + nt * 16, base + sp * nt * 16
    return rows, item, col, base


def pack_tiles_splits(n_tiles: int, splits: int) -> int:
    """GroupSource's two int32 fields n_tiles, splits as one little-endian int64."""
    return n_tiles | (splits << 32)


def group_linear(x: torch.Tensor, group: Exl3Group, ring: int | None = None) -> torch.Tensor:
    """[m, sum N] = the concatenated outputs of every source of the group for fp16 or bf16 x [m, K] (y of x's
    dtype). `ring`: a dispatch.RingMode (x through a shared-memory ring, any m), 0 for the x-slice / global-load
    kernels (m <= 64), or None for the group's policy (Exl3Group.ring_mode; the rotating form where it serves)."""
    m = x.shape[0]
    ring = group.ring_mode(m) if ring is None else ring
    if m > CROSSOVERS.fused_max_m and not ring:
        raise ValueError(f"the fused EXL3 kernel takes at most {CROSSOVERS.fused_max_m} rows without the x ring, "
                         f"got {m}")
    if group.rotating_serves(m, ring):
        return group_run_rotating(x, group)
    table, items, partial_per_row = group.launch_rows(ring)
    return group_run(x, table, group.num, m, group.k_tiles, items, group.total_cols, partial_per_row, group.k2,
                     group.codebook, 0 if ring else group.xs_slice(m), ring)


def group_run_rotating(x: torch.Tensor, group: Exl3Group) -> torch.Tensor:
    """[m, total_cols] of x's dtype: the group on the wgmma ring from its wgmma rows in two launches, each block's
    output rotated inside the GEMM's launch (no fp32 partials in global memory); bit-identical to group_run over those
    rows on the wgmma ring. m <= 64, and the group's wgmma rows all at one split (Exl3Group.wg_one_split)."""
    m = x.shape[0]
    if not group.wg_one_split or m > CROSSOVERS.fused_max_m:
        raise ValueError(f"group_run_rotating: needs a group whose wgmma rows are all at one split and at most "
                         f"{CROSSOVERS.fused_max_m} rows, got wg_one_split={group.wg_one_split} and {m} rows")
    check_act("x", x, (m, group.k_tiles * 16))
    table, items, _ = group.launch_rows(RingMode.WGMMA_1)
    xh = torch.empty(group.num, m, group.k_tiles * 16, dtype=torch.float16, device=x.device)
    out = torch.empty(m, group.total_cols, dtype=x.dtype, device=x.device)
    bf16 = int(x.dtype == torch.bfloat16)
    check(load_library().exl3_group_linear_rotating(x.data_ptr(), bf16, table.data_ptr(), group.num, xh.data_ptr(),
                                                    out.data_ptr(), bf16, m, group.k_tiles, items, group.total_cols,
                                                    group.k2, group.codebook, stream(x)), "group linear (rotating)")
    return out


def group_run(x: torch.Tensor, table: torch.Tensor, num: int, m: int, k_tiles: int, total_items: int,
              total_cols: int, partial_elems: int, k2: int, codebook: int, xs_slice: int = 0,
              ring: int = 0) -> torch.Tensor:
    """[m, total_cols] of x's dtype: the three launches of a group over a table of `num` sources (x fp16 or bf16
    rows as the table's x_row fields address them; bf16 in and out give what casting around an fp16 call gives).
    Sources with n_tiles = 0 are skipped; the items and columns counted for them may be an upper bound. xs_slice > 0:
    x staged in shared memory for K slices up to that many tiles; `ring` (a dispatch.RingMode): x through a
    shared-memory ring instead (any m)."""
    check_act("x", x, (x.shape[0], k_tiles * 16))
    xh = torch.empty(num, m, k_tiles * 16, dtype=torch.float16, device=x.device)
    partial = torch.empty(partial_elems * m, dtype=torch.float32, device=x.device)
    out = torch.empty(m, total_cols, dtype=x.dtype, device=x.device)
    bf16 = int(x.dtype == torch.bfloat16)
    check(load_library().exl3_group_linear(x.data_ptr(), bf16, table.data_ptr(), num, xh.data_ptr(),
                                           partial.data_ptr(), out.data_ptr(), bf16, m, k_tiles, total_items,
                                           total_cols, k2, codebook, xs_slice, int(ring), stream(x)), "group linear")
    return out


@dataclass(frozen=True)
class Exl3OneLaunch:
    """A dense linear or same-input group run as one launch for decode-sized m (`exl3_linear_decode`): its group
    table at splits that cut K into whole 128-blocks (each block rotates its own slice of x), its arrival counters
    (one per 128 output columns; zero between calls) and the most rows it is used for. Built once per layer at load."""

    group: Exl3Group
    counters: torch.Tensor
    max_m: int = CROSSOVERS.one_launch_max_rows

    def serves(self, m: int) -> bool:
        """Whether m rows run in this form (up to max_m, at most the kernel's one_launch_max_rows), the x slice
        within the shared memory the kernel takes."""
        return m <= min(self.max_m, CROSSOVERS.one_launch_max_rows) and xs_fits(m, self.group.max_slice)


def make_one_launch(tiles: list[torch.Tensor], suh: list[torch.Tensor], svh: list[torch.Tensor],
                    codebook: Codebook, max_m: int = CROSSOVERS.one_launch_max_rows) -> Exl3OneLaunch | None:
    """The one-launch form of these same-input sources (one source: a single linear) at one_launch_splits, used for up
    to max_m rows, or None where it cannot run them (K or an N not whole 128-blocks)."""
    splits = one_launch_splits(tiles[0].shape[1], [t.shape[0] for t in tiles], tiles[0].device)
    if splits is None:
        return None
    group = make_group(tiles, suh, svh, codebook, splits=[splits] * len(tiles))
    return Exl3OneLaunch(group, torch.zeros(group.total_cols // 128, dtype=torch.int32, device=tiles[0].device), max_m)


def one_launch_linear(x: torch.Tensor, group: Exl3Group, counters: torch.Tensor,
                      pdl: bool | None = None) -> torch.Tensor:
    """[m, total_cols] of x's dtype for fp16 or bf16 x [m, K]: group_linear's result in one launch (bit-identical at
    the same splits). The group's splits must cut K into whole 128-blocks (make_one_launch's table). pdl: launched as
    a programmatic dependent of the kernel before it (its first weight loads overlap that kernel's end; default
    SGLANG_EXL3_DEV_PDL)."""
    m = x.shape[0]
    check_act("x", x, (m, group.k_tiles * 16))
    if m > CROSSOVERS.one_launch_max_rows:
        raise ValueError(f"the one-launch EXL3 linear takes at most {CROSSOVERS.one_launch_max_rows} rows, got {m}")
    if counters.dtype != torch.int32 or counters.numel() < group.total_cols // 128 or counters.device != x.device:
        raise ValueError(f"one_launch_linear: counters must be int32 with at least {group.total_cols // 128} elements "
                         f"on {x.device}, got {counters.dtype} {counters.numel()} on {counters.device}")
    partial = torch.empty(group.partial_per_row * m, dtype=torch.float32, device=x.device)
    out = torch.empty(m, group.total_cols, dtype=x.dtype, device=x.device)
    check(load_library().exl3_linear_decode(x.data_ptr(), int(x.dtype == torch.bfloat16), group.table.data_ptr(),
                                            group.num, partial.data_ptr(), counters.data_ptr(), counters.numel(),
                                            out.data_ptr(), m, group.k_tiles, group.total_items, group.total_cols,
                                            group.k2, group.codebook, group.max_slice, int(launch_pdl(pdl)),
                                            stream(x)), "one-launch linear")
    return out
