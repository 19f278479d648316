"""The GPU parity checker's comparison rule (tests/gpu/serve_parity.py) on synthetic logprobs."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "gpu"))
import serve_parity as sp  # noqa: E402


def _pos(values, ids):
    return [[v, i, None] for v, i in zip(values, ids, strict=True)]


def _stats():
    return {"positions": 0, "max_abs_diff": 0.0, "failures": []}


def test_equal_within_tolerance_passes_and_ties_may_swap():
    ref = [None, _pos([-1.0, -2.0, -3.0, -4.0, -5.0, -5.001], [1, 2, 3, 4, 5, 6])]
    got = [None, _pos([-1.001, -2.0, -3.0, -4.0, -5.0, -5.0], [1, 2, 3, 4, 6, 5])]  # rank 4/5 tie swapped
    stats = _stats()
    sp.compare_positions(got, ref, stats, "x")
    assert stats["failures"] == [] and stats["positions"] == 1 and stats["max_abs_diff"] < 0.002


def test_value_or_clear_rank_difference_fails():
    ref = [_pos([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0], [1, 2, 3, 4, 5, 6])]
    stats = _stats()
    sp.compare_positions([_pos([-1.0, -2.1, -3.0, -4.0, -5.0, -6.0], [1, 2, 3, 4, 5, 6])], ref, stats, "x")
    assert any("differ by 0.1000" in f for f in stats["failures"])
    stats = _stats()
    sp.compare_positions([_pos([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0], [1, 2, 3, 9, 5, 6])], ref, stats, "x")
    assert stats["failures"] == ["x pos 0: rank 3 token 9 != 4"]


def test_greedy_divergence_only_allowed_at_near_ties():
    def result(tokens, tops):
        return {"meta_info": {"input_top_logprobs": [None], "output_token_logprobs": [[0, t, None] for t in tokens],
                              "output_top_logprobs": tops}}
    tie = _pos([-1.0, -1.005, -3.0, -4.0, -5.0, -6.0], [7, 8, 3, 4, 5, 6])
    tie_swapped = _pos([-1.0, -1.005, -3.0, -4.0, -5.0, -6.0], [8, 7, 3, 4, 5, 6])
    stats = sp.compare([result([8], [tie_swapped])], [result([7], [tie])])
    assert stats["greedy_diverged_at_near_tie"] == 1 and stats["failures"] == []
    clear = _pos([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0], [7, 8, 3, 4, 5, 6])
    stats = sp.compare([result([8], [clear])], [result([7], [clear])])
    assert any("clear reference winner" in f for f in stats["failures"])
