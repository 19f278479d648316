"""The MoE forwards and their glue on our kernels: act * up, the weighted combine, the rotated slab's rotations, the
five-launch fused forward over prepared tables and the two-launch decode forward. kernels/moe_routed.py and
kernels/moe_sorted.py build the tables these run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_exl3.kernels.checks import check_act, check_fp16, ids_bytes
from sglang_exl3.kernels.dispatch import decode_splits, launch_pdl, use_xs, xs_fits
from sglang_exl3.kernels.groups import group_run
from sglang_exl3.kernels.library import check, load_library, stream
from sglang_exl3.kernels.moe_tables import Exl3ExpertBank, routed_table, routed_table_builder


def act_mul(gate_up: torch.Tensor, sources: int, n: int, gelu: bool = False) -> torch.Tensor:
    """fp16 [sources * rows, n] = act(gate) * up for the fp16 [rows, 2 * sources * n] output of a two-bank group
    (gate sources' columns first), rows regrouped source by source, as a down projection over the same sources
    reads them; silu, or gelu's tanh approximation; fp32 math; one launch (CPU tensors: the same code on the
    host)."""
    rows = gate_up.shape[0]
    if gate_up.dtype != torch.float16 or gate_up.dim() != 2 or gate_up.shape[1] != 2 * sources * n:
        raise ValueError(f"act_mul takes the fp16 [rows, 2 * {sources} * {n}] output of a gate/up group, got "
                         f"{gate_up.dtype} {tuple(gate_up.shape)}")
    gate_up = gate_up.contiguous()
    out = torch.empty(sources * rows, n, dtype=torch.float16, device=gate_up.device)
    on_host = not gate_up.is_cuda
    check(load_library().exl3_act_mul(gate_up.data_ptr(), out.data_ptr(), sources, rows, n, int(gelu), int(on_host),
                                       None if on_host else stream(gate_up)), "act mul")
    return out


def moe_combine(y: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, topk: int, n: int,
                rows: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [tokens, n]: each token's top-k expert outputs summed with fp32 routing weights [tokens * top-k], in
    top-k order; pairs whose id is below 0 are skipped. Pair p's output row starts at element rows[p] of fp16 y
    (int64; None: p * n). One launch."""
    pairs = ids.numel()
    if y.dtype != torch.float16 or weights.dtype != torch.float32 or weights.numel() != pairs or pairs % topk or \
            (rows is None and y.numel() < pairs * n) or (rows is not None and (rows.dtype != torch.int64 or
                                                                               rows.numel() != pairs)):
        raise ValueError(f"moe_combine: fp16 y, fp32 weights and ids (and int64 row offsets) of tokens * {topk} "
                         f"pairs; got y {y.dtype} {tuple(y.shape)}, weights {weights.dtype} {weights.numel()}, "
                         f"{pairs} ids")
    y, weights = y.contiguous(), weights.contiguous()
    out = torch.empty(pairs // topk, n, dtype=torch.float32, device=y.device)
    on_host = not y.is_cuda
    check(load_library().exl3_moe_combine(y.data_ptr(), None if rows is None else rows.contiguous().data_ptr(),
                                           weights.data_ptr(), ids.data_ptr(), ids_bytes(ids), out.data_ptr(),
                                           pairs // topk, topk, n, int(on_host), None if on_host else stream(y)),
           "moe combine")
    return out


def _check_slab_ids(ids: torch.Tensor) -> None:
    if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1 or not ids.is_contiguous() or not ids.is_cuda:
        raise ValueError(f"the rotated slab's ids must be contiguous CUDA int32 / int64 [pairs], got {ids.dtype} "
                         f"{list(ids.shape)} on {ids.device}")


def _check_table(name: str, t: torch.Tensor, width: int) -> None:
    """A per-expert rotation table: fp16 [experts, width]."""
    check_fp16(name, t, (t.shape[0] if t.dim() == 2 else -1, width))


def slab_rotate_in(x: torch.Tensor, ids: torch.Tensor, topk: int, gate_suh: torch.Tensor,
                   up_suh: torch.Tensor) -> torch.Tensor:
    """fp16 [2 * pairs, K]: row p = had_in(x[p // topk], gate_suh[ids[p]]), row pairs + p the same with up_suh, for
    fp16 or bf16 x [pairs / topk, K] (ids in slab order; below 0: a zero row). One launch."""
    pairs, k = ids.numel(), x.shape[-1]
    check_act("x", x, (pairs // max(topk, 1), k))
    _check_slab_ids(ids)
    _check_table("gate_suh", gate_suh, k)
    _check_table("up_suh", up_suh, k)
    a = torch.empty(2 * pairs, k, dtype=torch.float16, device=x.device)
    check(load_library().exl3_slab_rot_in(x.data_ptr(), int(x.dtype == torch.bfloat16), ids.data_ptr(),
                                           ids_bytes(ids), pairs, topk, gate_suh.data_ptr(), up_suh.data_ptr(),
                                           a.data_ptr(), k, stream(x)), "slab rotate in")
    return a


def slab_mid(c: torch.Tensor, ids: torch.Tensor, gate_svh: torch.Tensor, up_svh: torch.Tensor,
             down_suh: torch.Tensor, gelu: bool) -> torch.Tensor:
    """fp16 [pairs, N]: pair p's down-projection input had_in(act(had_out(c[p], gate_svh[e])) * had_out(c[pairs + p],
    up_svh[e]), down_suh[e]), e = ids[p], from the gate/up GEMM's fp16 c [2 * pairs, N]. One launch."""
    pairs = ids.numel()
    n = c.shape[-1]
    check_fp16("c", c, (2 * pairs, n))
    _check_slab_ids(ids)
    for name, t in (("gate_svh", gate_svh), ("up_svh", up_svh), ("down_suh", down_suh)):
        _check_table(name, t, n)
    h = torch.empty(pairs, n, dtype=torch.float16, device=c.device)
    check(load_library().exl3_slab_mid(c.data_ptr(), ids.data_ptr(), ids_bytes(ids), pairs, gate_svh.data_ptr(),
                                        up_svh.data_ptr(), down_suh.data_ptr(), h.data_ptr(), n, int(gelu),
                                        stream(c)), "slab mid")
    return h


def slab_tail(y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, down_svh: torch.Tensor,
              topk: int) -> torch.Tensor:
    """fp32 [pairs / topk, H]: each token's pairs' had_out(y[p], down_svh[ids[p]]) summed with the fp32 routing
    weights in top-k order (ids below 0 skipped), from the down GEMM's fp16 y [pairs, H]. One launch."""
    pairs, hidden = ids.numel(), y.shape[-1]
    check_fp16("y", y, (pairs, hidden))
    _check_slab_ids(ids)
    _check_table("down_svh", down_svh, hidden)
    if weights.dtype != torch.float32 or weights.numel() != pairs or not weights.is_contiguous() or topk <= 0 or \
            pairs % topk:
        raise ValueError(f"slab_tail: contiguous fp32 weights of {pairs} pairs in tokens of top-{topk}, got "
                         f"{weights.dtype} {weights.numel()}")
    out = torch.empty(pairs // topk, hidden, dtype=torch.float32, device=y.device)
    check(load_library().exl3_slab_tail(y.data_ptr(), ids.data_ptr(), ids_bytes(ids), weights.data_ptr(),
                                         down_svh.data_ptr(), out.data_ptr(), pairs // topk, topk, hidden,
                                         stream(y)), "slab tail")
    return out


MAX_FUSED_TOPK = 32  # moe_tail's shared rows: more experts per token run the MoE stages one by one


@dataclass(frozen=True)
class MoeTables:
    """The two group tables of one MoE forward: `gate_up` holds S gate sources then S up sources, `down` S sources,
    each source `rows` rows (per pair: 1; sorted: a tile); items and partials are the tables' static totals."""
    gate_up: torch.Tensor
    down: torch.Tensor
    sources: int
    rows: int
    gate_up_items: int
    gate_up_partial: int
    down_items: int
    down_partial: int
    gate_up_slice: int = 0  # K tiles of one source's split (sizes x in shared memory; 0: global loads)
    down_slice: int = 0

    def xs_slices(self, gate: Exl3ExpertBank, down: Exl3ExpertBank) -> tuple[int, int]:
        """The slices the fused forward's two GEMMs stage in shared memory (0: global loads), by the same policy as
        a group's: use_xs for `rows` rows of the bank's codebook, the slice within the kernels' shared memory."""
        def one(slice_tiles: int, bank: Exl3ExpertBank) -> int:
            fits = slice_tiles > 0 and xs_fits(self.rows, slice_tiles)
            return slice_tiles if fits and use_xs(self.rows, bank.codebook) else 0
        return one(self.gate_up_slice, gate), one(self.down_slice, down)


def moe_fused(x: torch.Tensor, tables: MoeTables, gate: Exl3ExpertBank, down: Exl3ExpertBank,
              weights: torch.Tensor, ids: torch.Tensor, topk: int, gelu: bool,
              pair_rows: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [tokens, H]: a whole MoE forward over prepared tables in five launches (input rotation, gate/up GEMM,
    output rotations + act * up + the down projection's input rotation, down GEMM, output rotation + weighted top-k
    combine), every fp16 rounding of the unfused stages kept. x fp16 or bf16 (rounded to fp16 as a cast would);
    pair p's down row is pair_rows[p] (int64; None: p)."""
    pairs = ids.numel()
    if x.dtype not in (torch.float16, torch.bfloat16) or x.dim() != 2 or x.shape[1] != gate.k_tiles * 16 or \
            weights.dtype != torch.float32 or weights.numel() != pairs or pairs % topk or topk > MAX_FUSED_TOPK or \
            (pair_rows is not None and (pair_rows.dtype != torch.int64 or pair_rows.numel() != pairs)):
        raise ValueError(f"moe_fused: fp16/bf16 x [*, {gate.k_tiles * 16}], fp32 weights and ids (and int64 pair "
                         f"rows) of tokens * top-k (<= {MAX_FUSED_TOPK}) pairs; top-k {topk}, got x {x.dtype} "
                         f"{tuple(x.shape)}, weights {weights.dtype} {weights.numel()}, {pairs} ids")
    x, weights = x.contiguous(), weights.contiguous()
    t, dev = tables, x.device
    hidden, inter = gate.k_tiles * 16, gate.n_tiles * 16
    xh_gu = torch.empty(2 * t.sources, t.rows, hidden, dtype=torch.float16, device=dev)
    partial_gu = torch.empty(t.gate_up_partial * t.rows, dtype=torch.float32, device=dev)
    xh_dn = torch.empty(t.sources, t.rows, inter, dtype=torch.float16, device=dev)
    partial_dn = torch.empty(t.down_partial * t.rows, dtype=torch.float32, device=dev)
    out = torch.empty(pairs // topk, down.n_tiles * 16, dtype=torch.float32, device=dev)
    gu_xs, dn_xs = t.xs_slices(gate, down)
    check(load_library().exl3_moe_fused(
        x.data_ptr(), int(x.dtype == torch.bfloat16), t.gate_up.data_ptr(), t.down.data_ptr(), t.sources, t.rows,
        hidden, inter, t.gate_up_items, t.down_items, gate.k2, gate.codebook, down.k2, down.codebook,
        xh_gu.data_ptr(), partial_gu.data_ptr(), xh_dn.data_ptr(), partial_dn.data_ptr(),
        None if pair_rows is None else pair_rows.contiguous().data_ptr(), weights.data_ptr(), ids.data_ptr(),
        ids_bytes(ids), pairs // topk, topk, int(gelu), gu_xs, dn_xs, out.data_ptr(), stream(x)), "fused moe")
    return out


DECODE_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the kernel's out_kind 0, 1, 2


def decode_counters(max_pairs: int, max_tokens: int, hidden: int, inter: int, device) -> torch.Tensor:
    """The decode MoE's arrival counters for up to max_pairs pairs of max_tokens tokens: zero, and left zero by
    every call (each is reset by the block that completes it), so one buffer serves every call of its owner."""
    return torch.zeros(max_pairs * (inter // 128) + max_tokens * (hidden // 128), dtype=torch.int32, device=device)


def moe_decode(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: Exl3ExpertBank, up: Exl3ExpertBank,
               down: Exl3ExpertBank, topk: int, gelu: bool, counters: torch.Tensor, gu_splits: int | None = None,
               dn_splits: int | None = None, out_dtype: torch.dtype = torch.float32,
               pdl: bool | None = None) -> torch.Tensor:
    """[tokens, H] in out_dtype: the MoE forward for one source per (token, expert) pair in two launches (gate/up
    GEMM + the mid rotations; down GEMM + the tail), the expert of each pair read from `ids` on the device. x fp16
    or bf16 [tokens, H]; ids int32/int64 and fp32 weights [tokens * top-k] (ids below 0: not this rank's, weight
    0). Bit-identical to `moe_fused` at the same splits (fp32 out; fp16/bf16 out is that result rounded)."""
    pairs = ids.numel()
    hidden, inter = gate.k_tiles * 16, gate.n_tiles * 16
    if x.dtype not in (torch.float16, torch.bfloat16) or x.dim() != 2 or x.shape[1] != hidden or \
            weights.dtype != torch.float32 or weights.numel() != pairs or pairs % topk or topk > MAX_FUSED_TOPK or \
            x.shape[0] != pairs // topk or out_dtype not in DECODE_OUT_DTYPES:
        raise ValueError(f"moe_decode: fp16/bf16 x [tokens, {hidden}], fp32 weights and ids of tokens * top-k "
                         f"(<= {MAX_FUSED_TOPK}) pairs, out fp32/fp16/bf16; got x {x.dtype} {tuple(x.shape)}, "
                         f"weights {weights.dtype} {weights.numel()}, {pairs} ids, top-k {topk}, out {out_dtype}")
    if (up.k_tiles, up.n_tiles, up.k2, up.codebook) != (gate.k_tiles, gate.n_tiles, gate.k2, gate.codebook) or \
            (down.k_tiles, down.n_tiles) != (gate.n_tiles, gate.k_tiles):
        raise ValueError("moe_decode: gate and up share shape, bits and codebook; down maps the intermediate back")
    tokens, dev = pairs // topk, x.device
    need = pairs * (inter // 128) + tokens * (hidden // 128)
    if counters.dtype != torch.int32 or counters.numel() < need or counters.device != dev:
        raise ValueError(f"moe_decode: counters must be int32 with at least {need} elements on {dev} "
                         f"(decode_counters), got {counters.dtype} {counters.numel()} on {counters.device}")
    gu = gu_splits or decode_splits(gate.k_tiles, gate.n_tiles, 2 * pairs, dev, least=2)
    dn = dn_splits or decode_splits(down.k_tiles, down.n_tiles, pairs, dev)
    if (hidden // 128) % gu or (inter // 128) % dn:
        raise ValueError(f"moe_decode: splits must cut K into whole 128-blocks: gu_splits {gu} must divide "
                         f"{hidden // 128} and dn_splits {dn} must divide {inter // 128} (or pass None: "
                         "decode_splits)")
    x, weights = x.contiguous(), weights.contiguous()
    partial_gu = torch.empty(pairs * 2 * gu * inter, dtype=torch.float32, device=dev)
    xh_dn = torch.empty(pairs * inter, dtype=torch.float16, device=dev)
    partial_dn = torch.empty(pairs * dn * hidden, dtype=torch.float32, device=dev)
    out = torch.empty(tokens, hidden, dtype=out_dtype, device=dev)
    if pairs == 0:
        return out.zero_()
    check(load_library().exl3_moe_decode(
        x.data_ptr(), int(x.dtype == torch.bfloat16), gate.rows.data_ptr(), up.rows.data_ptr(), down.rows.data_ptr(),
        ids.data_ptr(), ids_bytes(ids), weights.data_ptr(), tokens, topk, hidden, inter, gate.k2, gate.codebook,
        down.k2, down.codebook, gu, dn, partial_gu.data_ptr(), xh_dn.data_ptr(), partial_dn.data_ptr(),
        counters.data_ptr(), counters.numel(), int(gelu), out.data_ptr(), DECODE_OUT_DTYPES.index(out_dtype),
        int(launch_pdl(pdl)),
        stream(x)), "moe decode")
    return out


def routed_group(x: torch.Tensor, banks: list[Exl3ExpertBank], ids: torch.Tensor, x_row_div: int = 1) -> torch.Tensor:
    """For every pair p: bank_b's expert ids[p] applied to x[p // x_row_div], for each bank b: one table launch for
    all banks, then three launches. x fp16 [R, K]; ids int32/int64 [P] on the device (local experts; below 0: read
    expert 0, for the caller to weigh 0). Returns fp16 [1, sum_b P * N_b]: bank by bank, pair by pair."""
    first = banks[0]
    for b in banks:
        if (b.k_tiles, b.k2, b.codebook) != (first.k_tiles, first.k2, first.codebook):
            raise ValueError("the banks of one routed launch share K, bits and codebook")
    check_fp16("x", x, (x.shape[0], first.k_tiles * 16))
    pairs = ids.shape[0]
    if pairs == 0:
        return torch.empty(1, 0, dtype=torch.float16, device=x.device)
    table, item, col, base, _ = routed_table(banks, ids.contiguous(), x_row_div, routed_table_builder())
    return group_run(x, table, len(banks) * pairs, 1, first.k_tiles, item, col, base, first.k2, first.codebook)


def routed_linear(x: torch.Tensor, banks: list[Exl3ExpertBank], ids: torch.Tensor,
                  x_row_div: int = 1) -> list[torch.Tensor]:
    """routed_group's output as fp16 [P, N_b] per bank."""
    out, pairs, outs, at = routed_group(x, banks, ids, x_row_div), ids.shape[0], [], 0
    for b in banks:
        n = b.n_tiles * 16
        outs.append(out[0, at:at + pairs * n].view(pairs, n))
        at += pairs * n
    return outs
