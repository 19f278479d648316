"""The speculative-decoding benchmark's bookkeeping (benchmarks/spec_decode.py): the derived columns of its rows, its
chat prompts, the order its servers start in, and when the next one may start."""

from __future__ import annotations

import pytest

from benchmarks.spec_decode import chat_ids, derive


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
