"""The speculative checks' bookkeeping (integration/spec_checks.py): the lossless comparison (identical, near-tie,
failure, divergence after a token routed differently), the structured-output schema check, and re-splitting a
recorded comparison at the current tolerance."""

from __future__ import annotations

import pytest

from sglang_exl3.integration.spec_checks import SCHEMA, TOL, _schema_ok, compare, settle


def result(tokens: list[int], margins: list[float] | None = None) -> dict:
    margins = margins or [1.0] * len(tokens)
    return {"meta_info": {"output_token_logprobs": [[-0.1, t, None] for t in tokens],
                          "output_top_logprobs": [[[-0.1, t, None], [-0.1 - m, t + 1, None]]
                                                  for t, m in zip(tokens, margins, strict=True)]}}


def test_compare_tells_identical_near_tie_and_failure():
    base = [result([1, 2, 3]), result([4, 5, 6], [1.0, TOL / 2, 1.0]), result([7, 8, 9])]
    spec = [result([1, 2, 3]), result([4, 9, 9]), result([7, 0, 9])]
    got = compare(base, spec)
    assert got["identical"] == 1
    assert [(n["prompt"], n["position"]) for n in got["near_ties"]] == [(1, 1)]
    assert [(f["prompt"], f["position"]) for f in got["failures"]] == [(2, 1)]


def routed(result: dict, routes: list[list[list[int]]], prompt_tokens: int) -> dict:
    import base64

    import numpy as np

    result["meta_info"]["routed_experts"] = base64.b64encode(np.asarray(routes, dtype=np.int32).tobytes()).decode()
    result["meta_info"]["prompt_tokens"] = prompt_tokens
    return result


def test_compare_excuses_a_divergence_after_a_token_routed_differently():
    """An MoE target: a prompt of 2 tokens, 3 outputs, one layer of top-2 routes per token (every token but the last).
    Output 2 (token 4) diverging after token 1 or token 3 was routed differently is excused, since token 4 is computed
    from both; the same divergence with equal routes, or with no routes returned, fails."""
    same = [[[0, 1]], [[2, 3]], [[0, 2]], [[1, 3]]]
    other = [[[0, 1]], [[2, 4]], [[0, 2]], [[1, 3]]]  # token 1 routed differently
    late = [[[0, 1]], [[2, 3]], [[0, 2]], [[1, 4]]]  # token 3 (output 1) routed differently
    base = [routed(result([5, 6, 7]), same, 2) for _ in range(3)]
    spec = [routed(result([5, 6, 9]), other, 2), routed(result([5, 6, 9]), same, 2), routed(result([5, 6, 9]), late, 2)]
    got = compare(base, spec, moe=(1, 2))
    assert [(e["prompt"], e["first_token_routed_differently"]) for e in got["after_routing_difference"]] == \
        [(0, 1), (2, 3)]
    assert [f["prompt"] for f in got["failures"]] == [1]
    early = compare([routed(result([5, 6, 7]), same, 2)], [routed(result([8, 6, 7]), late, 2)], moe=(1, 2))
    assert len(early["failures"]) == 1  # output 0 (token 2) does not depend on token 3's routes
    routeless = compare([result([5, 6, 7])], [result([5, 6, 9])], moe=(1, 2))  # no routes returned: a failure
    assert len(routeless["failures"]) == 1 and routeless["after_routing_difference"] == []


def test_compare_counts_a_shorter_output_as_a_failure():
    got = compare([result([1, 2, 3])], [result([1, 2])])
    assert got["failures"] == [{"prompt": 0, "position": 2, "margin": float("inf")}]


def test_compare_needs_one_output_per_prompt():
    with pytest.raises(ValueError):
        compare([result([1])], [])


@pytest.mark.parametrize(("text", "ok"), [('{"name":"Ann","mood":"calm"}', True), ('{"name":"Ann"}', False),
                                          ('{"name":"An\x03","mood":"calm"}', True),
                                          ('{"name":"Ann","mood":"sad"}', False), ('{"name":"Ann","mood":"ca', False),
                                          ('{"name":"Ann","mood":"calm","x":1}', False)])
def test_schema_check(text, ok):
    assert set(SCHEMA["required"]) == {"name", "mood"}
    assert _schema_ok(text) is ok


def test_settle_resplits_a_recorded_comparison_at_the_current_tolerance():
    recorded = {"identical": 3, "near_ties": [{"prompt": 0, "position": 1, "margin": 0.01}],
                "failures": [{"prompt": 1, "position": 0, "margin": TOL}, {"prompt": 2, "position": 5, "margin": 0.5}]}
    got = settle(recorded)
    assert [t["prompt"] for t in got["near_ties"]] == [0, 1] and [f["prompt"] for f in got["failures"]] == [2]
    assert settle(got) == got and got["identical"] == 3
