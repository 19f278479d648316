"""The dense dispatch policy: which kernel form and split count serves m rows of a linear or a group. Every row-count
crossover and budget is one field of `CROSSOVERS` (kernels/crossovers.py), each with the measurement behind it; the
functions below only combine them with the shape and the GPU. Pure Python over shapes (the GPU is asked only for its
SM count and, once per device, whether the wgmma kernels are there), so the CPU tests check every decision."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

import torch

from sglang_exl3 import knobs
from sglang_exl3.format.constants import Codebook
from sglang_exl3.kernels.crossovers import CROSSOVERS
from sglang_exl3.kernels.library import load_library


class RingMode(enum.IntEnum):
    """The x-ring GEMM's forms (csrc/exl3_abi.h Exl3RingMode): mma.sync or Hopper's wgmma, one or two trellis groups
    per x chunk. 0 (no ring) is the x-slice / global-load GEMM."""

    MMA_1 = 81
    MMA_2 = 82
    WGMMA_1 = 91
    WGMMA_2 = 92

    @property
    def wgmma(self) -> bool:
        return self in (RingMode.WGMMA_1, RingMode.WGMMA_2)


MMA_RING_MODES = (RingMode.MMA_1, RingMode.MMA_2)
WGMMA_RING_MODES = (RingMode.WGMMA_1, RingMode.WGMMA_2)


@cache
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_splits(k_tiles: int, n_tiles: int, device: torch.device, warps_per_sm: int = 32,
                   min_tiles_per_warp: int = 16) -> int:
    """Split K so that the (16-column strip, K split) work items -- one warp each -- about fill the resident
    warps of every SM, keeping at least `min_tiles_per_warp` tiles per warp (benchmarks/kernels.py --tune on
    the H200: fewer, longer warps lose occupancy; more, shorter ones pay their set-up and the reduction). Where
    one wave would take fewer than 4 splits, rounding is coarse (5120 x 27648: 2.4 -> 2, a 0.8 wave); aim for two
    waves there (5 splits: 4-6% faster, benchmarks/results/xs-splits-h200.md)."""
    capacity = sm_count(device.index or 0) * warps_per_sm
    waves = capacity / n_tiles
    splits = max(1, round(waves if waves >= 4 else 2 * waves))
    return max(1, min(splits, k_tiles // min_tiles_per_warp))


def xs_rows(m: int) -> int:
    """Rows of x a block stages: m up to 16, else whole 16-row groups of the kernel's row groups (32 or 64)."""
    return m if m <= 16 else (32 if m <= 32 else 64)


def xs_smem(m: int, slice_tiles: int) -> int:
    """Shared memory of one block's x slice: 32 bytes per tile and row, plus a 16-byte skew per row."""
    return xs_rows(m) * (slice_tiles * 32 + 16)


def xs_min_splits(m: int, k_tiles: int, smem_bytes: int | None = None) -> int:
    """Fewest K splits whose x slice fits `smem_bytes` of shared memory per block (default: the policy's budget)."""
    smem_bytes = smem_bytes or (CROSSOVERS.xs_smem_bytes if m <= 32 else CROSSOVERS.xs_smem_bytes_64)
    slice_tiles = max(1, (smem_bytes // xs_rows(m) - 16) // 32)
    return -(-k_tiles // slice_tiles)


def use_xs(m: int, codebook: Codebook | int | None = None) -> bool:
    """Whether m rows of this codebook stage x in shared memory (one ldmatrix per tile instead of per-lane global
    loads). The kernels also need N % 64 == 0, which every group source and expert has (N % 128 == 0)."""
    mul1 = codebook is not None and int(codebook) == int(Codebook.MUL1)
    lo = CROSSOVERS.xs_min_m_mul1 if mul1 else CROSSOVERS.xs_min_m
    return lo <= m <= CROSSOVERS.xs_max_m


def xs_fits(m: int, slice_tiles: int) -> bool:
    """Whether a K slice of `slice_tiles` tiles of m rows fits the x-slice kernels' shared memory."""
    return xs_smem(m, slice_tiles) <= CROSSOVERS.xs_group_smem_bytes


def xs_splits(m: int, k_tiles: int, n_tiles: int, base_splits: int) -> int | None:
    """Split count for the shared-memory-x GEMM: the policy's budget's (`xs_min_splits`), no fewer than
    `base_splits`, no more than keep the partials within xs_partial_bytes; None where the slice that leaves cannot
    fit xs_group_smem_bytes (then global loads)."""
    cap = max(base_splits, CROSSOVERS.xs_partial_bytes // (m * n_tiles * 16 * 4))
    splits = min(k_tiles, max(base_splits, min(xs_min_splits(m, k_tiles), cap)))
    return splits if xs_fits(m, -(-k_tiles // splits)) else None


def auto_xs_splits(m: int, k_tiles: int, n_tiles: int, codebook: Codebook | int, device: torch.device) -> int | None:
    """The policy for a single linear given no split count: the shared-memory-x split count, or None for global
    loads at `default_splits`."""
    if not use_xs(m, codebook) or n_tiles % 4:
        return None
    return xs_splits(m, k_tiles, n_tiles, default_splits(k_tiles, n_tiles, device))


# ---- the x rings --------------------------------------------------------------------------------------------------

_WGMMA: dict[int, bool] = {}  # the library's probe, per device index
_WGMMA_PIN: list[bool] = []  # pinned_wgmma's stack


@cache
def _wgmma_knob() -> bool:
    return knobs.get("DEV_WGMMA") != "off"


@contextmanager
def pinned_wgmma(on: bool) -> Iterator[None]:
    """Inside, the policy takes the wgmma ring where it is available (on) or the mma.sync ring (off), whatever
    SGLANG_EXL3_DEV_WGMMA says: for A/B measurements and tests. A CUDA graph keeps the kernels it was captured with."""
    _WGMMA_PIN.append(on)
    try:
        yield
    finally:
        _WGMMA_PIN.pop()


def wgmma_ready(device: torch.device | None = None) -> bool:
    """Whether the wgmma ring serves this GPU: the library was built for sm_90a and runs on it, and
    SGLANG_EXL3_DEV_WGMMA is not off. The library's probe synchronizes, so it runs once per device, never inside a
    CUDA graph capture (a capture before any probe keeps the mma.sync ring)."""
    if not (_WGMMA_PIN[-1] if _WGMMA_PIN else _wgmma_knob()) or not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    if index not in _WGMMA:
        if torch.cuda.is_current_stream_capturing():
            return False
        with torch.cuda.device(index):
            _WGMMA[index] = load_library().exl3_wgmma_available() == 1
    return _WGMMA[index]


def wg_block_rows(m: int) -> int:
    """Rows of x per wgmma ring block (the library's wg_rows): the wgmma N, 16 to 256."""
    return next(r for r in (16, 32, 64, 128) if m <= r) if m <= 128 else 256


def mma_ring_mode(m: int) -> RingMode:
    """The mma.sync ring's mode for m rows: x in chunks of two trellis groups up to 32 rows and of one above
    (ring-ab-h200: with ring_splits, the fastest measured cell at 32 and 64 rows on all four shapes, within 4% at 16
    and 128)."""
    return RingMode.MMA_2 if m <= 32 else RingMode.MMA_1


def ring_mode(m: int, device: torch.device | None = None) -> RingMode:
    """The ring's mode for m rows: the wgmma ring (one trellis group per chunk) from wg_min_m rows where
    wgmma_ready(), else the mma.sync ring."""
    if m >= CROSSOVERS.wg_min_m and wgmma_ready(device):
        return RingMode.WGMMA_1
    return mma_ring_mode(m)


def uses_ring(m: int, n_tiles: int, device: torch.device | None = None) -> bool:
    """Whether m rows of a linear (or of every source of a group) with N = 16 n_tiles take the x-ring GEMM: up to
    wg_max_m rows where the wgmma ring serves, else ring_max_m."""
    most = CROSSOVERS.wg_max_m if m > CROSSOVERS.ring_max_m and wgmma_ready(device) else CROSSOVERS.ring_max_m
    return CROSSOVERS.ring_min_m <= m <= most and n_tiles % 8 == 0


def ring_splits(m: int, k_tiles: int, n_tiles: int, device: torch.device, mode: RingMode | None = None) -> int:
    """Half of default_splits, rounded up, unless that leaves fewer ring blocks than SMs (then default_splits): a
    ring block serves 8 column strips of one 64-row block, and fewer, longer K splits write fewer partials
    (ring-ab-h200: the best of {half, default, double} at m = 16-128 on 4096 x 14336, 14336 x 4096 and 4096 x 4096;
    on 4096 x 1024 half gives 64 blocks and default_splits is up to 21% faster). The wgmma ring: half up to 64 rows
    and a quarter above (wgmma-ab, H100: the fastest of {1, quarter, half, default} at 64-256 rows on 4096 x 14336
    and 14336 x 4096, where a block of 128-256 rows has the most work per tile), unless that leaves fewer blocks than
    half the SMs (then default_splits: 4096 x 1024 at 48-256 rows, 1.02-1.08x the best other count)."""
    base = default_splits(k_tiles, n_tiles, device)
    half = max(1, -(-base // 2))
    mode = ring_mode(m, device) if mode is None else mode
    if mode in WGMMA_RING_MODES:
        chosen = half if m <= 64 else max(1, base // 4)
        blocks = n_tiles // 8 * chosen * -(-m // wg_block_rows(m))
        return chosen if 2 * blocks >= sm_count(device.index or 0) else base
    blocks = n_tiles * half // 8 * -(-m // CROSSOVERS.ring_block_rows)
    return half if blocks >= sm_count(device.index or 0) else base


# ---- the fused GEMMs' reach ---------------------------------------------------------------------------------------

@cache
def fused_max_m_knob() -> int | None:
    """SGLANG_EXL3_DEV_FUSED_MAX_M where it is set, else None. Read once per process (validated at startup; parsing
    the environment per linear call cost ~2 µs on the eager path)."""
    return knobs.get("DEV_FUSED_MAX_M")


def fused_crossover_m(device: torch.device | None = None) -> int:
    """The most rows a dense linear runs on the fused GEMMs: SGLANG_EXL3_DEV_FUSED_MAX_M where set (at most what the
    GPU's rings serve), else wg_max_m where the wgmma ring serves, else fused_crossover_m."""
    most = CROSSOVERS.wg_max_m if wgmma_ready(device) else CROSSOVERS.fused_crossover_m
    knob = fused_max_m_knob()
    return most if knob is None else min(knob, most)


@dataclass(frozen=True)
class LinearPlan:
    """How m rows of one linear run: `path` 'fused' (x-slice / global-load GEMM, or the ring when `ring`) or
    'reconstruct' (W_hat then cuBLAS), at `splits` (None: the kernel's default), x in shared memory where `xs`."""

    path: str
    ring: int = 0
    splits: int | None = None
    xs: bool | None = None


def plan_linear(m: int, k_tiles: int, n_tiles: int, codebook: Codebook | int, device: torch.device,
                fused_max_m: int | None = None) -> LinearPlan:
    """The single-linear policy: the fused GEMMs up to fused_crossover_m() rows (`fused_max_m` overrides it); the x
    ring from ring_min_m rows where N allows; x in shared memory where use_xs says so and the slice fits; above
    global_loads_max_m rows without it, reconstruct + cuBLAS; above the crossover, reconstruct + cuBLAS."""
    if m > (fused_crossover_m(device) if fused_max_m is None else fused_max_m):
        return LinearPlan("reconstruct")
    if uses_ring(m, n_tiles, device):
        ring = ring_mode(m, device)
        return LinearPlan("fused", ring=ring, splits=ring_splits(m, k_tiles, n_tiles, device, ring))
    splits = auto_xs_splits(m, k_tiles, n_tiles, codebook, device)
    if m > CROSSOVERS.global_loads_max_m and splits is None:
        return LinearPlan("reconstruct")
    return LinearPlan("fused", splits=splits, xs=splits is not None)


# ---- groups on the wgmma ring -------------------------------------------------------------------------------------

def wg_splits(n_tiles: list[int], splits: list[int], device: torch.device) -> list[int] | None:
    """A group's splits on the wgmma ring (33-64 rows). Every split writes fp32 partials [S, m, N] that the output
    rotation reads back, and K splits are there only to give every SM a block: where the group's 128-column blocks
    alone number the SMs (Llama-3-8B gate/up: 224), one split (its 64 rows in 79.6 µs against 83.6 at 2 splits and
    86.2 at 3; H100, benchmarks/results/wgmma-ab-group-splits-h100-80gb-hbm3.md); otherwise half the load-time splits,
    rounded up -- the single-linear policy's count there (ring_splits; q/k/v: 16 -> 8, 26.5 µs against 26.8 at a
    quarter and 28.2 at an eighth) -- unless that leaves fewer blocks than half the SMs. None where no source would
    change."""
    sms = sm_count(device.index or 0)
    if sum(nt // 8 for nt in n_tiles) >= sms:
        fewer = [1] * len(splits)
    else:
        fewer = [max(1, -(-sp // 2)) for sp in splits]
    blocks = sum(nt // 8 * sp for nt, sp in zip(n_tiles, fewer, strict=True))
    if fewer == list(splits) or 2 * blocks < sms:
        return None
    return fewer


def one_split(wg: list[int] | None) -> bool:
    """Whether wgmma rows at these splits (wg_splits) are all at one split: then the group's output rotation runs
    inside its GEMM launch (group_run_rotating), with no partials. Where gate/up takes it, batch 64 decodes at 9,152
    against 8,984 tok/s with the partials and the rotation launch (H100, e2e-ab)."""
    return bool(wg) and all(s == 1 for s in wg)


def rotating_serves(wg_one_split: bool) -> bool:
    """Whether rows of a group whose wgmma rows are at one split take the rotating form: unless
    SGLANG_EXL3_DEV_WG_ROTATING=off (A/B)."""
    return wg_one_split and _rotating_knob()


@cache
def _rotating_knob() -> bool:
    return knobs.get("DEV_WG_ROTATING") != "off"


def single_wg_one_split(k_tiles: int, n_tiles: int, device: torch.device) -> bool:
    """Whether a single linear's one-source group at default splits would have its wgmma rows at one split."""
    return one_split(wg_splits([n_tiles], [default_splits(k_tiles, n_tiles, device)], device))


# ---- decode-sized launches ----------------------------------------------------------------------------------------

def decode_splits(k_tiles: int, n_tiles: int, sources: int, device: torch.device, least: int = 1) -> int:
    """K splits of one decode launch (the MoE decode forward, the one-launch linear): slices of whole 128-blocks (the
    block rotates its own slice of x), the most that keep sources * n_tiles * splits warps within one wave of resident
    warps, and at least `least` where it divides. H200 sweep (benchmarks/results/moe-decode-h200.md, Qwen3-30B-A3B
    layer): one wave is best at m = 1 (4 x 3), while from m = 4 the gate/up launch's single split lost 2-8% to two
    (1.2-1.5 waves)."""
    sms = sm_count(device.index or 0) if device.type == "cuda" else 132
    blocks, best = k_tiles // 8, 1
    for s in range(1, blocks + 1):
        if blocks % s == 0 and sources * n_tiles * s <= sms * CROSSOVERS.decode_wave_warps:
            best = s
    return least if best < least and blocks % least == 0 else best


def one_launch_splits(k_tiles: int, n_tiles: list[int], device: torch.device) -> int | None:
    """One split count for every source of a one-launch linear: the most that cut K into whole 128-blocks and keep
    the group's warps within one wave (decode_splits); None where K or an N is not whole 128-blocks."""
    if k_tiles % 8 or any(nt % 8 for nt in n_tiles):
        return None
    return decode_splits(k_tiles, sum(n_tiles), 1, device)


@cache
def _pdl_knob() -> bool:
    return bool(knobs.get("DEV_PDL"))


def launch_pdl(pdl: bool | None) -> bool:
    """Whether a kernel that can launch as a programmatic dependent does: `pdl` where given, else SGLANG_EXL3_DEV_PDL
    (read once per process, as the other knobs of the call path: an environment read costs ~2 µs)."""
    return _pdl_knob() if pdl is None else pdl

