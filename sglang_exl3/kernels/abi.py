"""The kernel library's C ABI, declared once: every exported function's name, argument names and types, and return
type, from which the ctypes signatures are set and the library's identity is checked.

`csrc/exl3_abi.h` holds the same prototypes for the C side (tests/test_kernel_abi.py checks that the two agree,
argument by argument). The build passes `digest()` into the library (`exl3_abi_digest()`), and a library whose
digest is not this table's is refused at load, naming the fix: a stale prebuilt library can never be called with
shifted arguments. Struct layouts the library reads from memory written here (a group table's rows) are part of
the table too (`LAYOUTS`), so a layout change changes the digest.
"""

from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass
from functools import cache

# argument and return kinds -> ctypes types
KINDS: dict[str, object] = {
    "ptr": ctypes.c_void_p,  # any pointer (device memory, or host memory where the header says so)
    "int": ctypes.c_int,
    "i64": ctypes.c_longlong,
    "int_ptr": ctypes.POINTER(ctypes.c_int),  # a host int the call writes
    "str": ctypes.c_char_p,  # returns only
}


@dataclass(frozen=True)
class Fn:
    name: str
    returns: str  # a KINDS key
    args: tuple[tuple[str, str], ...]  # (name, kind)


def _fn(name: str, returns: str, spec: str) -> Fn:
    """Fn from 'kind name, kind name, ...' (the order of the C prototype)."""
    args = tuple(tuple(reversed(part.split())) for part in spec.split(",") if part.strip())
    return Fn(name, returns, args)  # type: ignore[arg-type]


_STREAM = "ptr stream"
FUNCTIONS: tuple[Fn, ...] = (
    # the library
    _fn("exl3_abi_digest", "str", ""),
    _fn("exl3_error_string", "str", "int code"),
    _fn("exl3_pdl_usable", "int", ""),
    _fn("exl3_set_plain_pdl", "int", "int on"),
    _fn("exl3_wgmma_available", "int", ""),
    _fn("exl3_group_probe", "int", "ptr table, int num, i64 item, i64 col, ptr out"),
    # reconstruct and the rotations
    _fn("exl3_reconstruct", "int", "ptr trellis, ptr out, int k_tiles, int n_tiles, int tn0, int tn_count, int ld, "
        f"int k2, int codebook, {_STREAM}"),
    _fn("exl3_had_in", "int", f"ptr x, int x_bf16, ptr suh, ptr out, int rows, int cols, {_STREAM}"),
    _fn("exl3_had_out", "int", "ptr acc, int acc_is_fp32, ptr svh, ptr out, int out_bf16, int splits, int rows, "
        f"int cols, {_STREAM}"),
    _fn("exl3_set_had_form", "int", "int form"),
    _fn("exl3_set_octet_min_items", "i64", "i64 items"),
    # dense linears
    _fn("exl3_gemm_partial", "int", "ptr xh, ptr trellis, ptr partial, int m, int k_tiles, int n_tiles, int splits, "
        f"int k2, int codebook, {_STREAM}"),
    _fn("exl3_gemm_partial_xs", "int", "ptr xh, ptr trellis, ptr partial, int m, int k_tiles, int n_tiles, "
        f"int splits, int k2, int codebook, {_STREAM}"),
    _fn("exl3_gemm_partial_ring", "int", "ptr xh, ptr trellis, ptr partial, int m, int k_tiles, int n_tiles, "
        f"int splits, int k2, int codebook, int mode, {_STREAM}"),
    _fn("exl3_group_linear", "int", "ptr x, int x_bf16, ptr table, int num, ptr xh_all, ptr partial, ptr out, "
        "int y_bf16, int m, int k_tiles, int total_items, int total_cols, int k2, int codebook, int xs_slice, "
        f"int ring_mode, {_STREAM}"),
    _fn("exl3_group_linear_rotating", "int", "ptr x, int x_bf16, ptr table, int num, ptr xh_all, ptr out, "
        f"int y_bf16, int m, int k_tiles, int total_items, int total_cols, int k2, int codebook, {_STREAM}"),
    _fn("exl3_linear_decode", "int", "ptr x, int bf16, ptr table, int num, ptr partial, ptr counters, "
        "i64 counters_len, ptr out, int m, int k_tiles, int total_items, int total_cols, int k2, int codebook, "
        f"int xs_slice, int pdl, {_STREAM}"),
    # MoE
    _fn("exl3_routed_tables", "int", f"ptr params, int banks, ptr ids, int ids_bytes, int pairs, ptr table, "
        f"int on_host, {_STREAM}"),
    _fn("exl3_sorted_tables", "int", "ptr params, int banks, ptr src_expert, ptr filled, int sources, int tile, "
        f"ptr table, int on_host, {_STREAM}"),
    _fn("exl3_sorted_plan", "int", "ptr ids, int ids_bytes, int pairs, int experts, int tile, int sources, "
        f"ptr rows, ptr src_expert, ptr filled, int on_host, {_STREAM}"),
    _fn("exl3_sorted_gather", "int", f"ptr x, ptr rows, int pairs, int topk, int hidden, ptr xs, {_STREAM}"),
    _fn("exl3_act_mul", "int", f"ptr gate_up, ptr out, int sources, int rows, int n, int gelu, int on_host, "
        f"{_STREAM}"),
    _fn("exl3_moe_combine", "int", "ptr y, ptr rows, ptr w, ptr ids, int ids_bytes, ptr out, int tokens, int topk, "
        f"int n, int on_host, {_STREAM}"),
    _fn("exl3_moe_fused", "int", "ptr x, int x_bf16, ptr gu_table, ptr dn_table, int sources, int rows, "
        "int hidden, int inter, int gu_items, int dn_items, int gu_k2, int gu_codebook, int dn_k2, "
        "int dn_codebook, ptr xh_gu, ptr partial_gu, ptr xh_dn, ptr partial_dn, ptr pair_rows, ptr w, ptr ids, "
        f"int ids_bytes, int tokens, int topk, int gelu, int gu_xs_slice, int dn_xs_slice, ptr out, {_STREAM}"),
    _fn("exl3_moe_decode", "int", "ptr x, int x_bf16, ptr gate_rows, ptr up_rows, ptr down_rows, ptr ids, "
        "int ids_bytes, ptr w, int tokens, int topk, int hidden, int inter, int gu_k2, int gu_codebook, "
        "int dn_k2, int dn_codebook, int gu_splits, int dn_splits, ptr partial_gu, ptr xh_dn, ptr partial_dn, "
        f"ptr counters, i64 counters_len, int gelu, ptr out, int out_kind, int pdl, {_STREAM}"),
    _fn("exl3_slab_rot_in", "int", "ptr x, int x_bf16, ptr ids, int ids_bytes, int pairs, int topk, ptr gate_suh, "
        f"ptr up_suh, ptr a, int k, {_STREAM}"),
    _fn("exl3_slab_mid", "int", "ptr c, ptr ids, int ids_bytes, int pairs, ptr gate_svh, ptr up_svh, "
        f"ptr down_suh, ptr h, int n, int gelu, {_STREAM}"),
    _fn("exl3_slab_tail", "int", "ptr y, ptr ids, int ids_bytes, ptr w, ptr down_svh, ptr out, int tokens, "
        f"int topk, int hidden, {_STREAM}"),
    # encoding
    _fn("exl3_quantize_tiles", "int", "ptr x, ptr table, ptr states, ptr cost_scratch, ptr back_scratch, "
        f"int tiles, int k, {_STREAM}"),
    _fn("exl3_quantize_tiles_fast", "int", "ptr x, ptr states, ptr snaps, int tiles, int k, int cb, int blocks, "
        f"int_ptr blocks_out, {_STREAM}"),
    _fn("exl3_quantize_tiles_fast_scratch", "i64", "int k"),
)

# What the library reads from memory that the Python side writes, field by field (csrc/common/group_source.cuh, the
# MoE tables' params in moe_tables.py): part of the ABI's identity.
LAYOUTS: tuple[str, ...] = (
    "GroupSource: 8 x int64: tiles, suh, svh, n_tiles | splits << 32, x_row, item_begin, col_begin, partial_base",
    "routed params: 8 x int64 per bank: rows, item0, col0, base0, items, cols, part, x_row_div",
    "sorted params: 6 x int64 per bank: rows, n_tiles, items_before, cols_before, parts_before, splits",
    "ring modes: 81 82 91 92",
)

BY_NAME: dict[str, Fn] = {f.name: f for f in FUNCTIONS}


@cache
def digest() -> str:
    """A short hash of the table and the layouts: the identity a library is built against."""
    text = "\n".join([*(f"{f.returns} {f.name}({', '.join(f'{k} {n}' for n, k in f.args)})" for f in FUNCTIONS),
                      *LAYOUTS])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def bind(lib: ctypes.CDLL) -> None:
    """Set every function's ctypes argument and return types from the table."""
    for f in FUNCTIONS:
        fn = getattr(lib, f.name)
        fn.argtypes = [KINDS[kind] for _, kind in f.args]
        fn.restype = KINDS[f.returns]


def library_digest(lib: ctypes.CDLL) -> str | None:
    """The digest a library was built with, or None for a library without one (built before the table existed)."""
    try:
        fn = lib.exl3_abi_digest
    except AttributeError:
        return None
    fn.argtypes, fn.restype = [], ctypes.c_char_p
    return fn().decode()
