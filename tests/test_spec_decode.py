"""The speculative-decoding benchmark's bookkeeping: the lossless comparison and the derived columns of its rows."""

from __future__ import annotations

import pytest

from benchmarks.spec_checks import SCHEMA, TOL, _schema_ok, compare
from benchmarks.spec_decode import chat_ids, derive


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


def row(target, algorithm, batch, tok_s, category="all"):
    return {"target": target, "algorithm": algorithm, "batch": batch, "category": category, "tok_s": tok_s}


def test_derive_pairs_each_row_with_its_baseline_and_the_bf16_target():
    rows = [row("exl3", "none", 1, 100.0), row("exl3", "EAGLE3", 1, 250.0), row("bf16", "none", 1, 120.0),
            row("bf16", "EAGLE3", 1, 200.0), row("exl3", "EAGLE3", 8, 900.0), row("exl3", "NGRAM", 1, None)]
    derive(rows)
    eagle = rows[1]
    assert eagle["tok_s_no_spec"] == 100.0 and eagle["speedup"] == 2.5 and eagle["vs_bf16_same_draft"] == 1.25
    assert rows[3]["speedup"] == pytest.approx(200 / 120) and rows[3]["vs_bf16_same_draft"] is None
    assert rows[4]["tok_s_no_spec"] is None and rows[4]["speedup"] is None  # no baseline at batch 8
    assert rows[5]["speedup"] is None  # a failed measurement derives nothing


def test_draft_lengths_are_compared_with_their_own_length():
    """Two EAGLE3 lengths on one target: each is paired with the bf16 target's row of its own length, both with the
    one `none` baseline; a row written before the column takes its variant's length."""
    from benchmarks.spec_decode import draft_steps

    assert (draft_steps("exl3-EAGLE3"), draft_steps("exl3-EAGLE3-2steps"), draft_steps("exl3-NGRAM")) == (4, 2, None)
    rows = [{**row("exl3", "none", 1, 100.0), "variant": "exl3-none"},
            {**row("exl3", "EAGLE3", 1, 150.0), "variant": "exl3-EAGLE3"},
            {**row("exl3", "EAGLE3", 1, 180.0), "variant": "exl3-EAGLE3-2steps", "draft_steps": 2},
            {**row("bf16", "EAGLE3", 1, 100.0), "variant": "bf16-EAGLE3", "draft_steps": 4},
            {**row("bf16", "EAGLE3", 1, 200.0), "variant": "bf16-EAGLE3-2steps", "draft_steps": 2}]
    derive(rows)
    assert rows[1]["draft_steps"] == 4 and rows[1]["speedup"] == 1.5 and rows[1]["vs_bf16_same_draft"] == 1.5
    assert rows[2]["speedup"] == 1.8 and rows[2]["vs_bf16_same_draft"] == 0.9


def test_chat_ids_use_the_training_chat_form(tmp_path):
    from sglang_exl3.synth.tokenizer import write_tokenizer

    ids = write_tokenizer(tmp_path / "tokenizer", 400)
    got = chat_ids(tmp_path, {"mixed": ["To be, or not to be"]})["mixed"][0]
    assert got[:2] == [ids["bos"], ids["user"]] and got[-1] == ids["assistant"] and len(got) > 4


def test_settle_resplits_a_recorded_comparison_at_the_current_tolerance():
    from benchmarks.spec_checks import settle

    recorded = {"identical": 3, "near_ties": [{"prompt": 0, "position": 1, "margin": 0.01}],
                "failures": [{"prompt": 1, "position": 0, "margin": TOL}, {"prompt": 2, "position": 5, "margin": 0.5}]}
    got = settle(recorded)
    assert [t["prompt"] for t in got["near_ties"]] == [0, 1] and [f["prompt"] for f in got["failures"]] == [2]
    assert settle(got) == got and got["identical"] == 3


@pytest.mark.parametrize("size", [1, 2, 3, 8])
def test_groups_keep_each_targets_baseline_before_its_speculative_variants(size):
    """Every algorithm has an EXL3 and a bf16 row, and in the default order (--only) a target's `none` server is
    timed before any of its speculative ones, whatever --starts groups them into."""
    from benchmarks.spec_decode import VARIANTS, groups, target_of

    order = [name for group in groups(list(VARIANTS), size) for name in group]
    assert order == list(VARIANTS) and all(len(g) <= size for g in groups(list(VARIANTS), size))
    for name, (_, algorithm, _) in VARIANTS.items():
        target = target_of(name)
        assert target in ("exl3", "bf16") and name.startswith(f"{target}-{algorithm}")
        assert f"{'bf16' if target == 'exl3' else 'exl3'}{name.removeprefix(target)}" in VARIANTS
        if algorithm != "none":
            assert order.index(f"{target}-none") < order.index(name)


def test_the_next_server_starts_once_the_last_has_sized_its_pool(tmp_path):
    """wait_sized returns when the server's log says its KV pool is allocated (SGLang's line, logged before its
    graph captures), or when the server has exited, not before."""
    import subprocess
    import sys
    import time

    from benchmarks.spec_decode import Server, wait_sized

    log = tmp_path / "server.log"
    log.write_text("loading\n")
    writes = ("import sys, time; time.sleep(1.5); open(sys.argv[1], 'a').write("
              "'KV Cache is allocated. dtype: torch.bfloat16, #tokens: 262144, K size: 3.00 GB\\n'); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", writes, str(log)])
    try:
        t0 = time.time()
        wait_sized(Server("x", proc, log, "", t0), timeout=30)
        assert 1.4 < time.time() - t0 < 10 and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    log.write_text("loading\n")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    t0 = time.time()
    wait_sized(Server("y", dead, log, "", t0), timeout=30)
    assert time.time() - t0 < 5
