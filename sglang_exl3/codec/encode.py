"""EXL3 trellis encoding: tile values -> the K-bit symbol path whose decoded states are closest in squared error
(Viterbi), as a tail-biting ring that `trellis.pack_trellis` writes and the decoder reads back exactly.

The trellis is a 16-bit shift register: state(t) = ((state(t-1) << K) | symbol) & 0xFFFF, so a state's top 16-K bits
are its predecessor's low 16-K bits. Viterbi keeps, per value of those low bits (an "edge", 2^(16-K) of them), the
least cumulative error of a path ending there and where it came from. The ring wraps: state(0) reads the last
16-K bits of the stream. As exllamav3's encoder (`quantize_tiles`) does, a first pass starting halfway round the
ring finds where a good path crosses position 0; the second pass starts from that edge and must end on it, which
closes the ring. The result is the exact optimum whenever the two passes agree on that edge, else a consistent
path within a small margin of it.

Pure torch, on whatever device the input is on (the CPU for tests and small models); `kernels/cuda_encode.py` runs
the same search as a CUDA kernel and can be passed as `encoder`. Integer K only (1..8); the half rates are MUL1-only
and not encoded here.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

from sglang_exl3.codec.codebook import Codebook, codebook_table
from sglang_exl3.codec.trellis import POSITIONS, pack_trellis

MAX_TILES_PER_CHUNK_BYTES = 256 << 20  # backpointers + step errors of one chunk of tiles


def _tables(k: int, codebook: Codebook, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The codebook as [2^K (hi), Q, 2^K (r)] with state = hi << (16-K) | edge and edge = q << K | r (Q = 2^(16-2K)),
    and each edge's q = edge >> K, [Q, 2^K]. A state's in-edge is (hi << (16-2K)) | q: it does not depend on r, so
    the predecessor costs broadcast over r (no gather)."""
    kq = 16 - 2 * k
    states = torch.arange(1 << 16, device=device).view(1 << k, 1 << kq, 1 << k)
    q = torch.arange(1 << kq, device=device).view(-1, 1).expand(-1, 1 << k)
    return codebook_table(codebook, device).float()[states], q


def _forward(x: torch.Tensor, order: list[int], values: torch.Tensor, q: torch.Tensor,
             start: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cumulative errors [T, E] after the last position of `order`, and backpointers [256, T, E] (the in-edge chosen
    at each position). `start` [T]: the edge every path must come from at the first position."""
    tiles, (hi_count, q_count, r_count) = x.shape[0], values.shape
    kq = q_count.bit_length() - 1
    back = torch.empty(POSITIONS, tiles, q_count * r_count, dtype=torch.int16, device=x.device)
    in_edges = (torch.arange(hi_count, device=x.device).view(-1, 1) << kq) | torch.arange(q_count, device=x.device)
    cost = None
    for i, pos in enumerate(order):
        err = (values.unsqueeze(0) - x[:, pos].view(-1, 1, 1, 1)).square_()  # [T, 2^K, Q, 2^K]
        if i == 0:
            if start is not None:
                err.masked_fill_((in_edges.unsqueeze(0) != start.view(-1, 1, 1)).unsqueeze(-1), float("inf"))
        else:
            err += cost.view(tiles, hi_count, q_count, 1)
        cost, hi = err.min(dim=1)  # [T, Q, 2^K]: the lowest hi among equal errors
        back[pos] = ((hi << kq) | q).view(tiles, -1).to(torch.int16)
        cost = cost.view(tiles, -1)
    return cost, back


def _backtrack(back: torch.Tensor, order: list[int], end: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk the backpointers from edge `end` [T] at the last position of `order`: (states [T, 256] in position order,
    the edge the path came from before the first position)."""
    states = torch.empty(back.shape[1], POSITIONS, dtype=torch.int64, device=back.device)
    edge = end.long()
    rows = torch.arange(back.shape[1], device=back.device)
    mask = (1 << 16) - 1
    for pos in reversed(order):
        prev = back[pos, rows, edge].long() & 0xFFFF
        states[:, pos] = ((prev << k) | edge) & mask
        edge = prev
    return states, edge


def encode_tiles(x: torch.Tensor, k: int, codebook: Codebook = Codebook.MCG) -> torch.Tensor:
    """x [T, 256] (position order) -> 16-bit states [T, 256] of a consistent tail-biting path of least squared error
    (see the module docstring for the two passes)."""
    if x.dim() != 2 or x.shape[1] != POSITIONS:
        raise ValueError(f"expected tiles [T, {POSITIONS}] in position order, got {tuple(x.shape)}")
    if k not in range(1, 9):
        raise ValueError(f"the encoder takes integer K in 1..8, got {k}")
    x = x.float()
    values, q = _tables(k, codebook, x.device)
    edges = values.shape[1] * values.shape[2]
    chunk = max(1, MAX_TILES_PER_CHUNK_BYTES // (edges * (POSITIONS * 2 + 3 * 4 * (1 << k))))
    rolled = list(range(POSITIONS // 2, POSITIONS)) + list(range(POSITIONS // 2))
    straight = list(range(POSITIONS))
    out = []
    for c0 in range(0, x.shape[0], chunk):
        xc = x[c0:c0 + chunk]
        cost, back = _forward(xc, rolled, values, q, None)
        # the edge crossing into position 0 on the best first-pass path: walk back from its end to position 0
        _, crossing = _backtrack(back, rolled[POSITIONS // 2:], cost.argmin(dim=1), k)
        cost, back = _forward(xc, straight, values, q, crossing)
        states, _ = _backtrack(back, straight, crossing, k)
        out.append(states)
    return torch.cat(out).to(torch.int32)


TilesEncoder = Callable[[torch.Tensor, int, Codebook], torch.Tensor]  # encode_tiles, or kernels.cuda_encode's


def module_seed(key: str) -> int:
    """The sign seed of the module with checkpoint key `key` (model.layers.0.self_attn.q_proj): one function for
    `encode` and online encoding, so that both give a model the same weights."""
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


def encode_trellis(tiles: torch.Tensor, k: int, codebook: Codebook = Codebook.MCG,
                   encoder: TilesEncoder | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Position-order tile values [..., 256] -> (int16 trellis [..., 16K], the decoded fp16 values [..., 256])."""
    from sglang_exl3.codec.codebook import decode_states

    lead = tiles.shape[:-1]
    states = (encoder or encode_tiles)(tiles.reshape(-1, POSITIONS), k, codebook)
    trellis = pack_trellis(states, k)
    return trellis.reshape(*lead, -1), decode_states(states, codebook).reshape(*lead, POSITIONS)


def _rotate_blocks(w: torch.Tensor) -> torch.Tensor:
    """H w H with H the block-diagonal normalised Sylvester-Hadamard-128 on both sides (w [in, out], fp32)."""
    from sglang_exl3.codec.hadamard import BLOCK, hadamard_128

    h = hadamard_128(torch.float32, w.device)
    k, n = w.shape
    left = (h @ w.reshape(k // BLOCK, BLOCK, n)).reshape(k, n)
    return (left.reshape(k, n // BLOCK, BLOCK) @ h).reshape(k, n)


def encode_weight(w: torch.Tensor, k: int, codebook: Codebook = Codebook.MCG, seed: int = 0,
                  encoder: TilesEncoder | None = None) -> dict[str, torch.Tensor]:
    """An uncalibrated EXL3 linear for w [in, out] (y = x @ w; in and out multiples of 128): random input / output
    signs and Hadamard rotations make the weights near-Gaussian, one scale brings them to the codebook's spread,
    and each 16x16 tile is encoded by `encode_tiles` (no Hessian, so no LDLQ: exllamav3's fallback when it has no
    calibration). Returns trellis [in/16, out/16, 16K] (int16), suh [in] and svh [out] (fp16) such that
    w ~ diag(suh) H W_hat H diag(svh), the decoder's formula, and `proxy_error`: the mean squared error of the
    encoded tiles over their variance (the fraction of the weight's energy lost, before the fp16 scales)."""
    from sglang_exl3.codec.hadamard import BLOCK
    from sglang_exl3.codec.trellis import positions_from_tiles

    rows, cols = w.shape
    if rows % BLOCK or cols % BLOCK:
        raise ValueError(f"EXL3 encoding needs both dimensions in multiples of {BLOCK}, got {rows}x{cols}")
    gen = torch.Generator().manual_seed(seed)
    su = (torch.randint(0, 2, (rows,), generator=gen) * 2 - 1).float().to(w.device)
    sv = (torch.randint(0, 2, (cols,), generator=gen) * 2 - 1).float().to(w.device)
    rotated = _rotate_blocks(w.float() * su[:, None] * sv[None, :])
    spread = float(codebook_table(codebook, w.device).float().std())
    scale = float(rotated.std()) / spread if float(rotated.std()) > 0 else 1.0
    target = positions_from_tiles(rotated / scale)
    trellis, values = encode_trellis(target, k, codebook, encoder)
    proxy = float((values.float() - target).square().mean() / target.var().clamp_min(1e-30))
    return {"trellis": trellis, "suh": (su * scale).to(torch.float16), "svh": sv.to(torch.float16),
            "proxy_error": proxy}


def encode_linear(weight: torch.Tensor, k: int, codebook: Codebook = Codebook.MCG, seed: int = 0,
                  encoder: TilesEncoder | None = None) -> dict[str, torch.Tensor]:
    """`encode_weight` of a linear's [out, in] weight (the Hugging Face layout), zero-padded to whole 128-element
    blocks on both sides as exllamav3 pads, on the weight's device: trellis, suh and svh of the padded shape."""
    from sglang_exl3.format.constants import padded

    out_f, in_f = weight.shape
    w = torch.zeros(padded(in_f), padded(out_f), dtype=torch.float32, device=weight.device)
    w[:in_f, :out_f] = weight.float().t()
    return encode_weight(w, k, codebook, seed, encoder)
