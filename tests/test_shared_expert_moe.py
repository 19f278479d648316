"""DeepSeek/GLM-style MoE (sigmoid routing with a correction bias, routed scaling, a shared expert, a dense first layer;
DeepSeek-V3 with MLA attention and grouped top-k, GLM-4.5 with GQA) in the reference's hybrid layout: routed experts
rank-sliced EXL3, everything else BF16, through SGLang's own model classes and loader (CPU, torch backend)."""

from __future__ import annotations

import pytest
import torch
from moe_reference import twin_moe

from sglang_cpu import load_as_server, sglang_runtime

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime()


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def checkpoints(request, tmp_path_factory):
    """(plain HF bf16, hybrid EXL3, the hybrid dequantized back to bf16): a two-layer model (layer 0 dense, layer 1 with
    8 routed experts of 128, top-2, one shared expert, routed scaling 2.5; synth/hf_models.py)."""
    from sglang_exl3.synth.hf_models import make_random_hf_model
    from sglang_exl3.synth.rank_sliced_writer import write_hybrid_from_hf
    from sglang_exl3.tools.dequantize import dequantize_checkpoint

    root = tmp_path_factory.mktemp(request.param)
    make_random_hf_model(request.param, root / "plain")
    hybrid = write_hybrid_from_hf(root / "plain", root / "hybrid", bits=3, tp=1, rotation_layout="shared_h_v1")
    dequantize_checkpoint(hybrid, root / "twin", dtype="bfloat16", progress=False)
    return root / "plain", hybrid, root / "twin"


def test_shared_expert_fusion_is_declared_off_for_exl3_only(checkpoints):
    """SGLang fuses a DeepSeek-V3/GLM-4.5 shared expert into the routed FusedMoE on CUDA; the plugin's model-override
    provider turns that off at startup for EXL3 checkpoints (and only for them), through SGLang's own collection."""
    from sglang.srt.arg_groups.overrides import collect_model_override_declarations
    from sglang.srt.server_args import ServerArgs
    from transformers import AutoConfig

    from sglang_exl3.integration.hooks import keep_shared_experts_apart

    plain, hybrid, _ = checkpoints

    def ours(path, **kw):
        args = ServerArgs(model_path=str(path), device="cpu", attention_backend="torch_native", **kw)
        hf = AutoConfig.from_pretrained(path)
        declared = collect_model_override_declarations(hf.architectures[0], args, hf)
        return [d for source, d in declared if source == keep_shared_experts_apart.__qualname__]

    assert ours(hybrid) == [{"disable_shared_experts_fusion": True}]
    assert ours(plain) == []
    assert ours(plain, quantization="exl3") == [{"disable_shared_experts_fusion": True}]


def test_hybrid_matches_its_twin(checkpoints):
    """The hybrid through SGLang's model class: routed experts on the EXL3 MoE method (rank-sliced, shared-H), shared
    expert / attention / routers unquantized and identical to the twin's; the MoE block (router, top-k, experts, routed
    scaling applied once, shared expert) equals the same block computed from the twin's weights."""
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput

    _, hybrid, twin_path = checkpoints
    model, cfg = load_as_server(hybrid, dtype=torch.bfloat16)  # the checkpoint's dtype, as a server runs it
    twin, _ = load_as_server(twin_path, dtype=torch.bfloat16)
    assert cfg.rank_sliced is not None
    block, twin_block = model.model.layers[1].mlp, twin.model.layers[1].mlp
    assert type(block.experts.quant_method).__name__ == "Exl3MoEMethod" and block.experts.quant_method.shared_h
    assert type(block.shared_experts.gate_up_proj.quant_method).__name__ == "UnquantizedLinearMethod"
    attn = model.model.layers[1].self_attn
    projection = getattr(attn, "kv_b_proj", None) or attn.qkv_proj  # MLA (DeepSeek) or GQA (GLM)
    assert type(projection.quant_method).__name__ == "UnquantizedLinearMethod"
    assert getattr(block, "num_fused_shared_experts", 0) == 0
    ours = dict(model.named_parameters())
    for name, p in twin.named_parameters():
        if name in ours and ours[name].shape == p.shape and "experts.w" not in name:
            assert torch.equal(ours[name].float(), p.float()), name

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 256, generator=gen) * 0.5).to(torch.bfloat16)
    topk = block.topk(x, block.gate(x))
    weights, ids = topk.topk_weights, topk.topk_ids
    routed = block.experts.quant_method.apply(block.experts, StandardDispatchOutput(
        hidden_states=x, hidden_states_scale=None, topk_output=topk)).hidden_states.float()
    want = twin_moe(twin_block.experts, x, ids, weights)
    assert float((routed - want).norm() / want.norm()) < 2e-2

    got = block(x).float()  # SGLang's own block forward: shared expert + routed_scaling_factor x routed
    shared = block.shared_experts(x).float()
    expected = shared + 2.5 * want
    assert float((got - expected).norm() / expected.norm()) < 2e-2
