"""Legacy su/sv sign bitfields (bit i of word j = sign of element 16j+i, set = -1)."""

import pytest
import torch

from sglang_exl3.codec import unpack_sign_bits


def test_unpack_sign_bits_lsb_first():
    packed = torch.tensor([0b101, -32768], dtype=torch.int16)  # word 1: only bit 15 set
    signs = unpack_sign_bits(packed)
    assert signs.dtype == torch.float16 and signs.shape == (32,)
    assert signs[:4].tolist() == [-1.0, 1.0, -1.0, 1.0]
    assert signs[16:31].tolist() == [1.0] * 15 and signs[31].item() == -1.0


def test_unpack_sign_bits_round_trip_random():
    gen = torch.Generator().manual_seed(5)
    bits = torch.randint(0, 2, (64,), generator=gen)
    words = (bits.view(4, 16) << torch.arange(16)).sum(-1)
    packed = (words - ((words >> 15) << 16)).to(torch.int16)
    assert torch.equal(unpack_sign_bits(packed), (1 - 2 * bits).half())


def test_unpack_sign_bits_rejects_wrong_dtype():
    with pytest.raises(ValueError, match="1-D int16"):
        unpack_sign_bits(torch.zeros(4, dtype=torch.int32))
