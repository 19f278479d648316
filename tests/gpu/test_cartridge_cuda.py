"""Expert cartridges on the GPU (SGLang's Qwen3-MoE class built on CUDA, our kernels), in both modes: the served
layer output matches the codec's per-stage sum (Triton grouped GEMM, CUDA reconstruct), deactivation restores the base
bit for bit, and a resident slot switched in place is read by a CUDA graph captured before the switch."""

from __future__ import annotations

import pytest
import torch
from test_cartridge_runtime import _reference, _routing, _tensors

from sglang_cpu import load_as_server, sglang_runtime

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from sglang_exl3.synth.cartridge_writer import StageSpec, write_cartridge
    from sglang_exl3.synth.msrt_base_writer import write_msrt_base
    from sglang_exl3.synth.rank_sliced_writer import write_rank_sliced_checkpoint

    root = tmp_path_factory.mktemp("cart-gpu")
    base = write_msrt_base(write_rank_sliced_checkpoint(root / "rs", bits=3, tp=1, seed=7, with_tokenizer=True),
                           root / "base")
    cart = write_cartridge(base, root / "c", [StageSpec("res2", 3, 8.0), StageSpec("res3", 2, 32.0, (1, 3))], seed=2)
    return base, cart


def _apply(experts, x, weights, ids):
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    out = StandardDispatchOutput(hidden_states=x, hidden_states_scale=None,
                                 topk_output=StandardTopKOutput(weights, ids, torch.zeros_like(weights)))
    return experts.quant_method.apply(experts, out).hidden_states


@pytest.mark.parametrize("mode", ["recapture", "resident"])
def test_cartridge_layers_on_cuda(ckpts, monkeypatch, mode):
    from sglang_exl3.layers import cartridge_swap as swap
    from sglang_exl3.layers.cartridge_runtime import CartridgeRuntime

    monkeypatch.setenv("SGLANG_EXL3_BACKEND", "cuda")
    monkeypatch.setenv("SGLANG_EXL3_CARTRIDGES", mode)
    sglang_runtime(device="cuda")
    base, cart = ckpts
    model, _ = load_as_server(base, device="cuda", dtype=torch.bfloat16)
    layers = [(i, layer.mlp.experts) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    x, weights, ids = _routing(6, 3)
    x, weights, ids = x.cuda(), weights.cuda(), ids.cuda()
    before = [_apply(e, x, weights, ids) for _, e in layers]
    graph, static = torch.cuda.CUDAGraph(), None
    if mode == "resident":  # captured before the swap: it must serve the cartridge after it
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            static = [_apply(e, x, weights, ids) for _, e in layers]
    steps = swap.SwapSteps(CartridgeRuntime(model, mode=mode), lambda: None, None)
    swap.stage(steps, str(cart))
    swap.activate(steps)
    base_t, cart_t = _tensors(base), _tensors(cart)
    for n, (i, experts) in enumerate(layers):
        got = _apply(experts, x, weights, ids).float().cpu()
        want = _reference(base_t, cart_t, ("res2", "res3"), i, x.cpu(), weights.cpu(), ids.cpu())
        assert (got - want).norm() / want.norm() < 5e-3, (mode, i)
        if static is not None:
            graph.replay()
            assert torch.equal(static[n], _apply(experts, x, weights, ids)), (mode, i)
    swap.deactivate(steps)
    for (_, experts), b in zip(layers, before, strict=True):
        assert torch.equal(_apply(experts, x, weights, ids), b)
