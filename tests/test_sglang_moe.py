"""EXL3 experts inside SGLang's FusedMoE (real Qwen3-MoE and Mixtral model classes, CPU, torch backend)."""

from __future__ import annotations

import pytest
import torch

from conftest import DATA
from sglang_cpu import exl3_config, load_model, sglang_runtime
from sglang_exl3.codec import exl3_linear_reference
from sglang_exl3.format import load_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
MOE_CKPTS = [("tiny-qwen3moe-mul1-4bpw", "mlp", ("gate_proj", "up_proj", "down_proj")),
             ("tiny-mixtral-mcg-3bpw", "block_sparse_moe", ("w1", "w3", "w2"))]


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime(str(DATA / "exllamav3" / "tiny-llama-mul1-4bpw"))


def _expert_ref(ckpt, key, x):
    t = ckpt.load_module(key)
    return exl3_linear_reference(x, t["trellis"], t["suh"], t["svh"], ckpt.modules[key].codebook).float()


def _dispatch(x, weights, ids):
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    return StandardDispatchOutput(hidden_states=x, hidden_states_scale=None,
                                  topk_output=StandardTopKOutput(weights, ids, torch.zeros(x.shape[0], 4)))


def _reference_moe(ckpt, i, block, roles, x, weights, ids):
    want = torch.zeros(x.shape[0], 256)
    for m in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[m, k])
            p = f"model.layers.{i}.{block}.experts.{e}"
            xm = x[m : m + 1]
            gate, up = (_expert_ref(ckpt, f"{p}.{r}", xm) for r in roles[:2])
            h = torch.nn.functional.silu(gate) * up
            want[m] += weights[m, k] * _expert_ref(ckpt, f"{p}.{roles[2]}", h.half())[0]
    return want


def _check_layers(name, block, roles, rows=6):
    path = DATA / "exllamav3" / name
    model, cfg = load_model(path)
    # SGLang's loader would swap Mixtral for its per-expert QuantMixtralForCausalLM (dense over all experts, its
    # own fp16 routing) without the plugin's hook; the server must build the FusedMoE class, as for fp16.
    assert type(model).__name__ == load_checkpoint(path).config["architectures"][0]
    ckpt = load_checkpoint(path)
    gen = torch.Generator().manual_seed(rows)
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer, block).experts
        assert type(experts.quant_method).__name__ == "Exl3MoEMethod"
        # routed-expert capture indexes by the TopK's layer id (Mixtral's is set by the plugin's hook)
        assert getattr(layer, block).topk.layer_id == i
        x = torch.randn(rows, 256, generator=gen).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(rows)]).to(torch.int32)
        weights = torch.rand(rows, 2, generator=gen)
        out = experts.quant_method.apply(experts, _dispatch(x, weights, ids)).hidden_states
        want = _reference_moe(ckpt, i, block, roles, x, weights, ids)
        assert out.shape == (rows, 256) and out.dtype == torch.bfloat16
        assert ((out.float() - want).norm() / want.norm()) < 1e-2, (name, i)
    return model, cfg, ckpt


@pytest.mark.parametrize("name, block, roles", MOE_CKPTS, ids=[c[0] for c in MOE_CKPTS])
def test_moe_layers_match_reference(name, block, roles):
    model, cfg, ckpt = _check_layers(name, block, roles)
    assert cfg.claimed == set(ckpt.modules)


@pytest.mark.parametrize("rows, path", [(2, "parity"), (6, "decode"), (9, "prefill")])
def test_every_dispatch_path_matches_reference(monkeypatch, rows, path):
    """MIN_M=4, MAX_M=8, prefill capacity = the scheduler bound: 2 rows take the eager parity path (routed
    experts only), 6 the decode plan, 9 the prefill plan; all must give the same MoE output."""
    monkeypatch.setenv("SGLANG_EXL3_MOE_DECODE_MIN_M", "4")
    monkeypatch.setenv("SGLANG_EXL3_MOE_DECODE_MAX_M", "8")
    name, block, roles = MOE_CKPTS[0]
    model, _, _ = _check_layers(name, block, roles, rows=rows)
    experts = model.model.layers[0].mlp.experts
    assert [seg[0] for seg in experts.exl3_plan.segments(rows, False, "x", "target")] == [path]
    assert experts.exl3_role == "target"


def test_bad_plan_knobs_fail_the_load(monkeypatch):
    from sglang_exl3.runtime import MoEPlanError

    monkeypatch.setenv("SGLANG_EXL3_MOE_DECODE_MIN_M", "20")
    monkeypatch.setenv("SGLANG_EXL3_MOE_PARITY_CHUNK", "16")
    with pytest.raises(MoEPlanError, match="SGLANG_EXL3_MOE_PARITY_CHUNK \\(16\\) cannot cover the EXL3 parity window"):
        load_model(DATA / "exllamav3" / MOE_CKPTS[0][0])


def test_expert_parallel_rank_keeps_only_its_experts():
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.runtime_context import get_parallel

    path = DATA / "exllamav3" / "tiny-qwen3moe-mul1-4bpw"
    _, cfg = exl3_config(path)
    cfg._checked_claims = True  # a lone layer
    ckpt = load_checkpoint(path)
    prefix = "model.layers.0.mlp.experts"
    with get_parallel().override(moe_ep_size=2, moe_ep_rank=1, moe_tp_size=1, moe_tp_rank=0):
        layer = FusedMoE(num_experts=4, top_k=2, hidden_size=256, intermediate_size=256, layer_id=0,
                         quant_config=cfg, prefix=prefix)
        for e in range(4):
            for role, name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                group = "w13" if role != "w2" else "w2"
                for suffix, info in ckpt.modules[f"{prefix}.{e}.{name}"].tensors.items():
                    param = getattr(layer, f"{group}_{suffix}")
                    param.weight_loader(param, ckpt.load_tensor(info.name), f"{group}_{suffix}",
                                        shard_id=role, expert_id=e)
        layer.quant_method.process_weights_after_loading(layer)
    assert layer.num_local_experts == 2
    assert [s["w1"].key for s in layer.exl3_experts] == [f"{prefix}.2.gate_proj", f"{prefix}.3.gate_proj"]


def test_moe_tp_slice_must_be_128_aligned():
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.runtime_context import get_parallel

    from sglang_exl3.layers.tp_slicing import Exl3SliceError

    _, cfg = exl3_config(DATA / "exllamav3" / "tiny-qwen3moe-mul1-4bpw")
    with get_parallel().override(moe_ep_size=1, moe_ep_rank=0, moe_tp_size=4, moe_tp_rank=0):
        with pytest.raises(Exl3SliceError, match=r"intermediate size per rank \(64\).*Use expert parallelism"):
            FusedMoE(num_experts=4, top_k=2, hidden_size=256, intermediate_size=256, layer_id=0,
                     quant_config=cfg, prefix="model.layers.0.mlp.experts")


def test_plan_bound_comes_from_the_published_server_args():
    from sglang.srt.server_args import get_global_server_args

    from sglang_exl3.layers.moe import scheduler_token_bound

    model, cfg = load_model(DATA / "exllamav3" / MOE_CKPTS[0][0])
    args = get_global_server_args()
    bound = scheduler_token_bound(cfg)
    assert model.model.layers[0].mlp.experts.exl3_plan.max_batched == bound
    assert bound >= (args.max_prefill_tokens or 0) and bound >= (args.chunked_prefill_size or 0) > 0 or \
        bound >= (args.context_length or cfg.checkpoint.config["max_position_embeddings"])
    same_scope = [layer.mlp.experts.exl3_plan for layer in model.model.layers]
    assert all(p is same_scope[0] for p in same_scope)  # one plan per model scope and role


@pytest.mark.parametrize("shared_quantized", [True, False], ids=["exl3-shared-expert", "bf16-shared-expert"])
def test_qwen2_moe_shared_expert_exl3_or_unquantized(tmp_path, shared_quantized):
    """Qwen2-MoE: routed experts in FusedMoE, the shared expert as ordinary EXL3 linears (or unquantized)."""
    from sglang_exl3.synth.exl3_writer import ModelDims, write_exl3_checkpoint

    path = write_exl3_checkpoint(tmp_path / "q2moe", "qwen2_moe", dims=ModelDims(num_hidden_layers=1), bits=3,
                                 codebook="mcg", with_tokenizer=False, shared_quantized=shared_quantized)
    model, cfg = load_model(path)
    ckpt = load_checkpoint(path)
    mlp = model.model.layers[0].mlp
    assert type(mlp.experts.quant_method).__name__ == "Exl3MoEMethod"
    method = type(mlp.shared_expert.gate_up_proj.quant_method).__name__
    assert method == ("Exl3LinearMethod" if shared_quantized else "UnquantizedLinearMethod")
    assert cfg.claimed == set(ckpt.modules)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    p = "model.layers.0.mlp.shared_expert"
    if shared_quantized:
        y = mlp.shared_expert.gate_up_proj.quant_method.apply(mlp.shared_expert.gate_up_proj, x)
        want = torch.cat([_expert_ref(ckpt, f"{p}.{s}", x) for s in ("gate_proj", "up_proj")], dim=-1)
    else:
        y, _ = mlp.shared_expert.gate_up_proj(x.to(mlp.shared_expert.gate_up_proj.weight.dtype))
        want = torch.cat([x.float() @ ckpt.load_tensor(f"{p}.{s}.weight").float().T for s in ("gate_proj", "up_proj")],
                         dim=-1)
    assert ((y.float() - want).norm() / want.norm()) < 1e-2
