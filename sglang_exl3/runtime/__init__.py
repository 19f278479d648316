"""Runtime: per-model plans (MoE dispatch by rows m) and their scopes, consulted by the MoE layer. Pure Python,
no SGLang import: it sits below `layers` (docs/architecture.md)."""

from sglang_exl3.runtime.moe_plan import PLANS, MoEPlan, MoEPlanError, build_moe_plan, layer_role

__all__ = ["PLANS", "MoEPlan", "MoEPlanError", "build_moe_plan", "layer_role"]
