"""Speculative decoding with an EXL3 target, through SGLang's real model classes on the CPU: what the draft takes from
the target at SGLang's hand-over (`get_embed_and_head` -> `set_embed_and_head`), and what is refused at startup."""

from __future__ import annotations

import pytest
import torch

from conftest import DATA, mutate
from sglang_cpu import bf16_twin, draft_hand_over, exl3_config, load_as_server, sglang_runtime

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
LLAMA = DATA / "exllamav3" / "tiny-llama-mul1-4bpw"  # its lm_head is EXL3


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime(str(LLAMA))


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory):
    return bf16_twin(LLAMA, tmp_path_factory.mktemp("draft") / "llama")


def _hand_over(target, draft):
    draft_hand_over(target, draft, with_head=True)  # EAGLE / NEXTN: embedding and lm_head


@pytest.mark.parametrize("embed_bits", [None, 8])
def test_the_draft_uses_the_target_exl3_head(monkeypatch, draft_path, embed_bits):
    """The EXL3 head hands over a stub (no AttributeError as before), and the draft ends up computing its logits
    with the target's EXL3 head module, its embedding with the target's table (BF16 or encoded)."""
    from sglang.srt.layers.logits_processor import LogitsProcessor

    if embed_bits:
        monkeypatch.setenv("SGLANG_EXL3_EMBED_ONLINE_BITS", str(embed_bits))
    target, _ = load_as_server(LLAMA, dtype=torch.bfloat16)
    draft, cfg = load_as_server(draft_path, dtype=torch.bfloat16)
    assert cfg is None and target.lm_head.weight.shape == (0, target.lm_head.embedding_dim)
    _hand_over(target, draft)
    assert draft.lm_head is target.lm_head
    hidden = torch.randn(3, target.lm_head.embedding_dim, generator=torch.Generator().manual_seed(0)).bfloat16()
    processor = LogitsProcessor(target.config)
    want = processor._compute_lm_head(hidden, target.lm_head)
    assert torch.equal(processor._compute_lm_head(hidden, draft.lm_head), want)
    assert want.shape[-1] >= target.config.vocab_size and torch.isfinite(want.float()).all()
    ids = torch.tensor([4, 1000, 77])
    assert torch.equal(draft.model.embed_tokens(ids), target.model.embed_tokens(ids))


def test_a_token_map_is_refused_with_an_exl3_head(tmp_path):
    from sglang.srt.server_args import get_global_server_args

    args = get_global_server_args()
    before = args.speculative_token_map
    args.override("test", speculative_token_map=str(tmp_path / "hot.pt"))  # the published args are read-only
    try:
        with pytest.raises(ValueError, match="--speculative-token-map .*lm_head is EXL3 .*drop the token map"):
            load_as_server(LLAMA)
    finally:
        args.override("test", speculative_token_map=before)
    exl3_config(LLAMA)  # without the map the same checkpoint loads


def _with_copied_modules(out, copies: dict[str, str]):
    """The tiny writer's Llama with extra EXL3 modules (new key -> copy of an existing module), listed in the
    sidecar: MTP / next-token layers as checkpoints carry them."""
    import copy

    from sglang_exl3.synth.exl3_writer import write_exl3_checkpoint

    def add(tensors, sidecar, config):
        for new, src in copies.items():
            tensors.update({new + n[len(src):]: t.clone() for n, t in list(tensors.items())
                            if n.startswith(src + ".")})
            entry = copy.deepcopy(sidecar["tensor_storage"][src])
            entry["stored_tensors"] = {new + k[len(src):]: v for k, v in entry.get("stored_tensors", {}).items()}
            sidecar["tensor_storage"][new] = entry

    return mutate(write_exl3_checkpoint(out, "llama", seed=1), add)


@pytest.mark.parametrize("mtp_key", ["mtp.layers.0.mlp.down_proj", "model.layers.2.mlp.down_proj"],
                         ids=["qwen3.5-mtp", "nextn-layer"])
def test_mtp_layers_are_skipped_without_speculation(tmp_path, caplog, mtp_key):
    """seeds.md F25: a checkpoint's EXL3 MTP layer (Qwen3.5's `mtp.layers.0.*`, or DeepSeek / GLM's
    `model.layers.{num_hidden_layers}.*`) is not built without speculative decoding; the load goes on and says so,
    instead of stopping on modules no layer claims (which it did for `mtp.layers.0`: layer 0 is built)."""
    import logging

    path = _with_copied_modules(tmp_path / "ckpt", {mtp_key: "model.layers.1.mlp.down_proj"})
    with caplog.at_level(logging.INFO, logger="sglang_exl3.layers.exl3_config"):
        model, cfg = load_as_server(path)
    assert mtp_key not in cfg.claimed and "model.layers.1.mlp.down_proj" in cfg.claimed
    assert mtp_key.rsplit(".", 2)[0] in caplog.text and "not built by this model" in caplog.text


def test_a_module_of_a_built_layer_that_nothing_claims_still_stops_the_load(tmp_path):
    path = _with_copied_modules(tmp_path / "ckpt", {"model.layers.1.mlp.extra_proj": "model.layers.1.mlp.down_proj"})
    with pytest.raises(ValueError, match=r"have no EXL3 layer .*model.layers.1.mlp.extra_proj"):
        load_as_server(path)


def test_a_draft_head_of_another_vocabulary_cannot_share(monkeypatch):
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    target, _ = load_as_server(LLAMA, dtype=torch.bfloat16)
    draft = torch.nn.Module()
    draft.lm_head = ParallelLMHead(512, target.lm_head.embedding_dim)
    draft.set_embed_and_head = lambda embed, head: setattr(draft.lm_head, "weight", head)
    with pytest.raises(ValueError, match="draft lm_head is 512 x 256 per rank, the target's EXL3 lm_head 1024 x 256"):
        draft_hand_over(target, draft, with_head=True)


def test_an_exl3_standalone_draft_beside_a_bf16_target_loads_as_exl3(draft_path):
    """STANDALONE on the bf16 twin with the EXL3 draft (the spec benchmark's bf16-STANDALONE): the target starts
    without --quantization, so the draft worker's ModelConfig gets none either, and the draft's own config must still
    select EXL3, its lm_head included; the plain target stays plain after it."""
    from sglang_exl3.layers.exl3_config import Exl3Config

    target, cfg = load_as_server(draft_path, dtype=torch.bfloat16)
    assert cfg is None and target.lm_head.weight.numel() > 0
    draft, cfg = load_as_server(LLAMA, dtype=torch.bfloat16, draft=True)
    assert isinstance(cfg, Exl3Config)
    assert draft.lm_head.weight.shape == (0, draft.lm_head.embedding_dim)  # the EXL3 head, not a bf16 table
    gate_up = draft.model.layers[0].mlp.gate_up_proj
    assert type(gate_up.quant_method).__name__ == "Exl3LinearMethod"
