"""EXL3 trellis tiles: bit stream -> 16-bit states -> fp16 tile values (and back).

A tile is a tail-biting ring of 256*K bits stored as 16*K int16 words (16*KA+8 words for the
half rates K = KA + 0.5, MUL1 only). Stream bits are MSB-first inside 32-bit words made of
little-endian int16 pairs. Position t reads the 16-bit window ending at bit floor((t+1)*2K/2),
indices modulo the ring. Positions map to tile elements by the mma.m16n8k16 B-fragment order.
"""

from __future__ import annotations

from functools import cache

import torch

from sglang_exl3.codec.codebook import Codebook, decode_states

TILE = 16
POSITIONS = 256
HALF_RATES = (1.5, 2.5, 3.5)


def bits_from_words(words: int) -> float | int:
    """Bitrate K from the trellis' last dimension (16*K words); half rates come out as x.5."""
    k2, rem = divmod(words, 8)
    if rem:
        raise ValueError(f"trellis last dimension {words} is not a multiple of 8")
    return k2 // 2 if k2 % 2 == 0 else k2 / 2


def words_from_bits(bits: float) -> int:
    """int16 words per tile for bitrate K (integer 1..8, or 1.5 / 2.5 / 3.5)."""
    words = bits * 16
    if words != int(words) or int(words) % 8:
        raise ValueError(f"unsupported EXL3 bitrate {bits}")
    return int(words)


@cache
def _window_plan(words: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each position: index of the first stream word, of the next one, and the right shift."""
    k2 = words // 8
    ring = 16 * words
    t = torch.arange(POSITIONS)
    end = ((t + 1) * k2) // 2
    start = (end - 16) % ring
    first = start >> 4
    return first, (first + 1) % words, 16 - (start & 15)


@cache
def _position_to_element() -> torch.Tensor:
    """Row-major tile element index (row = k offset, col = n offset) encoded by each position.

    Position bits, MSB to LSB: c0(3) rq(2) jc(1) jr8(1) jr1(1);
    row = 8*jr8 + 2*rq + jr1, col = 8*jc + c0.
    """
    p = torch.arange(POSITIONS)
    jr1, jr8, jc = p & 1, (p >> 1) & 1, (p >> 2) & 1
    rq, c0 = (p >> 3) & 3, p >> 5
    return (8 * jr8 + 2 * rq + jr1) * TILE + 8 * jc + c0


@cache
def _element_to_position() -> torch.Tensor:
    return torch.argsort(_position_to_element())


_DEVICE_CACHE: dict[tuple[str, int, str], torch.Tensor | tuple[torch.Tensor, ...]] = {}


def _on_device(name: str, arg: int, device: torch.device, build):
    """Index tensors cached per device (no host-to-device copy after the first call)."""
    key = (name, arg, str(device))
    value = _DEVICE_CACHE.get(key)
    if value is None:
        built = build()
        value = tuple(t.to(device) for t in built) if isinstance(built, tuple) else built.to(device)
        _DEVICE_CACHE[key] = value
    return value


def _stream_words(trellis: torch.Tensor) -> torch.Tensor:
    """int16 [..., W] -> int32 uint16 values in stream order (each int16 pair swapped)."""
    words = trellis.shape[-1]
    u = trellis.to(torch.int32) & 0xFFFF
    return u.reshape(*trellis.shape[:-1], words // 2, 2).flip(-1).reshape(trellis.shape)


def trellis_states(trellis: torch.Tensor) -> torch.Tensor:
    """int16 trellis [..., W] -> int32 states [..., 256] in position order."""
    if trellis.dtype != torch.int16:
        raise TypeError(f"trellis must be int16, got {trellis.dtype}")
    words = trellis.shape[-1]
    first, second, shift = _on_device("window", words, trellis.device, lambda: _window_plan(words))
    s = _stream_words(trellis)
    window = (s[..., first] << 16) | s[..., second]
    # int32 arithmetic shift is fine: the mask keeps bits that came from the 32-bit window.
    return (window >> shift) & 0xFFFF


def tiles_from_positions(values: torch.Tensor) -> torch.Tensor:
    """[kt, nt, 256] position-order values -> [16*kt, 16*nt] matrix ([in, out] orientation)."""
    kt, nt, _ = values.shape
    order = _on_device("order", 0, values.device, _element_to_position)
    tiles = values[..., order].reshape(kt, nt, TILE, TILE)
    return tiles.permute(0, 2, 1, 3).reshape(kt * TILE, nt * TILE)


def positions_from_tiles(matrix: torch.Tensor) -> torch.Tensor:
    """Inverse of tiles_from_positions: [16*kt, 16*nt] -> [kt, nt, 256] in position order."""
    k, n = matrix.shape
    kt, nt = k // TILE, n // TILE
    tiles = matrix.reshape(kt, TILE, nt, TILE).permute(0, 2, 1, 3).reshape(kt, nt, TILE * TILE)
    return tiles[..., _position_to_element().to(matrix.device)]


def reconstruct(
    trellis: torch.Tensor, codebook: Codebook, rows_per_chunk: int = 64
) -> torch.Tensor:
    """Decoded trellis W_hat, fp16 [in, out] (== exllamav3 `ext.reconstruct`, bit for bit).

    Works in chunks of tile rows so that CPU memory stays bounded on full-size layers.
    """
    if trellis.dim() != 3:
        raise ValueError(f"trellis must have rank 3 [K/16, N/16, 16*bits], got {tuple(trellis.shape)}")
    kt, nt, _ = trellis.shape
    out = torch.empty(kt * TILE, nt * TILE, dtype=torch.float16, device=trellis.device)
    for r0 in range(0, kt, rows_per_chunk):
        chunk = trellis[r0 : r0 + rows_per_chunk]
        values = decode_states(trellis_states(chunk), codebook)
        out[r0 * TILE : (r0 + chunk.shape[0]) * TILE] = tiles_from_positions(values)
    return out


def _position_bits(words: int) -> torch.Tensor:
    """Bits each position contributes to the stream (K, or alternately KA and KA+1)."""
    first, _, _ = _window_plan(words)
    k2 = words // 8
    t = torch.arange(POSITIONS)
    return ((t + 1) * k2) // 2 - (t * k2) // 2


def pack_trellis(states: torch.Tensor, bits: float) -> torch.Tensor:
    """Encoder side of the ring: states [..., 256] -> int16 trellis [..., 16*K].

    Position t writes the low D(t) bits of its state to stream bits [S(t)-D(t), S(t)),
    S = cumulative D. Decoding the result gives back `states` whenever they form a consistent
    tail-biting path (each state's high bits are the previous states' low bits). Runs on the states' device (the
    encoder's GPU: on the CPU this packing cost a third of a layer's encoding time).
    """
    words = words_from_bits(bits)
    widths = _position_bits(words).tolist()
    lead = states.shape[:-1]
    flat = states.reshape(-1, POSITIONS).to(torch.int64) & 0xFFFF
    stream = torch.zeros(flat.shape[0], words * 16, dtype=torch.int64, device=states.device)
    pos = 0
    for t, width in enumerate(widths):
        sym = flat[:, t] & ((1 << width) - 1)
        for b in range(width):  # MSB of the symbol first
            stream[:, pos + b] = (sym >> (width - 1 - b)) & 1
        pos += width
    weights = 1 << torch.arange(15, -1, -1, device=states.device)
    u16 = (stream.view(-1, words, 16) * weights).sum(-1)  # stream-order uint16 words
    u16 = u16.view(-1, words // 2, 2).flip(-1).reshape(-1, words)  # swap back to storage order
    return (u16 - ((u16 >> 15) << 16)).to(torch.int16).reshape(*lead, words)
