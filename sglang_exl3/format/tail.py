"""config.json's `hybrid_tr3_tail` of either kind: a rank-sliced checkpoint (`rank_sliced.py`) or the closed
cartridge-base profile `exl3-msrt-base/1` (`msrt_base.py`), which has no `tp` key and rules of its own."""

from __future__ import annotations

from pathlib import Path

from sglang_exl3.format import msrt_base, rank_sliced


def parse_tail(config: dict, model_dir: str | Path | None = None) -> rank_sliced.RankSlicedSpec:
    """The spec of `config["hybrid_tr3_tail"]` (RankSlicedError naming the key on any problem)."""
    meta = config.get("hybrid_tr3_tail")
    if msrt_base.claims(meta):
        return msrt_base.parse(meta)
    return rank_sliced.parse(config, model_dir)
