"""SGLANG_EXL3_CHECK_OUTPUTS: a served path that computes the wrong thing is named in the log (layer, rows, path);
a correct one is logged once as ok. The wrong path is made by corrupting the torch backend's cached W_hat, which
the served forward uses and the check's reference (decoded from the trellis again) does not."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import DATA
from sglang_cpu import load_as_server, sglang_runtime

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CKPT = DATA / "exllamav3" / "tiny-qwen3moe-mul1-4bpw"


def _model():
    """A fresh model: each layer reads the knob at its first forward and keeps it."""
    sglang_runtime(device="cpu")
    exl3, _ = load_as_server(CKPT, "cpu")
    return exl3


def _moe_call(experts, m: int, gen: torch.Generator):
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    n_exp, topk = experts.num_local_experts, experts.quant_method.moe_runner_config.top_k
    x = torch.randn(m, experts.hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(n_exp, generator=gen)[:topk] for _ in range(m)]).to(torch.int32)
    weights = torch.rand(m, topk, generator=gen)
    dispatch = StandardDispatchOutput(hidden_states=x, hidden_states_scale=None,
                                      topk_output=StandardTopKOutput(weights, ids, torch.zeros(m, n_exp)))
    return experts.quant_method.apply(experts, dispatch)


def _records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "EXL3 output check" in r.getMessage()]


def test_check_names_the_wrong_layer_and_passes_the_right_ones(monkeypatch, caplog):
    monkeypatch.setenv("SGLANG_EXL3_CHECK_OUTPUTS", "1")
    model = _model()
    caplog.set_level(logging.INFO, logger="sglang_exl3.layers.output_check")
    gen = torch.Generator().manual_seed(0)
    modules = dict(model.named_modules())
    linears = [n for n, mod in modules.items() if hasattr(mod, "exl3_shards")]
    moes = [n for n, mod in modules.items() if hasattr(mod, "exl3_experts")]
    assert linears and moes

    for name in linears:
        layer = modules[name]
        layer.quant_method.apply(layer, torch.randn(3, layer.exl3_shards[0].in_features, generator=gen))
    _moe_call(modules[moes[0]], 6, gen)
    assert not [r for r in _records(caplog) if "FAILED" in r]
    assert len([r for r in _records(caplog) if " ok " in r]) == len(linears) + 1

    broken = modules[linears[1]]
    shard = broken.exl3_shards[0]
    shard.w_hat = shard.w_hat.clone()
    shard.w_hat[:, :16] *= -1  # 16 output columns of the served weight flipped
    caplog.clear()
    broken.quant_method.apply(broken, torch.randn(4, shard.in_features, generator=gen))
    failed = [r for r in _records(caplog) if "FAILED" in r]
    assert len(failed) == 1 and linears[1] in failed[0] and "rows=4" in failed[0], failed

    experts = modules[moes[0]]
    down = experts.exl3_experts[0]["w2"]
    down.w_hat = down.w_hat * 1.5
    caplog.clear()
    _moe_call(experts, 12, gen)  # 12 rows, top-k of 4 experts: expert 0 is routed
    failed = [r for r in _records(caplog) if "FAILED" in r]
    assert len(failed) == 1 and moes[0] in failed[0] and "path=" in failed[0], failed


def test_check_is_off_by_default(caplog):
    model = _model()
    caplog.set_level(logging.INFO, logger="sglang_exl3.layers.output_check")
    layer = next(mod for mod in model.modules() if hasattr(mod, "exl3_shards"))
    layer.quant_method.apply(layer, torch.randn(2, layer.exl3_shards[0].in_features))
    assert not _records(caplog)
