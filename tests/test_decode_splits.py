"""The decode MoE's split policy (CPU): K slices of whole 128-blocks, one wave of resident warps, the gate/up
launch's floor of two splits (measured on the H200: benchmarks/results/moe-decode-h200.md)."""

from __future__ import annotations

import torch

from sglang_exl3.kernels.dispatch import decode_splits

HEAD_META = [1, 256, 8016, 128256, 128256, 8, 256, 0, 0, 0]  # Exl3Group.meta: a 4096 x 128256 lm_head, one split

CPU = torch.device("cpu")  # 132 SMs assumed off the GPU (the H200's count)


def test_one_wave_of_whole_blocks():
    # Qwen3-30B-A3B at m = 1: 16 gate/up sources x 48 strips fit 4 splits in 132 x 32 warps; down 8 x 128 fits 3
    assert decode_splits(128, 48, 16, CPU, least=2) == 4
    assert decode_splits(48, 128, 8, CPU) == 3
    for kt, nt, sources in ((128, 48, 64), (48, 128, 32), (40, 24, 3)):
        s = decode_splits(kt, nt, sources, CPU)
        assert (kt // 8) % s == 0 and (s == 1 or sources * nt * s <= 132 * 32)


def test_gate_up_floor_of_two():
    assert decode_splits(128, 48, 64, CPU) == 1  # m = 4: one split fills the wave...
    assert decode_splits(128, 48, 64, CPU, least=2) == 2  # ...but two measured 2-8% faster
    assert decode_splits(24, 48, 64, CPU, least=2) == 1  # 3 blocks of 128: two does not divide them
    assert decode_splits(8, 48, 64, CPU, least=2) == 1  # a single block cannot split


def test_moe_decode_rejects_bad_arguments_before_any_launch():
    """Bad inputs fail with an error naming what is wrong (checked before the kernel library is touched)."""
    import pytest

    from sglang_exl3.kernels.moe_ops import decode_counters, moe_decode
    from sglang_exl3.kernels.moe_tables import Exl3ExpertBank

    rows = torch.zeros(4, 8, dtype=torch.int64)
    gate = Exl3ExpertBank.from_meta(rows, [24, 16, 2, 8, 1])  # N 384, K 256, 4 bits, MCG
    down = Exl3ExpertBank.from_meta(rows, [16, 24, 3, 8, 1])
    x, ids, w = torch.zeros(2, 256, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int32), torch.zeros(4)
    good = decode_counters(4, 2, 256, 384, CPU)
    with pytest.raises(ValueError, match="counters must be int32 with at least 16"):
        moe_decode(x, ids, w, gate, gate, down, 2, False, torch.zeros(15, dtype=torch.int32))
    with pytest.raises(ValueError, match="fp16/bf16 x"):
        moe_decode(x.float(), ids, w, gate, gate, down, 2, False, good)
    with pytest.raises(ValueError, match="fp16/bf16 x"):
        moe_decode(x, ids, w.half(), gate, gate, down, 2, False, good)
    with pytest.raises(ValueError, match="gu_splits 3 must divide 2"):
        moe_decode(x, ids, w, gate, gate, down, 2, False, good, gu_splits=3)
    with pytest.raises(ValueError, match="gate and up share"):
        moe_decode(x, ids, w, gate, Exl3ExpertBank.from_meta(rows, [24, 16, 2, 6, 1]), down, 2, False, good)
    assert good.numel() == 4 * 3 + 2 * 2 and not good.any()


def test_one_launch_cuts_k_into_whole_blocks_within_one_wave():
    """A dense linear or group as one launch: one split count for all sources, dividing K / 128, the group's warps
    within one wave (Llama-3-8B shapes on 132 SMs); None where K or an N is not whole 128-blocks."""
    from sglang_exl3.kernels.dispatch import one_launch_splits

    for kt, widths, want in ((256, (896,), 4), (896, (256,), 16), (256, (256, 64, 64), 8), (256, (8016,), 1)):
        splits = one_launch_splits(kt, list(widths), CPU)
        assert splits == want and (kt // 8) % want == 0, (kt, widths, splits)
    assert one_launch_splits(252, [8], CPU) is None  # K = 4032
    assert one_launch_splits(256, [8, 4], CPU) is None  # an output of 64 columns


def test_one_launch_serves_rows_whose_x_slice_fits():
    """The lm_head's slice (256 tiles at one split) fits 96 KB of shared memory for 11 rows, not 12; never above 16, nor
    above the rows it is made for."""
    from sglang_exl3.kernels.groups import Exl3Group, Exl3OneLaunch

    head = Exl3OneLaunch(Exl3Group.from_meta(torch.zeros(1, 8, dtype=torch.int64), HEAD_META, 1), torch.zeros(1002))
    assert head.serves(11) and not head.serves(12)
    small = Exl3OneLaunch(Exl3Group.from_meta(torch.zeros(1, 8, dtype=torch.int64),
                                              [1, 256, 64, 1024, 8192, 8, 32, 0, 0, 0], 1), torch.zeros(8))
    assert small.serves(16) and not small.serves(17)
    one_row = Exl3OneLaunch(small.group, small.counters, max_m=1)  # SGLANG_EXL3_DEV_ONE_LAUNCH_MAX_M's default
    assert one_row.serves(1) and not one_row.serves(2)
