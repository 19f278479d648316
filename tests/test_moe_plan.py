"""MoE dispatch plans: knob validation when the plan is built, path boundaries, capture guard, scopes."""

from __future__ import annotations

import gc

import pytest

from sglang_exl3.runtime.moe_plan import DECODE, PARITY, PREFILL, MoEPlanError, PlanRegistry, build_moe_plan, layer_role

LAYER = "model.layers.3.mlp.experts"


def plan(max_batched=512, capacity=None, **env):
    return build_moe_plan(max_batched, capacity, {f"SGLANG_EXL3_{k}": str(v) for k, v in env.items()})


def test_defaults_route_by_m():
    p = plan(512)
    assert (p.min_m, p.max_m, p.chunk, p.prefill_capacity) == (1, 32, 128, 512)
    assert p.segments(1, False, LAYER, "target") == [(DECODE, 0, 1)]
    assert p.segments(32, True, LAYER, "target") == [(DECODE, 0, 32)]
    assert p.segments(33, True, LAYER, "target") == [(PREFILL, 0, 33)]
    assert p.segments(512, False, LAYER, "target") == [(PREFILL, 0, 512)]
    assert p.segments(0, False, LAYER, "target") == []


def test_prefill_slices_at_capacity_and_refuses_more_than_planned():
    p = plan(512, capacity=128)
    assert p.segments(200, False, LAYER, "target") == [(PREFILL, 0, 128), (PREFILL, 128, 200)]
    with pytest.raises(ValueError, match=r"exceeds its planned capacity: m=513, capacity=512"):
        p.segments(513, False, LAYER, "target")


def test_parity_below_min_m_is_eager_only():
    p = plan(512, MOE_DECODE_MIN_M=4)
    assert p.segments(3, False, LAYER, "draft") == [(PARITY, 0, 3)]
    with pytest.raises(RuntimeError, match=r"parity path entered during CUDA graph capture \(m=3\).*"
                                           r"model.layers.3.mlp.experts' was classified as draft.*"
                                           r"SGLANG_EXL3_MOE_DECODE_MIN_M \(now 4\)"):
        p.segments(3, True, LAYER, "draft")


def test_prefill_plan_off_restores_single_plan_with_full_parity_staging():
    p = plan(300, MOE_PREFILL_PLAN=0, MOE_PARITY_CHUNK=64)
    assert not p.prefill_plan_enabled and p.parity_rows == 300
    assert p.segments(150, False, LAYER, "target") == [(PARITY, 0, 64), (PARITY, 64, 128), (PARITY, 128, 150)]
    with pytest.raises(RuntimeError, match="SGLANG_EXL3_MOE_PREFILL_PLAN=1"):
        p.segments(150, True, LAYER, "target")
    assert plan(32).parity_rows == 32  # no batch above the decode plan: no prefill plan either


@pytest.mark.parametrize("env, capacity, message", [
    ({"MOE_DECODE_MIN_M": 9, "MOE_DECODE_MAX_M": 8}, None, r"SGLANG_EXL3_MOE_DECODE_MIN_M \(9\) cannot exceed "
                                                            r"SGLANG_EXL3_MOE_DECODE_MAX_M \(8\)"),
    ({"MOE_DECODE_MIN_M": 20, "MOE_PARITY_CHUNK": 16}, None, r"SGLANG_EXL3_MOE_PARITY_CHUNK \(16\) cannot cover "
                                                             r"the EXL3 parity window .* up to 19 rows"),
    ({"TRELLIS_MIN_M": 9, "TRELLIS_MAX_M": 8}, None, r"SGLANG_EXL3_MOE_DECODE_MIN_M \(9\) cannot exceed"),  # aliases
    ({}, 1024, r"prefill capacity 1024 must lie in \[1, 512\]"),
    ({"MOE_DECODE_MAX_M": "x"}, None, "SGLANG_EXL3_MOE_DECODE_MAX_M must be a positive integer"),
    ({"TRELLIS_MAX_M": "x"}, None, "SGLANG_EXL3_TRELLIS_MAX_M must be a positive integer"),  # names what is set
    ({"TRELLIS_MAX_M": 8, "MOE_DECODE_MAX_M": 8}, None, "SGLANG_EXL3_MOE_DECODE_MAX_M and its alias "
                                                        "SGLANG_EXL3_TRELLIS_MAX_M are both set"),
])
def test_inconsistent_knobs_fail_when_the_plan_is_built(env, capacity, message):
    with pytest.raises(ValueError, match=message):
        plan(512, capacity, **env)


def test_the_vllm_spellings_set_the_plan():
    p = plan(512, TRELLIS_MIN_M=2, TRELLIS_MAX_M=16, PREFILL_CHUNK=64, PREFILL_TRELLIS=0)
    assert (p.min_m, p.max_m, p.chunk, p.prefill_plan) == (2, 16, 64, False)


def test_scheduler_bound_is_required():
    for bad in (None, 0, -1):
        with pytest.raises(MoEPlanError, match="never defaulted"):
            build_moe_plan(bad, environ={})


def test_roles():
    assert layer_role("model.layers.0.mlp.experts") == "target"
    for name in ("model.mtp.layers.0.mlp.experts", "model.nextn.mlp.experts", "eagle.layers.0.experts",
                 "draft_model.layers.1.mlp.experts"):
        assert layer_role(name) == "draft", name
    assert layer_role("model.layers.78.mlp.experts", stamped="draft") == "draft"
    assert layer_role("model.mtp.mlp.experts", stamped="target") == "target"


def test_plans_are_owned_per_scope_and_role_and_die_with_the_scope():
    class Owner:
        pass

    registry, built = PlanRegistry(), []

    def build():
        built.append(plan(256))
        return built[-1]

    a, b = Owner(), Owner()
    assert registry.plan_for(a, "target", build) is registry.plan_for(a, "target", build)
    assert registry.plan_for(a, "draft", build) is not registry.plan_for(a, "target", build)
    registry.plan_for(b, "target", build)
    assert len(built) == 3
    ids = registry.scope_id(a), registry.scope_id(b)
    assert ids[0] != ids[1]
    del a
    gc.collect()
    assert len(registry._plans) == 1
    c = Owner()
    assert registry.scope_id(c) not in ids  # never reused
