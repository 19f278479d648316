"""`SGLANG_EXL3_EMBED_ONLINE_BITS` through SGLang's real classes on the CPU: which layers take the int8 / int6 table,
that the model's embedding equals the codec's on the checkpoint's own table, vocab-parallel sharding, EAGLE / MTP
drafts sharing the encoded table, and the setups that are refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import DATA
from sglang_cpu import bf16_twin, draft_hand_over, exl3_config, load_as_server, sglang_runtime
from sglang_exl3.codec import embedding as codec
from sglang_exl3.format import load_checkpoint
from sglang_exl3.knobs import KnobError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
LLAMA = DATA / "exllamav3" / "tiny-llama-mul1-4bpw"
MIXTRAL = DATA / "exllamav3" / "tiny-mixtral-mcg-3bpw"


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime(str(LLAMA))


def _embed_and_head(model):
    return model.model.embed_tokens, getattr(model, "lm_head", None)


@pytest.mark.parametrize("bits", [8, 6])
@pytest.mark.parametrize("path", [LLAMA, MIXTRAL], ids=["llama", "mixtral"])
def test_the_model_embeds_from_the_encoded_table(monkeypatch, path, bits):
    """Llama passes its config to the embedding, Mixtral does not (the plugin's hook hands it over); either way the
    table is encoded at load, the BF16 rows are gone, and the lookup is the codec's on the checkpoint's table.
    The lm_head (a ParallelLMHead) keeps its EXL3 method."""
    from sglang_exl3.layers.embedding import Exl3EmbeddingMethod
    from sglang_exl3.layers.linear import Exl3LinearMethod

    monkeypatch.setenv("SGLANG_EXL3_EMBED_ONLINE_BITS", str(bits))
    model, _ = load_as_server(path, dtype=torch.bfloat16)
    embed, head = _embed_and_head(model)
    assert isinstance(embed.quant_method, Exl3EmbeddingMethod) and embed.quant_method.bits == bits
    assert isinstance(head.quant_method, Exl3LinearMethod)
    table = load_checkpoint(path).load_tensor("model.embed_tokens.weight")
    assert embed.weight.shape == (0, table.shape[1])
    codes, scales = codec.encode(table, bits)
    assert torch.equal(embed.exl3_embed_codes, codes) and torch.equal(embed.exl3_embed_scales, scales)
    ids = torch.tensor([0, 17, 999, 5, 5])
    got = embed(ids)
    assert got.dtype == table.dtype
    assert torch.equal(got, codec.lookup(codes, scales, ids, bits, table.dtype))
    err = (got.float() - table[ids].float()).abs().amax(-1)
    assert bool((err <= scales[ids].float() * 0.5 + table[ids].float().abs().amax(-1) * 2**-7).all())
    assert embed.exl3_embed_freed_bytes == table.numel() * 2 - codes.numel() - scales.numel() * 2


def test_unset_knob_leaves_the_table_alone(monkeypatch):
    monkeypatch.delenv("SGLANG_EXL3_EMBED_ONLINE_BITS", raising=False)
    model, _ = load_as_server(LLAMA, dtype=torch.bfloat16)
    embed, _ = _embed_and_head(model)
    assert type(embed.quant_method).__name__ == "UnquantizedEmbeddingMethod"
    assert torch.equal(embed.weight, load_checkpoint(LLAMA).load_tensor("model.embed_tokens.weight"))


@pytest.mark.parametrize("bits", [8, 6])
def test_vocab_parallel_shards_sum_to_the_whole_table(monkeypatch, bits):
    """Each rank encodes its own rows; with SGLang's masking, the ranks' outputs (what the all-reduce adds) equal
    the unsharded lookup exactly, ids of every rank's range included."""
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from sglang.srt.runtime_context import get_parallel

    monkeypatch.setenv("SGLANG_EXL3_EMBED_ONLINE_BITS", str(bits))
    _, cfg = exl3_config(LLAMA)
    table = load_checkpoint(LLAMA).load_tensor("model.embed_tokens.weight")
    ids = torch.tensor([[0, 1, 511, 512, 513], [1023, 700, 3, 600, 2]])
    parts = []
    for rank in range(2):
        with get_parallel().override(tp_size=2, tp_rank=rank):
            layer = VocabParallelEmbedding(table.shape[0], table.shape[1], params_dtype=table.dtype,
                                           quant_config=cfg, prefix="model.embed_tokens")
            layer.weight_loader(layer.weight, table)
            layer.quant_method.process_weights_after_loading(layer)
            assert layer.exl3_embed_codes.shape[0] == table.shape[0] // 2
            parts.append(layer._embed_local_shard(ids))
    codes, scales = codec.encode(table, bits)
    assert torch.equal(parts[0] + parts[1], codec.lookup(codes, scales, ids, bits, table.dtype))


def test_tied_embeddings_are_refused_at_startup(monkeypatch, tmp_path):
    path = tmp_path / "tied"
    shutil.copytree(LLAMA, path, ignore=shutil.ignore_patterns("oracle"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    monkeypatch.setenv("SGLANG_EXL3_EMBED_ONLINE_BITS", "8")
    with pytest.raises(KnobError, match="SGLANG_EXL3_EMBED_ONLINE_BITS=8 is incompatible with tied word embeddings"):
        exl3_config(path)
    monkeypatch.delenv("SGLANG_EXL3_EMBED_ONLINE_BITS")
    exl3_config(path)  # without the knob the same checkpoint is fine


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    return bf16_twin(LLAMA, tmp_path_factory.mktemp("twin") / "llama")


def _hand_over(target, draft):
    draft_hand_over(target, draft, with_head=False)  # EAGLE3's: the embedding only


def test_a_bf16_draft_shares_the_encoded_table(monkeypatch, twin):
    monkeypatch.setenv("SGLANG_EXL3_EMBED_ONLINE_BITS", "8")
    target, _ = load_as_server(LLAMA, dtype=torch.bfloat16)
    draft, cfg = load_as_server(twin, dtype=torch.bfloat16)
    assert cfg is None and type(draft.model.embed_tokens.quant_method).__name__ == "UnquantizedEmbeddingMethod"
    _hand_over(target, draft)
    embed = draft.model.embed_tokens
    assert embed.exl3_embed_codes.data_ptr() == target.model.embed_tokens.exl3_embed_codes.data_ptr()  # one table
    ids = torch.tensor([[3, 999, 0], [512, 5, 5]])
    assert torch.equal(embed(ids), target.model.embed_tokens(ids))


@pytest.mark.parametrize("draft_bits, shared", [(8, True), (6, False)])
def test_an_encoded_draft_shares_only_an_equal_table(monkeypatch, draft_bits, shared):
    """An MTP-style draft that encoded its own copy of the table: equal codes and scales are shared (its own copy
    is dropped); another representation is kept."""
    monkeypatch.setenv("SGLANG_EXL3_EMBED_ONLINE_BITS", str(draft_bits))
    draft, _ = load_as_server(LLAMA, dtype=torch.bfloat16)
    own = draft.model.embed_tokens.exl3_embed_codes
    monkeypatch.setenv("SGLANG_EXL3_EMBED_ONLINE_BITS", "8")
    target, _ = load_as_server(LLAMA, dtype=torch.bfloat16)
    _hand_over(target, draft)
    embed, source = draft.model.embed_tokens, target.model.embed_tokens
    assert (embed.exl3_embed_codes.data_ptr() == source.exl3_embed_codes.data_ptr()) == shared
    assert shared or embed.exl3_embed_codes is own
    ids = torch.tensor([1, 700, 33])
    table = load_checkpoint(LLAMA).load_tensor("model.embed_tokens.weight")
    codes, scales = codec.encode(table, draft_bits)
    assert torch.equal(embed(ids), codec.lookup(codes, scales, ids, draft_bits, table.dtype))


def test_a_draft_embedding_of_another_shape_cannot_share(monkeypatch):
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    monkeypatch.setenv("SGLANG_EXL3_EMBED_ONLINE_BITS", "6")
    target, _ = load_as_server(LLAMA, dtype=torch.bfloat16)
    draft = torch.nn.Module()
    draft.embed_tokens = VocabParallelEmbedding(512, target.model.embed_tokens.embedding_dim)
    draft.set_embed = lambda embed: setattr(draft.embed_tokens, "weight", embed)
    with pytest.raises(ValueError, match="draft embedding embed_tokens is 512 x 256 per rank, but the target's int6 "
                                         "table is 1024 x 256"):
        _hand_over(target, draft)


def test_a_head_tied_to_the_encoded_table_is_refused(monkeypatch):
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    monkeypatch.setenv("SGLANG_EXL3_EMBED_ONLINE_BITS", "8")
    target, _ = load_as_server(LLAMA, dtype=torch.bfloat16)
    head = ParallelLMHead(1024, 256)
    with pytest.raises(KnobError, match="incompatible with tied word embeddings"):
        head.tie_weights(target.model.embed_tokens)
    monkeypatch.delenv("SGLANG_EXL3_EMBED_ONLINE_BITS")
    plain, _ = load_as_server(LLAMA, dtype=torch.bfloat16)
    assert head.tie_weights(plain.model.embed_tokens) is head  # an unencoded table ties as before


def test_bad_values_and_widths_are_refused(monkeypatch):
    from sglang_exl3.layers.embedding import Exl3EmbeddingMethod

    monkeypatch.setenv("SGLANG_EXL3_EMBED_ONLINE_BITS", "4")
    with pytest.raises(KnobError, match="SGLANG_EXL3_EMBED_ONLINE_BITS must be one of 8, 6"):
        exl3_config(LLAMA)
    with pytest.raises(ValueError, match="multiple of 4; it is 258"):
        Exl3EmbeddingMethod(6).create_weights(torch.nn.Module(), 258, [64], 258, 64, torch.bfloat16)
    with pytest.raises(RuntimeError, match="cannot serve as an lm_head"):
        Exl3EmbeddingMethod(8, "model.embed_tokens").apply(torch.nn.Module(), torch.zeros(1, 8))


def test_the_draft_workers_hand_over_through_the_hook():
    """The plugin wraps each of SGLang's draft workers that hands a draft the target's embedding (a renamed method
    would otherwise leave a draft reading the [0, H] stub)."""
    import importlib

    for module, cls, method in (("eagle_worker_v2", "EagleDraftWorker", "init_lm_head"),
                                ("multi_layer_eagle_worker_v2", "MultiLayerEagleDraftWorker", "init_lm_head"),
                                ("frozen_kv_mtp_worker_v2", "FrozenKVMTPDraftWorker", "__init__")):
        worker = getattr(importlib.import_module(f"sglang.srt.speculative.{module}"), cls)
        assert getattr(getattr(worker, method), "__wrapped__", None) is not None, (cls, method)
