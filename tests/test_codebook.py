"""Codebooks against exllamav3's decode kernel (all 65,536 states) and published anchors."""

import hashlib

import pytest
import torch

from sglang_exl3.codec import codebook_table, decode_states
from sglang_exl3.format import Codebook


@pytest.mark.parametrize("cb", list(Codebook))
def test_whole_codebook_matches_exllamav3(golden, cb):
    ours = codebook_table(cb).view(torch.int16)
    theirs = golden[f"codebook.{cb.label}"].view(torch.int16)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("cb, sha, anchors", [
    (Codebook.INST3, "ad88de2dcff5bb05", [0x3A25, 0xBB5B, 0xC066, 0xB110]),
    (Codebook.MCG, "95383563929baa9d", [0x3F60, 0x304E, 0x3E0F, 0x3ACD]),
    (Codebook.MUL1, "bc48d02cb1c14939", [0xC2E8, 0x3921, 0xB89E, 0xB936]),
])
def test_codebook_anchors(cb, sha, anchors):
    table = codebook_table(cb)
    assert hashlib.sha256(table.view(torch.int16).numpy().tobytes()).hexdigest()[:16] == sha
    bits = table[torch.tensor([0, 1, 0x1234, 0xFFFF])].view(torch.int16).to(torch.int32) & 0xFFFF
    assert bits.tolist() == anchors


def test_decode_states_masks_sign_extension():
    states = torch.tensor([-1, 0xFFFF, 5], dtype=torch.int64)
    out = decode_states(states, Codebook.MCG)
    assert torch.equal(out[0].view(torch.int16), out[1].view(torch.int16))


def test_codebook_labels_round_trip():
    for cb in Codebook:
        assert Codebook.from_label(cb.label) is cb
    with pytest.raises(ValueError, match="unknown EXL3 codebook"):
        Codebook.from_label("qtip")
    with pytest.raises(ValueError, match="both mcg and mul1"):
        Codebook.from_markers(True, True)
