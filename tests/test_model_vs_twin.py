"""An EXL3 model as SGLang builds it equals its dequantized fp16 twin, module by module: what serving parity compares
end to end, checked one layer at a time so that a failure names the layer and the path.

Both models go through the server's own steps (ModelConfig, quantization config, SGLang's model class and default
loader: `sglang_cpu.load_as_server`); the twin is what `python -m sglang_exl3 dequantize` writes. Every plain
tensor must load identically, every EXL3 linear (fused qkv, o_proj, lm_head, ...) must compute x @ W_twin^T, and
every MoE layer must compute the twin's experts on the same routing. On the CPU the torch backend runs; on a GPU
machine the same test runs our CUDA kernels, and the MoE row counts cover each path the plan picks there (one
source per pair, expert-sorted tiles, the rotated slab). The rank-sliced fixture is written exactly as the GPU step
`tests/gpu/h200_steps.sh parity-rs` writes it, so what the server loads is what is checked here.
"""

from __future__ import annotations

import pytest
import torch
from twin_checks import exl3_linears, exl3_moe_layers, moe_against_twin, plain_tensors_identical, rel

from conftest import DATA
from sglang_cpu import load_as_server, sglang_runtime

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# rows per MoE forward: on the GPU, one source per pair (1, 2), sorted tiles (6, 40) and, from rotated_min_rows
# (74 rows for 4 experts, top-2), the rotated slab; on the CPU every row count runs the same all-experts path
MOE_ROWS = (1, 2, 6, 40, 100, 700) if DEVICE == "cuda" else (1, 6)
REL_TOL = 1e-2  # the twin holds fp16 weights; ours decode and rotate with fp16 roundings of their own


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime(device=DEVICE)


def _rank_sliced(root):
    from sglang_exl3.synth.exl3_writer import ModelDims
    from sglang_exl3.synth.rank_sliced_writer import write_rank_sliced_checkpoint

    return write_rank_sliced_checkpoint(root / "rs", dims=ModelDims(), bits=3, tp=1, rotation_layout="shared_h_v1",
                                        seed=0, with_tokenizer=True)


def _r7(root):
    """R7 routed experts (per-projection K3/K4/K5, shared hidden-side rotations) under a `modelopt` label, as the
    reference's R7 checkpoints carry it; written exactly as the GPU step `parity-r7` writes it."""
    from sglang_exl3.synth.r7_writer import write_r7_checkpoint

    return write_r7_checkpoint(root / "r7", seed=0, with_tokenizer=True, quant_method="modelopt")


def _deepseek_hybrid(root):
    """DeepSeek-V3-shaped (experts of 128, top-2 of 8 in groups, routed scaling) in the reference's hybrid layout:
    rank-sliced EXL3 experts, everything else BF16."""
    from sglang_exl3.synth.hf_models import make_random_hf_model
    from sglang_exl3.synth.rank_sliced_writer import write_hybrid_from_hf

    return write_hybrid_from_hf(make_random_hf_model("deepseek_v3", root / "plain"), root / "hybrid")


CHECKPOINTS = {
    "rank-sliced-shared-h": _rank_sliced,
    "r7-per-projection-k": _r7,
    "deepseek-v3-hybrid": _deepseek_hybrid,
    "tiny-qwen3moe-mul1-4bpw": lambda root: DATA / "exllamav3" / "tiny-qwen3moe-mul1-4bpw",
    "tiny-mixtral-mcg-3bpw": lambda root: DATA / "exllamav3" / "tiny-mixtral-mcg-3bpw",
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def models(request, tmp_path_factory):
    from sglang_exl3.tools.dequantize import dequantize_checkpoint

    root = tmp_path_factory.mktemp(request.param)
    path = CHECKPOINTS[request.param](root)
    dequantize_checkpoint(path, root / "twin", dtype="float16", progress=False)
    dtype = torch.float16 if DEVICE == "cuda" else None  # the server's --dtype float16 (parity's setting)
    exl3, _ = load_as_server(path, DEVICE, dtype)
    twin, cfg = load_as_server(root / "twin", DEVICE, dtype)
    assert cfg is None
    return exl3, twin


def test_plain_tensors_load_identically(models):
    exl3, twin = models
    assert len(plain_tensors_identical(exl3, twin)) >= 5  # embeddings, norms, routers


def test_linear_layers_equal_the_twin(models):
    exl3, twin = models
    gen = torch.Generator().manual_seed(0)
    checked = []
    for name, layer, weight in exl3_linears(exl3, twin):
        x = torch.randn(5, weight.shape[1], generator=gen).to(device=DEVICE, dtype=torch.float16)
        got = layer.quant_method.apply(layer, x).float()
        want = x.float() @ weight.float()[: got.shape[1]].T
        assert torch.isfinite(got).all(), name
        assert rel(got, want) < REL_TOL, (name, rel(got, want))
        checked.append(name)
    hybrid = getattr(getattr(exl3, "quant_config", None), "rank_sliced", None) is not None and not checked
    assert hybrid or ("lm_head" in checked and any("qkv_proj" in n for n in checked))  # a hybrid has no EXL3 linears


@pytest.mark.skipif(DEVICE != "cuda", reason="the one-launch form runs on our CUDA kernels")
def test_one_launch_layers_equal_the_twin(models, monkeypatch):
    """With SGLANG_EXL3_DEV_ONE_LAUNCH_MAX_M set, every EXL3 linear whose shards can share a launch runs decode-sized
    m as one launch (rotations folded into the GEMM), and still computes x @ W_twin^T."""
    from sglang_exl3.kernels.backends import Backend
    from sglang_exl3.layers.linear import apply_shards, attach_shards

    exl3, twin = models
    layers = list(exl3_linears(exl3, twin))
    gen = torch.Generator().manual_seed(0)
    served = []
    monkeypatch.setenv("SGLANG_EXL3_DEV_ONE_LAUNCH_MAX_M", "16")
    try:
        for name, layer, weight in layers:
            attach_shards(layer, layer.exl3_shards, Backend(layer.exl3_backend))
            if layer.exl3_one_launch is None:
                continue
            for m in (1, 5, 16):
                x = torch.randn(m, weight.shape[1], generator=gen).to(device=DEVICE, dtype=torch.bfloat16)
                got = apply_shards(layer, x, None, name).float()
                want = x.float() @ weight.float()[: got.shape[1]].T
                assert torch.isfinite(got).all() and rel(got, want) < REL_TOL, (name, m, rel(got, want))
            served.append(name)
    finally:  # the module-scoped model as it was
        monkeypatch.delenv("SGLANG_EXL3_DEV_ONE_LAUNCH_MAX_M")
        for _, layer, _ in layers:
            attach_shards(layer, layer.exl3_shards, Backend(layer.exl3_backend))
    assert served or not layers


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("m", MOE_ROWS)
def test_moe_layers_equal_the_twin(models, m, dtype):
    """bf16: a model served in bf16 hands its hidden states to the MoE layer as they are (the fused forwards read
    them directly); the reference sees the same bf16 values."""
    exl3, twin = models
    gen = torch.Generator().manual_seed(m)
    layers = list(exl3_moe_layers(exl3, twin))
    assert layers
    for name, experts, theirs in layers:
        got, want = moe_against_twin(experts, theirs, m, dtype, gen, DEVICE)
        assert torch.isfinite(got).all(), (name, m)
        assert rel(got, want) < REL_TOL, (name, m, rel(got, want))
