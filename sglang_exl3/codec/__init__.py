"""Bit-exact reference codec for EXL3 trellis weights (pure torch, CPU or GPU).

The oracle is exllamav3 itself: `reconstruct` must match `ext.reconstruct` bit for bit and
`had_r_128` must match `ext.had_r_128`; golden vectors recorded from exllamav3 live in tests/.
"""

from sglang_exl3.codec.codebook import Codebook, codebook_table, decode_states
from sglang_exl3.codec.hadamard import had_r_128, hadamard_128
from sglang_exl3.codec.linear import exl3_linear_reference
from sglang_exl3.codec.signs import unpack_sign_bits
from sglang_exl3.codec.trellis import (
    bits_from_words,
    pack_trellis,
    reconstruct,
    trellis_states,
    words_from_bits,
)
from sglang_exl3.codec.weight import dequantize_weight

__all__ = [
    "Codebook",
    "bits_from_words",
    "codebook_table",
    "decode_states",
    "dequantize_weight",
    "exl3_linear_reference",
    "had_r_128",
    "hadamard_128",
    "pack_trellis",
    "reconstruct",
    "trellis_states",
    "unpack_sign_bits",
    "words_from_bits",
]
