"""The trellis encoder (codec/encode.py): its paths decode exactly to the values it reports through the project's
own packer and decoder, close the tail-biting ring, cannot be improved by changing one symbol away from the ring's
crossing, and reach the known distortion of a 16-bit trellis on Gaussian data; the uncalibrated weight encoder
gives an EXL3 linear that the reference forward computes within that distortion."""

from __future__ import annotations

import pytest
import torch

from sglang_exl3.codec import exl3_linear_reference
from sglang_exl3.codec.codebook import Codebook, codebook_table, decode_states
from sglang_exl3.codec.encode import encode_tiles, encode_trellis, encode_weight
from sglang_exl3.codec.trellis import trellis_states


def _gaussian(tiles: int, seed: int, codebook=Codebook.MCG) -> torch.Tensor:
    spread = codebook_table(codebook).float().std()
    return torch.randn(tiles, 256, generator=torch.Generator().manual_seed(seed)) * spread


@pytest.mark.parametrize(("k", "codebook"), [(1, Codebook.MCG), (2, Codebook.MCG), (4, Codebook.MUL1),
                                             (8, Codebook.INST3)])
def test_paths_decode_to_what_the_encoder_reports_and_close_the_ring(k, codebook):
    x = _gaussian(2, k, codebook)
    trellis, values = encode_trellis(x, k, codebook)
    assert trellis.shape == (2, 16 * k) and trellis.dtype == torch.int16
    states = trellis_states(trellis)
    assert torch.equal(decode_states(states, codebook), values)
    mask = (1 << (16 - k)) - 1
    assert torch.equal(states[:, 0] >> k, states[:, 255] & mask)


def _error(states: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (decode_states(states, Codebook.MCG).float() - x).square().sum(-1)


def _states(symbols: torch.Tensor, k: int) -> torch.Tensor:
    """The ring's 16-bit states from its K-bit symbols (state(t) ends with symbol t)."""
    out = torch.zeros_like(symbols)
    for j in range(-(-16 // k)):
        out |= torch.roll(symbols, j, dims=-1) << (j * k)
    return out & 0xFFFF


def test_no_single_symbol_change_lowers_the_error():
    """Changing any symbol whose bits do not reach the crossing edge (the last 16-K bits of the ring) gives a
    consistent ring again; none of them beats the encoder's."""
    k, x = 2, _gaussian(2, 5)
    states = encode_tiles(x, k).long()
    symbols = states & ((1 << k) - 1)
    assert torch.equal(_states(symbols, k), states)
    best = _error(states, x)
    crossing = -(-(16 - k) // k)
    for t in range(256 - crossing):
        for alt in range(1 << k):
            changed = symbols.clone()
            changed[:, t] = alt
            assert bool((_error(_states(changed, k), x) >= best - 1e-4).all()), (t, alt)


@pytest.mark.parametrize("k", [2, 3])
def test_distortion_is_near_the_rate_distortion_bound(k):
    """Gaussian source: mean squared error over variance within 1.35x of 2^(-2K) (measured 1.12x at K = 2, 1.14x at
    K = 3, 1.25x at 4); below the bound would mean the decoder reads something other than what was scored."""
    x = _gaussian(4, 10 + k)
    _, values = encode_trellis(x, k)
    relative = float((values.float() - x).square().mean() / x.var())
    assert 2.0 ** (-2 * k) <= relative <= 1.35 * 2.0 ** (-2 * k)


def test_an_encoded_weight_is_an_exl3_linear():
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(3)) * 0.02
    enc = encode_weight(w, 4, seed=1)
    assert enc["trellis"].shape == (8, 8, 64) and enc["suh"].dtype == enc["svh"].dtype == torch.float16
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(4))
    y = exl3_linear_reference(x.half(), enc["trellis"], enc["suh"], enc["svh"], Codebook.MCG).float()
    want = x @ w
    assert float((y - want).norm() / want.norm()) < 0.09  # sqrt of the 4-bit distortion, ~0.07
    with pytest.raises(ValueError, match="multiples of 128"):
        encode_weight(torch.zeros(100, 128), 4)
