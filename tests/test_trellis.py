"""Trellis decode against exllamav3's `reconstruct` for every (codebook, bitrate) it writes."""

import pytest
import torch

from sglang_exl3.codec import bits_from_words, pack_trellis, reconstruct, trellis_states, words_from_bits
from sglang_exl3.format import Codebook

VARIANTS = [(cb, k) for cb in ("3inst", "mcg", "mul1") for k in range(1, 9)] + [
    ("mul1", 1.5), ("mul1", 2.5), ("mul1", 3.5)]


@pytest.mark.parametrize("cb, bits", VARIANTS, ids=[f"{c}-{k}" for c, k in VARIANTS])
def test_reconstruct_bit_exact_with_exllamav3(golden, cb, bits):
    trellis = golden[f"reconstruct.{cb}.{bits}.trellis"]
    expected = golden[f"reconstruct.{cb}.{bits}.w_hat"]
    assert trellis.shape[-1] == words_from_bits(bits)
    ours = reconstruct(trellis, Codebook.from_label(cb))
    assert torch.equal(ours.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("cb, bits", [("mcg", 4), ("mul1", 2.5), ("3inst", 1)])
def test_golden_check_detects_a_single_flipped_bit(golden, cb, bits):
    """The golden comparison is sensitive: one flipped trellis bit changes the decode."""
    trellis = golden[f"reconstruct.{cb}.{bits}.trellis"].clone()
    expected = golden[f"reconstruct.{cb}.{bits}.w_hat"]
    trellis[1, 2, 3] ^= 1 << 7
    ours = reconstruct(trellis, Codebook.from_label(cb))
    assert not torch.equal(ours.view(torch.int16), expected.view(torch.int16))


def test_worked_anchor_states_and_values():
    words = torch.tensor([(i * 0x0101 + 0x1357) & 0xFFFF for i in range(64)])
    trellis = (words - ((words >> 15) << 16)).to(torch.int16).view(1, 1, 64)
    states = trellis_states(trellis)[0, 0]
    assert [hex(s) for s in states[:8].tolist()] == [
        "0x1951", "0x9514", "0x5145", "0x1458", "0x4581", "0x5813", "0x8135", "0x1357"]
    assert states[255].item() == 0x5195
    w = reconstruct(trellis, Codebook.MUL1)
    assert w[0, :4].tolist() == [-1.037109375, -0.1710205078125, 0.35009765625, 1.947265625]
    assert w[1, 0].item() == 1.5068359375 and w[0, 8].item() == 1.42578125


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8, 1.5, 2.5, 3.5])
def test_pack_is_the_inverse_of_decode(bits):
    gen = torch.Generator().manual_seed(int(bits * 10))
    trellis = torch.randint(-32768, 32768, (2, 3, words_from_bits(bits)), generator=gen, dtype=torch.int16)
    assert torch.equal(pack_trellis(trellis_states(trellis), bits), trellis)


def test_bits_words_mapping():
    assert bits_from_words(64) == 4 and bits_from_words(40) == 2.5
    assert words_from_bits(3.5) == 56
    with pytest.raises(ValueError):
        bits_from_words(60)
    with pytest.raises(ValueError):
        words_from_bits(4.25)


def test_reconstruct_is_chunk_invariant():
    gen = torch.Generator().manual_seed(3)
    trellis = torch.randint(-32768, 32768, (9, 8, 48), generator=gen, dtype=torch.int16)
    a = reconstruct(trellis, Codebook.MCG, rows_per_chunk=2)
    b = reconstruct(trellis, Codebook.MCG, rows_per_chunk=64)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
