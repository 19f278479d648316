"""MoE dispatch by rows m: decode plan, prefill plan or the eager parity path (the reference's F12/F14/F15).

Resolved once per model and role (never per batch): the `SGLANG_EXL3_MOE_*` knobs and the scheduler's token
bound give

  decode plan   min_m <= m <= max_m                      (CUDA-graph capturable)
  prefill plan  max_m < m <= capacity, in slices of prefill_capacity   (when MOE_PREFILL_PLAN=1)
  parity        everything else up to parity_rows        (eager only: never recorded in a CUDA graph)

Every inconsistency is an error when the plan is built (startup), naming the variable; a batch above the
planned capacity is an error, never a re-plan. Plans are owned per model scope and role, so a draft model
never shares a target's plan or scratch even when both use one quantization config object.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from sglang_exl3 import knobs

DECODE, PREFILL, PARITY = "decode", "prefill", "parity"
DRAFT_MARKERS = (".mtp", "mtp.", "nextn", "eagle", "draft", "speculator")


class MoEPlanError(ValueError):
    """The MoE dispatch knobs or the scheduler bound cannot make a consistent plan."""


def layer_role(name: str, stamped: str | None = None) -> str:
    """'draft' or 'target': a stamped role wins, else the layer name's speculative-decoding markers."""
    if stamped in ("draft", "target"):
        return stamped
    lowered = name.lower()
    return "draft" if any(marker in lowered for marker in DRAFT_MARKERS) else "target"


@dataclass(frozen=True)
class MoEPlan:
    min_m: int
    max_m: int
    chunk: int  # parity path rows per chunk
    prefill_plan: bool
    max_batched: int  # the most rows one forward can carry (scheduler bound)
    prefill_capacity: int  # rows per prefill-plan launch (<= max_batched)

    @property
    def prefill_plan_enabled(self) -> bool:
        return self.prefill_plan and self.max_batched > self.max_m

    @property
    def parity_rows(self) -> int:
        """Rows the parity path can stage: one chunk when the prefill plan takes the large batches."""
        return min(self.chunk, self.max_batched) if self.prefill_plan_enabled else self.max_batched

    def segments(self, m: int, capturing: bool, layer: str, role: str) -> list[tuple[str, int, int]]:
        """(path, first row, end row) for a batch of m rows."""
        if m <= 0:
            return []
        if self.min_m <= m <= self.max_m:
            return [(DECODE, 0, m)]
        if self.prefill_plan_enabled and m > self.max_m:
            if m > self.max_batched:
                raise ValueError(f"EXL3 MoE {layer}: batch exceeds its planned capacity: m={m}, "
                                 f"capacity={self.max_batched}")
            step = self.prefill_capacity
            return [(PREFILL, s, min(s + step, m)) for s in range(0, m, step)]
        if capturing:
            raise RuntimeError(
                f"EXL3 eager parity path entered during CUDA graph capture (m={m}); capture sizes must lie inside "
                f"the decode plan [{self.min_m}, {self.max_m}] or the prefill plan. Layer '{layer}' was "
                f"classified as {role}. Set SGLANG_EXL3_MOE_DECODE_MIN_M (now {self.min_m}) to 1 or unset it, "
                f"raise SGLANG_EXL3_MOE_DECODE_MAX_M (now {self.max_m}), or keep SGLANG_EXL3_MOE_PREFILL_PLAN=1")
        if m > self.parity_rows:
            raise ValueError(f"EXL3 MoE {layer}: {m} rows exceed the parity path's {self.parity_rows} staged rows")
        return [(PARITY, s, min(s + self.chunk, m)) for s in range(0, m, self.chunk)]


def build_moe_plan(max_batched: int | None, prefill_capacity: int | None = None,
                   environ: dict[str, str] | None = None) -> MoEPlan:
    """Validate the knobs against the scheduler's bound; errors name the variable to change."""
    if not isinstance(max_batched, int) or max_batched <= 0:
        raise MoEPlanError(f"EXL3 MoE plans need the scheduler's largest batch in tokens (got {max_batched!r}); "
                           "it is never defaulted")
    values = {name: knobs.get(name, environ) for name in (
        "MOE_DECODE_MIN_M", "MOE_DECODE_MAX_M", "MOE_PARITY_CHUNK", "MOE_PREFILL_PLAN")}
    capacity = max_batched if prefill_capacity is None else prefill_capacity
    if capacity <= 0 or capacity > max_batched:
        raise MoEPlanError(f"EXL3 MoE prefill capacity {capacity} must lie in [1, {max_batched}] (the scheduler's "
                           "largest batch)")
    plan = MoEPlan(min_m=values["MOE_DECODE_MIN_M"], max_m=values["MOE_DECODE_MAX_M"],
                   chunk=values["MOE_PARITY_CHUNK"], prefill_plan=values["MOE_PREFILL_PLAN"], max_batched=max_batched,
                   prefill_capacity=capacity)
    if plan.min_m > plan.max_m:
        raise MoEPlanError(f"SGLANG_EXL3_MOE_DECODE_MIN_M ({plan.min_m}) cannot exceed SGLANG_EXL3_MOE_DECODE_MAX_M "
                           f"({plan.max_m})")
    window = min(max_batched, plan.min_m - 1)  # rows below the decode plan always take the parity path
    if window > plan.parity_rows:
        raise MoEPlanError(f"SGLANG_EXL3_MOE_PARITY_CHUNK ({plan.chunk}) cannot cover the EXL3 parity window "
                           f"(m < SGLANG_EXL3_MOE_DECODE_MIN_M = {plan.min_m}, up to {window} rows)")
    return plan


class PlanRegistry:
    """One plan per (model scope, role). The scope is the quantization-config object that owns the layers
    (weakly held: a torn-down model's plans go with it); scope ids are assigned once and never reused."""

    def __init__(self) -> None:
        self._plans: weakref.WeakKeyDictionary[object, dict[str, MoEPlan]] = weakref.WeakKeyDictionary()
        self._ids = itertools.count(1)
        self._scope_ids: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()

    def scope_id(self, owner: object) -> int:
        if owner not in self._scope_ids:
            self._scope_ids[owner] = next(self._ids)
        return self._scope_ids[owner]

    def plan_for(self, owner: object, role: str, build: Callable[[], MoEPlan]) -> MoEPlan:
        self.scope_id(owner)
        per_role = self._plans.setdefault(owner, {})
        if role not in per_role:
            per_role[role] = build()
        return per_role[role]


PLANS = PlanRegistry()
