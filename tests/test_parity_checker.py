"""The GPU parity checker's comparison rule (tests/gpu/serve_parity.py) on synthetic logprobs."""

import base64
import sys
from pathlib import Path

import numpy as np

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


def _moe_result(inputs, routes, tokens=(), outputs=()):
    raw = base64.b64encode(np.asarray(routes, dtype=np.int32).tobytes()).decode()
    return {"meta_info": {"input_top_logprobs": inputs, "output_token_logprobs": [[0, t, None] for t in tokens],
                          "output_top_logprobs": list(outputs), "routed_experts": raw}}


def test_moe_positions_after_a_routing_difference_are_excused_not_compared():
    good = _pos([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0], [1, 2, 3, 4, 5, 6])
    off = _pos([-1.5, -2.0, -3.0, -4.0, -5.0, -6.0], [1, 2, 3, 4, 5, 6])
    n = 60  # tokens; routes [tokens, layers=2, topk=2], one token routed differently in layer 1
    ref_routes = np.tile(np.array([[0, 1], [2, 3]]), (n, 1, 1))
    got_routes = ref_routes.copy()
    got_routes[45, 1] = [3, 1]
    ref = _moe_result([None] + [good] * (n - 1), ref_routes[:, :, ::-1])  # order within top-k is irrelevant
    # a difference at position 46 (after token 45's route) is excused ...
    got = _moe_result([None] + [good] * 45 + [off] * (n - 46), got_routes)
    stats = sp.compare([got], [ref], moe=(2, 2))
    assert stats["failures"] == [] and stats["tokens_routed_differently"] == 1
    assert stats["excused_after_routing_difference"] == n - 46 and stats["positions"] == 45
    # ... one at position 45 (before it) is not
    got = _moe_result([None] + [good] * 44 + [off] * (n - 45), got_routes)
    assert any("prefill pos 45" in f for f in sp.compare([got], [ref], moe=(2, 2))["failures"])


def test_moe_routing_differences_beyond_near_ties_fail():
    good = _pos([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0], [1, 2, 3, 4, 5, 6])
    n = 20
    ref_routes = np.tile(np.array([[0, 1]]), (n, 1, 1))
    got_routes = ref_routes.copy()
    got_routes[5:, 0] = [2, 3]  # a wrong expert output changes routes early
    stats = sp.compare([_moe_result([None] + [good] * (n - 1), got_routes)],
                       [_moe_result([None] + [good] * (n - 1), ref_routes)], moe=(1, 2))
    assert any("follow a routing difference" in f for f in stats["failures"])
    missing = _moe_result([None] + [good] * (n - 1), ref_routes)
    del missing["meta_info"]["routed_experts"]
    stats = sp.compare([missing], [_moe_result([None] + [good] * (n - 1), ref_routes)], moe=(1, 2))
    assert any("no routed experts" in f for f in stats["failures"])


def test_moe_greedy_divergence_after_a_routing_difference_is_excused():
    clear = _pos([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0], [7, 8, 3, 4, 5, 6])
    other = _pos([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0], [8, 7, 3, 4, 5, 6])
    prompt = [None] + [clear] * 19  # 20 prompt tokens, then 2 outputs: routes for tokens 0..20
    ref_routes = np.tile(np.array([[0, 1]]), (21, 1, 1))
    got_routes = ref_routes.copy()
    got_routes[19, 0] = [1, 2]  # the last prompt token routed differently: every output may differ
    stats = sp.compare([_moe_result(prompt, got_routes, tokens=(8, 7), outputs=(other, clear))],
                       [_moe_result(prompt, ref_routes, tokens=(7, 8), outputs=(clear, clear))], moe=(1, 2))
    assert stats["failures"] == [] and stats["greedy_diverged_after_routing_difference"] == 1


def test_moe_shape_comes_from_the_checkpoint_config(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 3, "num_experts": 8,
                                                      "num_experts_per_tok": 2}))
    assert sp.moe_shape(tmp_path) == (3, 2)
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 3, "num_local_experts": 4,
                                                      "num_experts_per_tok": 2}))  # Mixtral's spelling
    assert sp.moe_shape(tmp_path) == (3, 2)
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 3}))
    assert sp.moe_shape(tmp_path) is None
