"""An EXL3 model as SGLang builds it against its dequantized twin loaded the same way: the layers to compare and
what each computes on the same inputs (tests/test_model_vs_twin.py, tests/test_qwen3_5.py)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from moe_reference import twin_moe


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def plain_tensors_identical(model, twin, skip: tuple[str, ...] = ()) -> list[str]:
    """Every parameter both hold with the same non-empty shape (the plain layers) is equal in fp16, the twin's dtype;
    returns their names."""
    ours = dict(model.named_parameters())
    compared = []
    for name, p in twin.named_parameters():
        if name in ours and name not in skip and ours[name].shape == p.shape and ours[name].numel():
            assert torch.equal(ours[name].half(), p.half()), name
            compared.append(name)
    return compared


def exl3_linears(model, twin) -> Iterator[tuple[str, torch.nn.Module, torch.Tensor]]:
    """(name, EXL3 linear, the twin's weight of that layer) for every EXL3 linear of the model."""
    theirs = dict(twin.named_modules())
    for name, layer in model.named_modules():
        if hasattr(layer, "exl3_shards"):
            yield name, layer, theirs[name].weight


def exl3_moe_layers(model, twin) -> Iterator[tuple[str, torch.nn.Module, torch.nn.Module]]:
    """(name, EXL3 MoE layer, the twin's FusedMoE) for every EXL3 MoE layer of the model."""
    theirs = dict(twin.named_modules())
    for name, experts in model.named_modules():
        if type(getattr(experts, "quant_method", None)).__name__ == "Exl3MoEMethod":
            yield name, experts, theirs[name]


def moe_against_twin(experts, twin_experts, m: int, dtype: torch.dtype, gen: torch.Generator,
                     device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the layer's output, the twin's) for m random rows on the same random routing."""
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    cfg = experts.quant_method.moe_runner_config
    n_exp, topk = experts.num_local_experts, cfg.top_k
    x = torch.randn(m, experts.hidden_size, generator=gen).to(device=device, dtype=dtype)
    ids = torch.stack([torch.randperm(n_exp, generator=gen)[:topk] for _ in range(m)]).to(device, torch.int32)
    weights = torch.rand(m, topk, generator=gen).to(device)
    dispatch = StandardDispatchOutput(hidden_states=x, hidden_states_scale=None,
                                      topk_output=StandardTopKOutput(weights, ids, torch.zeros(m, n_exp)))
    got = experts.quant_method.apply(experts, dispatch).hidden_states.float()
    want = twin_moe(twin_experts, x, ids, weights, cfg.activation == "gelu")
    if cfg.routed_scaling_factor is not None and device == "cuda":  # as SGLang's runner there (moe.py apply)
        want = want * cfg.routed_scaling_factor
    return got, want
