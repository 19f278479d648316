"""The fused EXL3 decoder layer on the GPU, in SGLang's real Llama layers (exllamav3-made 4 bpw checkpoint, bf16 and
fp16) and Qwen2 layers (the writer's, q/k/v biases): the plan on our kernels against the same steps in torch (its
reference) and against SGLang's unfused forward on our kernels, at the row counts it serves. The attention is the
CPU test's stand-in on both sides (RadixAttention needs a model runner); a served model with the knob on is
`E2E_ARGS="--variant SGLANG_EXL3_FUSED_DECODER=1" ... e2e`."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("sglang.srt.models.llama")

from test_fused_decoder import LLAMA, RowAttention, _qwen2  # noqa: E402

from sglang_cpu import load_as_server, sglang_runtime  # noqa: E402
from sglang_exl3.layers import fused_decoder as fd  # noqa: E402


@pytest.fixture(scope="module", params=[("llama", torch.bfloat16), ("llama", torch.float16), ("qwen2", torch.bfloat16)],
                ids=["llama-bf16", "llama-fp16", "qwen2-bf16"])
def model(request, tmp_path_factory):
    sglang_runtime(str(LLAMA), device="cuda")
    arch, dtype = request.param
    path = LLAMA if arch == "llama" else _qwen2(tmp_path_factory.mktemp("qwen2"))
    model, cfg = load_as_server(path, "cuda", dtype)
    assert cfg is not None
    for layer in model.model.layers:
        layer.self_attn.attn = RowAttention(layer.self_attn)
    return model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _run(layer, forward, plan: tuple, positions, hidden, residual):
    """One forward on copies (the residual is updated in place)."""
    return forward(layer, *plan, positions, hidden.clone(), None, None if residual is None else residual.clone())


@pytest.mark.parametrize("m", [2, 8, 16, 40, 64])
@pytest.mark.parametrize("first", [False, True], ids=["residual", "no-residual"])
def test_fused_layer_matches_its_reference_and_sglangs_forward(model, m, first):
    gen = torch.Generator().manual_seed(m)
    for layer in model.model.layers:
        plan = fd.build_plan(layer)
        assert plan is not None and plan.serves(m) and not plan.serves(1)  # one row: the one-launch linears
        reference = fd.build_plan(layer, reference=True)
        dtype = layer.input_layernorm.weight.dtype
        hidden = torch.randn(m, 256, generator=gen).to(dtype).cuda()
        residual = None if first else (torch.randn(m, 256, generator=gen) * 4).to(dtype).cuda()
        positions = torch.arange(m, device="cuda")

        got_h, got_r = _run(layer, fd.fused_forward, (plan,), positions, hidden, residual)
        ref_h, ref_r = _run(layer, fd.fused_forward, (reference,), positions, hidden, residual)
        unfused_h, unfused_r = _run(layer, type(layer).forward, (), positions, hidden, residual)
        assert torch.isfinite(got_h.float()).all()
        assert _rel(got_r, ref_r) < 5e-3 and _rel(got_h, ref_h) < 5e-3, (_rel(got_r, ref_r), _rel(got_h, ref_h))
        assert _rel(got_r, unfused_r) < 1e-2 and _rel(got_h, unfused_h) < 2e-2, \
            (_rel(got_r, unfused_r), _rel(got_h, unfused_h))


@pytest.mark.parametrize("first", [False, True], ids=["residual", "no-residual"])
def test_one_row_forward_matches_its_reference_and_sglangs_forward(model, first):
    """One row: the one-launch linears with the norms and SiLU-and-mul as prologues, where route sends it."""
    gen = torch.Generator().manual_seed(1)
    for layer in model.model.layers:
        plan = fd.build_plan(layer)
        dtype = layer.input_layernorm.weight.dtype
        hidden = torch.randn(1, 256, generator=gen).to(dtype).cuda()
        residual = None if first else (torch.randn(1, 256, generator=gen) * 4).to(dtype).cuda()
        positions = torch.arange(1, device="cuda")
        assert fd.route(plan, layer, hidden, residual) is fd.one_row_forward
        got_h, got_r = _run(layer, fd.one_row_forward, (plan,), positions, hidden, residual)
        ref_h, ref_r = _run(layer, fd.one_row_forward, (fd.build_plan(layer, reference=True),), positions, hidden,
                            residual)
        unfused_h, unfused_r = _run(layer, type(layer).forward, (), positions, hidden, residual)
        assert torch.isfinite(got_h.float()).all()
        assert _rel(got_r, ref_r) < 5e-3 and _rel(got_h, ref_h) < 5e-3, (_rel(got_r, ref_r), _rel(got_h, ref_h))
        assert _rel(got_r, unfused_r) < 1e-2 and _rel(got_h, unfused_h) < 2e-2, \
            (_rel(got_r, unfused_r), _rel(got_h, unfused_h))
