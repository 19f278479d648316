"""`Exl3EmbeddingMethod`: the model's input embedding table held as int8 or int6 codes with a scale per row
(`SGLANG_EXL3_EMBED_ONLINE_BITS`), encoded at load (codec/embedding.py).

Only SGLang's exact `VocabParallelEmbedding` takes it, never a `ParallelLMHead` or another subclass. The table loads
as BF16 through SGLang's own vocab-parallel loader, so each rank encodes its own rows. Rows are encoded
independently, so a sharded table encodes to exactly the rows of the whole one, and SGLang's masking and
all-reduce work unchanged. The BF16 weight is then freed, leaving a [0, H] stub: code that reads the width still
finds it, and code that would read the rows fails loudly instead of reading stale memory. Tied embeddings (the
lm_head would read the table) are refused when the config is built and when a model ties its head, naming the knob.

EAGLE and MTP drafts receive the target's embedding as its weight (`set_embed_and_head` / `set_embed`), which is the
stub: `draft_sharing.share_with_draft` then gives the draft's embedding the target's encoded table, or keeps the
draft's own where it is encoded differently (the reference's rule: share only an equal representation).
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.layers.quantization.base_config import QuantizeMethodBase
from sglang.srt.utils import set_weight_attrs

from sglang_exl3.codec import embedding as codec
from sglang_exl3.knobs import KnobError

logger = logging.getLogger(__name__)


class Exl3EmbeddingMethod(QuantizeMethodBase):
    """Embedding lookups from an int8 / int6 table (gather, then decode the gathered rows only)."""

    def __init__(self, bits: int, prefix: str = ""):
        codec.check_shape(0, 0, bits)
        self.bits = bits
        self.prefix = prefix

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        codec.check_shape(sum(output_partition_sizes), input_size_per_partition, self.bits)
        weight = torch.nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition,
                                                dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        table = layer.weight.data
        codes, scales = codec.encode(table, self.bits)
        layer.register_buffer("exl3_embed_codes", codes, persistent=False)
        layer.register_buffer("exl3_embed_scales", scales, persistent=False)
        before = table.numel() * table.element_size()
        after = codes.numel() * codes.element_size() + scales.numel() * scales.element_size()
        layer.exl3_embed_dtype = table.dtype
        del layer.weight
        stub = torch.nn.Parameter(torch.empty(0, table.shape[1], dtype=table.dtype, device=table.device),
                                  requires_grad=False)
        stub.exl3_source = layer  # a draft handed this weight shares the encoded table (draft_sharing)
        layer.register_parameter("weight", stub)
        del table
        if codes.is_cuda:
            torch.cuda.empty_cache()
        layer.exl3_embed_freed_bytes = before - after
        logger.info("EXL3 embedding %s: %d x %d table as int%d, %.1f MiB -> %.1f MiB (%.1f MiB freed on this rank)",
                    self.prefix, codes.shape[0], layer.weight.shape[1], self.bits, before / 2**20, after / 2**20,
                    (before - after) / 2**20)

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        return codec.lookup(layer.exl3_embed_codes, layer.exl3_embed_scales, input_, self.bits, layer.exl3_embed_dtype)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise RuntimeError(f"EXL3 embedding {self.prefix}: an int{self.bits} embedding table cannot serve as an "
                           "lm_head (tied embeddings are refused with SGLANG_EXL3_EMBED_ONLINE_BITS)")


def tied_embeddings_error(bits) -> KnobError:
    """The refusal of a tied lm_head (it would read the table that the int8 / int6 codes replace), raised when the
    config is built and when a model ties its head."""
    return KnobError(f"SGLANG_EXL3_EMBED_ONLINE_BITS={bits} is incompatible with tied word embeddings (this model's "
                     "lm_head reads the embedding table); unset it")
