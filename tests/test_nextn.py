"""A DeepSeek-V3 / GLM-4.5 NextN (MTP) layer stored in an EXL3 hybrid checkpoint, loaded by SGLang's own draft
classes (`DeepseekV3ForCausalLMNextN`, `Glm4MoeForCausalLMNextN`: what `--speculative-algorithm NEXTN` builds) under
`--quantization exl3`: its routed experts are the checkpoint's EXL3 experts of layer N, bit for bit the ones a model
with one more layer loads; the target skips the layer; a checkpoint without it, or with the draft's plain parts
quantized, is refused naming them."""

from __future__ import annotations

import pytest
import torch

from sglang_cpu import expert_tensors, load_as_server, sglang_runtime
from sglang_exl3.layers.nextn import NextNError, check_stored, checkpoint_prefix, nextn_layer

DRAFTS = {"deepseek_v3": ("DeepseekV3ForCausalLMNextN", "DeepseekV3ForCausalLM"),
          "glm4_moe": ("Glm4MoeForCausalLMNextN", "Glm4MoeForCausalLM")}


@pytest.fixture(scope="module", params=list(DRAFTS))
def checkpoints(request, tmp_path_factory):
    """(the hybrid with three layers, the same with layer 2 turned into the NextN layer, the architecture)."""
    from sglang_exl3.synth.hf_models import make_random_hf_model
    from sglang_exl3.synth.nextn_writer import write_nextn_from_last_layer
    from sglang_exl3.synth.rank_sliced_writer import write_hybrid_from_hf

    root = tmp_path_factory.mktemp("nextn")
    full = write_hybrid_from_hf(make_random_hf_model(request.param, root / "plain", num_hidden_layers=3),
                                root / "full")
    return full, write_nextn_from_last_layer(full, root / "mtp"), request.param


def test_the_draft_loads_the_checkpoint_layer_as_exl3(checkpoints):
    full, mtp, arch = checkpoints
    sglang_runtime()
    draft, cfg = load_as_server(mtp, draft=True)
    assert type(draft).__name__ == DRAFTS[arch][0] and cfg.nextn_layer == 2
    experts = draft.model.decoder.mlp.experts
    assert type(experts.quant_method).__name__ == "Exl3MoEMethod"
    oracle, _ = load_as_server(full)  # builds layer 2 as an ordinary layer from the same tensors
    got, want = expert_tensors(experts), expert_tensors(oracle.model.layers[2].mlp.experts)
    assert got.keys() == want.keys() and any(k[2] == "trellis" for k in got)
    for key, value in got.items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=0, msg=str(key))
    other = expert_tensors(oracle.model.layers[1].mlp.experts)
    assert not all(torch.equal(v, other[k]) for k, v in got.items() if k[2] == "trellis")  # not any EXL3 layer
    plain_want = dict(oracle.model.layers[2].named_parameters())
    for name in ("self_attn.o_proj.weight", "mlp.shared_experts.down_proj.weight"):
        torch.testing.assert_close(dict(draft.model.decoder.named_parameters())[name], plain_want[name], rtol=0,
                                   atol=0, msg=name)


def test_the_target_skips_the_mtp_layer(checkpoints):
    _, mtp, arch = checkpoints
    sglang_runtime()
    target, cfg = load_as_server(mtp)
    assert type(target).__name__ == DRAFTS[arch][1] and cfg.nextn_layer is None
    assert len(target.model.layers) == 2


def test_nextn_without_the_mtp_layer_names_the_missing_tensors(checkpoints, tmp_path):
    import shutil

    full, _, _ = checkpoints
    shutil.copytree(full, tmp_path / "no-mtp")  # three layers, none of them past num_hidden_layers
    sglang_runtime()
    with pytest.raises(NextNError, match=r"model\.layers\.3\.\*.*missing: model\.layers\.3\.eh_proj\.weight"):
        load_as_server(tmp_path / "no-mtp", draft=True)


def test_norms_stored_as_exl3_are_refused():
    names = {"model.layers.2.enorm.trellis": None, "model.layers.2.mlp.down_proj.trellis": None}
    with pytest.raises(NextNError, match=r"\['model\.layers\.2\.enorm'\].*--mtp_bits 16"):
        check_stored(names, {"model.layers.2.enorm": None, "model.layers.2.mlp.down_proj": None}, 2, "ck", "X")
    # EXL3 attention / MLP, and an EXL3 eh_proj (served by an EXL3 layer in the module's nn.Linear's place), are fine
    check_stored(names, {"model.layers.2.eh_proj": None, "model.layers.2.mlp.down_proj": None}, 2, "ck", "X")


def test_an_exl3_eh_proj_is_served(checkpoints, tmp_path):
    """exllamav3 quantizes eh_proj at --mtp_bits (GLM-4.7-Flash): the draft gets an EXL3 layer where its NextN module
    builds an nn.Linear, called as the module calls it (DeepSeek's forward unpacks a ReplicatedLinear's tuple), and
    computes the checkpoint's matrix."""
    import shutil

    from safetensors.torch import load_file, save_file

    from sglang_exl3.codec import exl3_linear_reference
    from sglang_exl3.format import Codebook
    from sglang_exl3.layers.plain_linear import Exl3PlainLinear
    from sglang_exl3.synth.exl3_writer import random_exl3_linear

    _, mtp, arch = checkpoints
    shutil.copytree(mtp, tmp_path / "c")
    shard = tmp_path / "c" / "model.safetensors"
    tensors = load_file(str(shard))
    n, k = tensors.pop("model.layers.2.eh_proj.weight").shape
    parts = random_exl3_linear(k, n, 4, Codebook.MUL1, torch.Generator().manual_seed(1))
    tensors.update({f"model.layers.2.eh_proj.{s}": t for s, t in parts.items()})
    save_file(tensors, str(shard), metadata={"format": "pt"})
    sglang_runtime()
    draft, _ = load_as_server(tmp_path / "c", draft=True)
    eh_proj = draft.model.eh_proj
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2)).half()
    if arch == "deepseek_v3":
        assert type(eh_proj).__name__ == "ReplicatedLinear"
        got = eh_proj(x)[0]
    else:
        assert isinstance(eh_proj, Exl3PlainLinear)
        got = eh_proj(x)
    want = exl3_linear_reference(x, parts["trellis"], parts["suh"], parts["svh"], Codebook.MUL1)
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 2e-3


@pytest.mark.parametrize(("prefix", "want"), [("model.decoder.mlp.experts", "model.layers.4.mlp.experts"),
                                              ("model.decoder", "model.layers.4"),
                                              ("model.embed_tokens", "model.embed_tokens"),
                                              ("model.shared_head.head", "model.shared_head.head")])
def test_checkpoint_prefix(prefix, want):
    assert checkpoint_prefix(prefix, 4) == want and checkpoint_prefix(prefix, None) == prefix


def test_nextn_layer_follows_sglangs_loader():
    from types import SimpleNamespace

    def cfg(arch, layers):
        return SimpleNamespace(architectures=[arch], num_hidden_layers=layers)

    assert nextn_layer(cfg("DeepseekV3ForCausalLMNextN", 61)) == 61
    assert nextn_layer(cfg("Glm4MoeForCausalLMNextN", 1)) == 0  # a checkpoint of the NextN layer alone
    assert nextn_layer(cfg("DeepseekV3ForCausalLM", 61)) is None
