"""What a speculative draft takes from an EXL3 target, after SGLang's hand-over.

SGLang's draft workers give each EAGLE / MTP draft the target's embedding and lm_head *weights*
(`get_embed_and_head` -> `set_embed_and_head` / `set_embed`). An EXL3 target holds neither as a dense weight: its
lm_head is EXL3 and an int8 / int6 embedding table is codes and scales. Each leaves a [0, H] stub `weight` that
names the module it stands for (`exl3_head` / `exl3_source`), and `share_with_draft` (run by the plugin's hook on
the draft workers) gives the draft the target's module, or the target's encoded table, instead of the stub.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def share_with_draft(draft: torch.nn.Module) -> tuple[int, int]:
    """(embeddings, lm_heads) of the draft now served by the target's."""
    return share_embedding(draft), share_lm_head(draft)


def share_lm_head(draft: torch.nn.Module) -> int:
    """Every draft `ParallelLMHead` holding the stub of an EXL3 target head is replaced by that head module (its EXL3
    method and shards), where the draft's code reads it (`self.lm_head`). A draft head of another vocabulary or width
    cannot take it: ValueError naming both. Returns how many were replaced."""
    replaced = 0
    for name, module in list(draft.named_modules()):
        head = getattr(getattr(module, "weight", None), "exl3_head", None)
        if head is None or head is module or not name:
            continue
        mine = (getattr(module, "num_embeddings_per_partition", None), getattr(module, "embedding_dim", None))
        theirs = (head.num_embeddings_per_partition, head.embedding_dim)
        if mine != theirs:
            raise ValueError(f"draft {name} is {mine[0]} x {mine[1]} per rank, the target's EXL3 lm_head {theirs[0]} x "
                             f"{theirs[1]}: a draft of another vocabulary or hidden size cannot share it; use a draft "
                             "made for this target")
        parent, _, attr = name.rpartition(".")
        setattr(draft.get_submodule(parent) if parent else draft, attr, head)
        replaced += 1
        logger.info("EXL3 lm_head: the draft's %s is the target's EXL3 head", name)
    return replaced


def share_embedding(draft: torch.nn.Module) -> int:
    """After SGLang handed a draft model the target's embedding weight: every exact VocabParallelEmbedding of the
    draft that now holds an encoded table's stub looks up the target's table (same codes and scales, same
    tensors), unless it encoded its own table differently, which it then keeps. A draft embedding of another
    shape cannot share: ValueError naming both. Returns how many embeddings share the target's table."""
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    shared = 0
    for name, module in draft.named_modules():
        source = getattr(getattr(module, "weight", None), "exl3_source", None)
        if type(module) is not VocabParallelEmbedding or source is None or source is module:
            continue
        codes, scales, bits = source.exl3_embed_codes, source.exl3_embed_scales, source.quant_method.bits
        if (module.num_embeddings_per_partition, module.embedding_dim) != (codes.shape[0], source.embedding_dim):
            raise ValueError(f"draft embedding {name} is {module.num_embeddings_per_partition} x "
                             f"{module.embedding_dim} per rank, but the target's int{bits} table is {codes.shape[0]} x "
                             f"{source.embedding_dim}: they cannot be shared; unset SGLANG_EXL3_EMBED_ONLINE_BITS")
        own = getattr(module, "exl3_embed_codes", None)
        if own is not None and not (module.quant_method.bits == bits and torch.equal(own, codes)
                                    and torch.equal(module.exl3_embed_scales, scales)):
            stub = torch.nn.Parameter(source.weight.new_empty(source.weight.shape), requires_grad=False)
            stub.exl3_source = module
            module.weight = stub  # its own table, encoded differently: kept
            logger.info("EXL3 embedding %s: the draft keeps its own int%d table (the target's int%d table differs)",
                        name, module.quant_method.bits, bits)
            continue
        module.quant_method = source.quant_method
        module.exl3_embed_dtype = source.exl3_embed_dtype
        module.register_buffer("exl3_embed_codes", codes, persistent=False)
        module.register_buffer("exl3_embed_scales", scales, persistent=False)
        shared += 1
        logger.info("EXL3 embedding %s: the draft shares the target's int%d table", name, bits)
    return shared
