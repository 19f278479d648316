"""The fused EXL3 decoder layer (SGLANG_EXL3_FUSED_DECODER) on SGLang's real Llama classes, on the CPU: its torch
reference (the same steps and roundings as the fused kernels) against SGLang's own forward of the same layer, what
keeps a layer unfused, and when a call takes the fused path. The kernels themselves are compared against this
reference on the GPU (tests/gpu/test_fused_layer_cuda.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from conftest import DATA
from sglang_cpu import load_as_server, sglang_runtime
from sglang_exl3.layers import fused_decoder as fd

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LLAMA = DATA / "exllamav3" / "tiny-llama-mul1-4bpw"


def _qwen2(root: Path) -> Path:
    """A Qwen2 written by the fixture writer: q/k/v with biases."""
    from sglang_exl3.synth.exl3_writer import ModelDims, write_exl3_checkpoint

    return write_exl3_checkpoint(root / "qwen2", "qwen2", dims=ModelDims(), bits=4, codebook="mul1",
                                 with_tokenizer=False)


@pytest.fixture(scope="module", params=[("llama", torch.bfloat16), ("llama", torch.float16), ("qwen2", torch.bfloat16)],
                ids=["llama-bf16", "llama-fp16", "qwen2-bf16"])
def model(request, tmp_path_factory):
    sglang_runtime(str(LLAMA))
    arch, dtype = request.param
    path = LLAMA if arch == "llama" else _qwen2(tmp_path_factory.mktemp("qwen2"))
    model, cfg = load_as_server(path, dtype=dtype)
    assert cfg is not None
    assert (model.model.layers[0].self_attn.qkv_proj.bias is not None) == (arch == "qwen2")
    for layer in model.model.layers:
        layer.self_attn.attn = RowAttention(layer.self_attn)
    return model


class RowAttention(torch.nn.Module):
    """Causal attention over the call's rows as one sequence, standing in for RadixAttention, which needs a model
    runner's KV pools (the GPU test serves the real one). Both forwards compared here call the same module."""

    def __init__(self, attn):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim

    def forward(self, q, k, v, forward_batch):
        m, dtype = q.shape[0], q.dtype
        q = q.reshape(m, self.heads, self.head_dim).transpose(0, 1).float()
        k = k.reshape(m, self.kv_heads, self.head_dim).transpose(0, 1).float()
        v = v.reshape(m, self.kv_heads, self.head_dim).transpose(0, 1).float()
        rep = self.heads // self.kv_heads
        out = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0),
                                                               v.repeat_interleave(rep, 0), is_causal=True)
        return out.transpose(0, 1).reshape(m, -1).to(dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _sglang_forward(layer, rows: int, first: bool, gen: torch.Generator):
    """Fresh rows of the layer's dtype (no residual for the first layer), their positions, and SGLang's own forward
    of them (on copies)."""
    dtype = layer.input_layernorm.weight.dtype
    hidden = torch.randn(rows, 256, generator=gen).to(dtype)
    residual = None if first else torch.randn(rows, 256, generator=gen).to(dtype)
    positions = torch.arange(rows)
    want = type(layer).forward(layer, positions, hidden.clone(), None, None if first else residual.clone())
    return hidden, residual, positions, want


@pytest.mark.parametrize("first", [True, False], ids=["no-residual", "residual"])
@pytest.mark.parametrize("rows", [1, 7])
def test_reference_plan_equals_sglangs_forward(model, first, rows):
    """The fused steps (reference ops) give SGLang's LlamaDecoderLayer.forward: output and residual, including the
    first layer's (no residual in: hidden_states becomes it) and the residual updated in place."""
    gen = torch.Generator().manual_seed(rows)
    for layer in model.model.layers:
        plan = fd.build_plan(layer, reference=True)
        assert plan is not None and plan.serves(rows)
        hidden, residual, positions, (want_h, want_r) = _sglang_forward(layer, rows, first, gen)
        got_in = hidden.clone()
        got_res = None if first else residual.clone()
        got_h, got_r = fd.fused_forward(layer, plan, positions, got_in, None, got_res)
        assert got_r is (got_in if first else got_res)  # updated in place, as fused_add_rmsnorm does
        assert _rel(got_r, want_r) < 1e-2 and _rel(got_h, want_h) < 2e-2, (_rel(got_r, want_r), _rel(got_h, want_h))


@pytest.mark.parametrize("first", [True, False], ids=["no-residual", "residual"])
@pytest.mark.parametrize("rows", [1, 3])
def test_one_row_reference_equals_sglangs_forward(model, first, rows):
    """The one-row steps (the norms and SiLU-and-mul folded into the linears, reference ops) give SGLang's forward;
    the new residual is a new tensor, the old one untouched."""
    gen = torch.Generator().manual_seed(10 + rows)
    for layer in model.model.layers:
        plan = fd.build_plan(layer, reference=True)
        hidden, residual, positions, (want_h, want_r) = _sglang_forward(layer, rows, first, gen)
        got_in, got_res = hidden.clone(), None if first else residual.clone()
        got_h, got_r = fd.one_row_forward(layer, plan, positions, got_in, None, got_res)
        assert torch.equal(got_in, hidden) and (first or torch.equal(got_res, residual))
        assert _rel(got_r, want_r) < 1e-2 and _rel(got_h, want_h) < 2e-2, (_rel(got_r, want_r), _rel(got_h, want_h))


def test_blockers_name_what_keeps_a_layer_unfused(model, monkeypatch):
    layer = model.model.layers[0]
    assert fd.fusion_blockers(layer, need_kernels=False) == []
    on_cpu = fd.fusion_blockers(layer)
    assert len(on_cpu) == 4 and all("does not run on our CUDA kernels" in b for b in on_cpu)
    assert fd.build_plan(layer) is None
    monkeypatch.setenv("SGLANG_EXL3_CHECK_OUTPUTS", "1")
    assert any("CHECK_OUTPUTS" in b for b in fd.fusion_blockers(layer, need_kernels=False))
    monkeypatch.delenv("SGLANG_EXL3_CHECK_OUTPUTS")
    changed = copy.deepcopy(layer)  # a shallow copy would share its submodules and parameters with the model's
    changed.mlp.down_proj.tp_size = 2
    changed.mlp.down_proj.exl3_shards = changed.mlp.down_proj.exl3_shards * 2
    assert fd.fusion_blockers(changed, need_kernels=False) == [
        "mlp.down_proj is tensor-parallel (o / down's all-reduce sits between the GEMM and the norm)",
        "mlp.down_proj: 2 sources that cannot share launches (want 1)"]
    changed.post_attention_layernorm.weight = torch.nn.Parameter(layer.post_attention_layernorm.weight.float())
    assert "post_attention_layernorm is not a plain fp16 / bf16 RMSNorm" in fd.fusion_blockers(changed,
                                                                                                need_kernels=False)
    assert fd.fusion_blockers(torch.nn.Linear(2, 2)) == [
        "Linear is not SGLang's Llama or Qwen2 decoder layer with its own attention and MLP"]


def test_a_call_takes_the_fused_path_only_where_the_plan_serves_it(model):
    from sglang_exl3.integration.hooks import fused_decoder_forward

    layer = model.model.layers[1]
    plan = fd.build_plan(layer, reference=True)
    dtype = layer.input_layernorm.weight.dtype
    h = torch.randn(3, 256).to(dtype)
    assert fd.route(plan, layer, h, h.clone()) is fd.fused_forward  # no one-launch forms on the CPU
    assert fd.route(None, layer, h, None) is None
    assert fd.route(plan, layer, h.float(), None) is None  # rows of another dtype than the norms': SGLang's forward
    assert fd.route(plan, layer, torch.randn(256, 3).to(dtype).t(), None) is None  # not contiguous
    assert fd.route(plan, layer, h, h[:2].clone()) is None  # residual of another shape
    calls = []

    def original(self, *args):
        calls.append(args)
        return "sglang"

    layer.exl3_fused = plan
    try:
        out, residual = fused_decoder_forward(original, layer, torch.arange(3), h.clone(), None, h.clone())
        assert not calls and out.shape == h.shape and residual.shape == h.shape
        layer.mlp.gate_up_proj.exl3_shards = [copy.copy(s) for s in plan.gate_up.shards]  # a reload's new shards
        assert fused_decoder_forward(original, layer, torch.arange(3), h, None, None) == "sglang" and len(calls) == 1
    finally:
        layer.mlp.gate_up_proj.exl3_shards = list(plan.gate_up.shards)
        del layer.exl3_fused


def test_route_takes_the_one_row_form_where_every_one_launch_form_serves(model, monkeypatch):
    """One-launch forms (their real class over an empty table: only their row policy is read) on all four
    projections send the rows they serve to one_row_forward, and more rows to the group form; where only some
    projections have one, those rows run SGLang's own forward (each linear in its own form)."""
    from sglang_exl3.kernels.cuda_trellis import Exl3Group, Exl3OneLaunch

    layer = model.model.layers[0]
    plan = fd.build_plan(layer, reference=True)
    group = Exl3Group(table=torch.zeros(1, 8, dtype=torch.int64), num=1, k_tiles=16, total_items=8, total_cols=256,
                      partial_per_row=256, k2=8, codebook=1, max_slice=8)
    one = Exl3OneLaunch(group, torch.zeros(2, dtype=torch.int32), max_m=2)
    for p in plan.projections:
        monkeypatch.setattr(p.module, "exl3_one_launch", one, raising=False)
    dtype = layer.input_layernorm.weight.dtype
    rows = {m: torch.randn(m, 256).to(dtype) for m in (1, 2, 3)}
    assert [fd.route(plan, layer, h, None) for h in rows.values()] == [fd.one_row_forward] * 2 + [fd.fused_forward]
    monkeypatch.setattr(plan.down.module, "exl3_one_launch", None)
    assert fd.route(plan, layer, rows[1], None) is None


def test_the_knob_registers_the_hooks(monkeypatch):
    """The fused layer's two hooks are registered only with SGLANG_EXL3_FUSED_DECODER on (SGLang's registry, restored
    afterwards)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_exl3.integration import hooks

    targets = [f"sglang.srt.models.{c.__module__.rsplit('.', 1)[1]}.{c.__name__}.forward" for c in fd.layer_classes()]
    saved = {k: list(v) for k, v in HookRegistry._hooks.items()}
    try:
        for on in (False, True):
            HookRegistry._hooks.clear()
            monkeypatch.setenv("SGLANG_EXL3_FUSED_DECODER", "1" if on else "0")
            hooks.register_hooks()
            for target in targets:
                forward = [hook for _, hook, _ in HookRegistry._hooks.get(target, [])]
                assert forward == ([hooks.fused_decoder_forward] if on else []), target
            loader = [hook for _, hook, _ in HookRegistry._hooks[
                "sglang.srt.model_loader.loader.DefaultModelLoader.load_weights_and_postprocess"]]
            assert (hooks.fused_decoder_plans in loader) == on
    finally:
        HookRegistry._hooks.clear()
        HookRegistry._hooks.update(saved)
