"""`python -m sglang_exl3 encode`: a BF16 Hugging Face checkpoint rewritten as EXL3 in exllamav3's layout. The
selected linear is encoded, everything else copied; the result passes the project's validation and loads through
SGLang's own model class, where the encoded linear computes the BF16 weight's product within the 4-bit trellis
distortion. (One 128x128 module: the encoder needs ~6 s for it on the CPU.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from sglang_cpu import load_as_server, sglang_runtime, small_bf16_llama
from sglang_exl3.cli.main import main
from sglang_exl3.format import load_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
KEY = "model.layers.0.self_attn.o_proj"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return small_bf16_llama(tmp_path_factory.mktemp("enc") / "bf16", seed=2)


def test_encode_writes_a_checkpoint_that_serves(source, tmp_path, capsys):
    out = tmp_path / "exl3"
    assert main(["encode", str(source), str(out), "--bits", "4", "--modules", "o_proj$", "--quiet"]) == 0
    assert "1 linears encoded at 4 bits (mcg)" in capsys.readouterr().out
    ckpt = load_checkpoint(out)  # validated in full
    assert [k for k, r in ckpt.modules.items()] == [KEY] and ckpt.modules[KEY].bits == 4
    sidecar = json.loads((out / "quantization_config.json").read_text())
    assert sidecar["tensor_storage"]["model.layers.0.mlp.down_proj"].get("quant_format") is None
    original = load_file(str(source / "model.safetensors"))
    copied = load_file(str(out / "model.safetensors"))
    assert torch.equal(copied["model.layers.0.mlp.down_proj.weight"], original["model.layers.0.mlp.down_proj.weight"])

    sglang_runtime()
    model, _ = load_as_server(out)
    layer = model.model.layers[0].self_attn.o_proj
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = layer.quant_method.apply(layer, x).float()
    want = x.float() @ original[f"{KEY}.weight"].float().t()
    assert float((got - want).norm() / want.norm()) < 0.09


def test_encode_refuses_what_it_cannot_do(source, tmp_path, capsys):
    assert main(["encode", str(source), str(tmp_path / "a"), "--modules", "nothing_matches", "--quiet"]) == 1
    assert "matches no linear" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    assert main(["encode", str(source), str(busy), "--quiet"]) == 1
    assert "is not empty" in capsys.readouterr().err
