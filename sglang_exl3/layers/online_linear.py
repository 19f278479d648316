"""A BF16 / FP16 linear encoded to EXL3 while the model loads (SGLANG_EXL3_ONLINE_BITS): SGLang's unquantized
weight loaders fill the layer's weight as usual (tensor-parallel cuts and fused q/k/v, gate/up shards included), then
`process_weights_after_loading` encodes each output shard of this rank (codec/encode.py, uncalibrated MCG) into an
`Exl3Shard`, frees the weight, and the layer runs the same EXL3 forward as a checkpoint's.

Each shard's encoding goes through the persistent cache (runtime/online_cache.py). Its key identifies the source by
the SHA-256 of the shard's own weight bytes, so an entry can only ever be reused for the same weights, whatever
happens to the files on disk; the key adds the encoder's source digest, the module, bitrate, codebook, seed, TP
world size and rank, shapes and dtype.

A shard whose rows or columns are not whole 128-element blocks is zero-padded to them before encoding, as exllamav3
pads (the input is padded and the output trimmed at run time, as for a checkpoint's padded modules); padded shards run
one GEMM each rather than one group launch.
"""

from __future__ import annotations

import hashlib
import logging
from functools import cache
from pathlib import Path

import torch
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

from sglang_exl3 import knobs
from sglang_exl3.format.constants import Codebook, padded
from sglang_exl3.kernels.backends import resolve_backend
from sglang_exl3.layers.linear import apply_shards, attach_shards, prepare_for_backend
from sglang_exl3.layers.shard import Exl3Shard

logger = logging.getLogger(__name__)
CODEBOOK = Codebook.MCG


@cache
def online_cache():
    from sglang_exl3.runtime.online_cache import OnlineCache

    root = knobs.get("ONLINE_CACHE_DIR") or Path.home() / ".cache" / "sglang_exl3" / "online"
    return OnlineCache(root, knobs.get("ONLINE_CACHE"))  # readwrite, readonly or off: other spellings are refused


def weight_digest(w: torch.Tensor) -> str:
    """SHA-256 of a weight's bytes as stored (bf16 / fp16 viewed as int16)."""
    raw = w.detach().contiguous().view(torch.int16) if w.element_size() == 2 else w.detach().contiguous()
    return hashlib.sha256(raw.cpu().numpy().tobytes()).hexdigest()


def _tp(layer: torch.nn.Module) -> tuple[int, int]:
    return int(getattr(layer, "tp_size", 1) or 1), int(getattr(layer, "tp_rank", 0) or 0)


class OnlineProgress:
    """Linears done out of those the model selected, with the time so far and an estimate of what is left (layers
    read from the cache are not counted in the rate)."""

    def __init__(self):
        self.total = self.done = self.hits = 0
        self.started: float | None = None

    def begin(self) -> None:
        import time

        self.started = self.started or time.monotonic()

    def step(self, hit: bool) -> None:
        import time

        now = time.monotonic()
        self.started = self.started or now
        self.done, self.hits = self.done + 1, self.hits + hit
        encoded = self.done - self.hits
        rate = (now - self.started) / max(encoded, 1)
        left = max(self.total - self.done, 0) * rate if encoded else 0.0
        logger.info("EXL3 online: %d/%d linears (%d from the cache), %.0f s so far, ~%.0f s left", self.done,
                    self.total, self.hits, now - self.started, left)


def encode_shard(part: torch.Tensor, module: str, bits: int, world: int, rank: int) -> tuple[Exl3Shard, bool]:
    """One [out, in] weight (this rank's) as an EXL3 shard on its device, through the cache; (shard, cache hit)."""
    from sglang_exl3.codec.encode import module_seed
    from sglang_exl3.runtime.online_cache import cache_key, encoder_identity

    n, k = part.shape
    key = cache_key(model_identity=weight_digest(part), encoder_identity=encoder_identity(), module=module, bits=bits,
                    codebook=CODEBOOK.label, seed=module_seed(module), tp_world_size=world,
                    tp_rank=rank, input_size=padded(k), output_size=padded(n), source_dtype=str(part.dtype))
    tensors, how = online_cache().get_or_encode(key, lambda: _encode(part, key))
    logger.info("EXL3 online: %s %dx%d at %d bits: %s", module, k, n, bits, how)
    device = part.device
    return Exl3Shard(key=module, trellis=tensors["trellis"].to(device), suh=tensors["suh"].to(device),
                     svh=tensors["svh"].to(device), codebook=CODEBOOK, out_features=n), how == "hit"


class Exl3OnlineLinearMethod(UnquantizedLinearMethod):
    """SGLang's BF16 weights and loaders, then the EXL3 forward on this rank's encoded shards."""

    def __init__(self, prefix: str, bits: int, progress: OnlineProgress | None = None,
                 part_names: list[str] | None = None):
        """`part_names`: the checkpoint modules SGLang fuses into this layer, in shard order (q, k, v of qkv_proj):
        each shard is keyed and seeded by its own name, as `python -m sglang_exl3 encode` seeds it, so the online
        encoding of a model equals its offline one."""
        super().__init__()
        self.prefix, self.bits, self.progress = prefix, bits, progress
        self.part_names = list(part_names or [])

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weight = layer.weight.data  # [out this rank, in this rank]
        sizes = list(getattr(layer, "output_partition_sizes", None) or [weight.shape[0]])
        if sum(sizes) != weight.shape[0]:
            sizes = [weight.shape[0]]
        world, rank = _tp(layer)
        if self.progress is not None:
            self.progress.begin()
        shards, hits, row = [], [], 0
        for i, n in enumerate(sizes):
            part = weight[row:row + n]
            row += n
            shard, hit = encode_shard(part, self._shard_name(i, len(sizes)), self.bits, world, rank)
            shards.append(shard)
            hits.append(hit)
        if self.progress is not None:
            self.progress.step(all(hits))
        backend = resolve_backend(weight.device)
        prepare_for_backend(shards, backend)
        attach_shards(layer, shards, backend)
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype, device=weight.device),
                                          requires_grad=False)  # the BF16 weight is freed
        layer.exl3_online = True

    def _shard_name(self, i: int, count: int) -> str:
        if count == 1:
            return self.prefix
        return self.part_names[i] if len(self.part_names) == count else f"{self.prefix}[{i}]"

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not getattr(layer, "exl3_online", False):
            return super().apply(layer, x, bias)
        return apply_shards(layer, x, bias, f"EXL3 online {self.prefix}")


def _encode(part: torch.Tensor, key: dict) -> tuple[dict[str, torch.Tensor], float]:
    """The torch encoder, or on a GPU with our kernels the same search as a CUDA kernel (the same path)."""
    from sglang_exl3.codec.encode import encode_linear
    from sglang_exl3.kernels.backends import Backend

    encoder = None
    if part.is_cuda and resolve_backend(part.device) == Backend.CUDA:
        from sglang_exl3.kernels.cuda_encode import encode_tiles_cuda as encoder
    enc = encode_linear(part, key["bits"], CODEBOOK, seed=key["seed"], encoder=encoder)
    return {"trellis": enc["trellis"], "suh": enc["suh"], "svh": enc["svh"]}, enc["proxy_error"]
