"""An expert cartridge on one MoE layer of this rank: its residual stages checked against the live layer and folded
into per-expert weights, and the forward that serves them.

Each stage's residual shares the base projection's rotations (the cartridge carries none), so per projection
y = diag(svh) H ((W_hat_base + sum_s W_hat_s / scale_s)^T H diag(suh) x): the stages add up in the rotated basis.
`prepare_layer` decodes the base and every stage of each local expert into W_eff = fp16(W_hat_base + sum_s
W_hat_s / scale_s) (fp32 sum, one rounding), an expert without a residual in a stage adding nothing (the
reference's scale-0 entries); the forward is the rotated-slab forward of `moe_rotated.py` on those weights: the
rotations per (token, expert) pair, a grouped GEMM between them (SGLang's Triton kernel on the GPU). Capturable: static
shapes, weights at fixed addresses.

Checks, before anything live changes: the layer's base was verified against its compatibility digest at load and is
the one the manifest names (per-layer digest), the manifest's base.k is the layer's uniform K, and every residual has
the logical shape of its projection (`full` layout: the whole projection, sliced here for this TP rank in
128-element units on the intermediate axis; `rank-sharded`: this rank's slice as stored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import safe_open

from sglang_exl3.format.cartridge_index import CartridgeIndex, live_layer_index
from sglang_exl3.format.cartridge_manifest import AXIS_BY_PROJECTION, CartridgeError
from sglang_exl3.format.constants import Codebook
from sglang_exl3.format.rank_sliced import ROLE_PROJECTIONS
from sglang_exl3.layers.shard import Exl3Shard

TILE = 16


@dataclass
class LayerCartridge:
    """One layer's served weights under a cartridge: W_eff in the rotated basis as `rotated_forward` takes them,
    gate and up as one [2E, N, K] fp16 (gate experts, then up experts), down [E, H, N]."""

    layer_index: int
    labels: tuple[str, ...]
    weights: tuple[torch.Tensor, torch.Tensor]


def _decode(trellis: torch.Tensor, codebook: Codebook, kernel_layout: bool) -> torch.Tensor:
    """W_hat fp16 [K, N], bit-exact, from a trellis in either layout."""
    if kernel_layout:
        from sglang_exl3.kernels.dense import reconstruct

        return reconstruct(trellis, codebook)
    from sglang_exl3.codec.trellis import reconstruct

    return reconstruct(trellis, codebook)


def _read(info) -> torch.Tensor:
    with safe_open(str(info.file), framework="pt") as f:
        return f.get_tensor(info.name)


def check_base(layer: torch.nn.Module, prefix: str, index: CartridgeIndex) -> int | None:
    """The layer's index if the manifest selects it and names its verified base; None if it is not selected."""
    manifest = index.manifest
    number = live_layer_index(prefix)
    if number not in manifest.selected_layers:
        return None
    digest = getattr(layer, "exl3_base_digest", None)
    if digest is None:
        raise CartridgeError(f"{prefix}: Loaded EXL3 base has no verified compatibility_sha256; cartridges need an "
                             "exl3-msrt-base/1 checkpoint (python -m sglang_exl3 write-msrt-base)")
    if manifest.base_by_layer[number] != digest:
        raise CartridgeError(f"{prefix}: EXL3 cartridge was encoded for a different base checkpoint (layer {number}: "
                             f"cartridge base {manifest.base_by_layer[number]}, loaded {digest})")
    bits = {shard.trellis.shape[-1] // TILE for shards in layer.exl3_experts for shard in shards.values()}
    if bits != {manifest.base_k}:
        raise CartridgeError(f"{prefix}: the cartridge's base.k ({manifest.base_k}) does not match the layer's base "
                             f"bitrate {sorted(bits)}")
    return number


def _residual(info, projection: str, stored: tuple[int, int], cut: tuple[int, int] | None, device,
              prefix: str) -> torch.Tensor:
    """One residual trellis in the checkpoint layout [K/16, N/16, words]: its stored tiles must be `stored` (the
    whole projection, or this rank's slice), then `cut` (start, count) tiles of the intermediate axis are kept."""
    if tuple(info.shape[:2]) != stored:
        raise CartridgeError(f"{prefix}: residual {info.name} is [{info.shape[0] * TILE}, {info.shape[1] * TILE}] "
                             f"(in, out); the projection {'is' if cut is None else 'before TP slicing is'} "
                             f"[{stored[0] * TILE}, {stored[1] * TILE}]")
    t = _read(info)
    if cut is not None:
        t = t.narrow(1 if AXIS_BY_PROJECTION[projection] == "output" else 0, cut[0], cut[1])
    return t.contiguous().to(device)


def _fold(layer: torch.nn.Module, residuals) -> tuple[torch.Tensor, torch.Tensor]:
    """Per role, [E, N, K] fp16 = fp16(W_hat_base + sum of `residuals(role, projection, expert, shard, tiles)`'s
    (W_hat, 1 / scale) pairs), summed in fp32 and rounded once; gate and up joined as [2E, N, K]. Also keeps the
    layer's rotation tables (made here, eagerly, never inside a graph capture)."""
    if getattr(layer, "exl3_rotation_tables", None) is None:
        layer.exl3_rotation_tables = rotations(layer.exl3_experts)
    weights = []
    for role, projection in ROLE_PROJECTIONS:
        per_expert = []
        for e, shards in enumerate(layer.exl3_experts):
            shard = shards[role]
            w = _decode(shard.trellis, shard.codebook, shard.kernel_layout).float()
            for w_hat, inverse in residuals(role, projection, e, shard, (w.shape[0] // TILE, w.shape[1] // TILE)):
                w += w_hat.float() * inverse
            per_expert.append(w.to(torch.float16).t())
        weights.append(per_expert)
    gate, up, down = weights
    return torch.stack(gate + up), torch.stack(down)  # one stack for gate and up: no second copy of both


def base_cartridge(layer: torch.nn.Module, prefix: str) -> LayerCartridge:
    """The layer's base alone in the cartridge forward's form: what a resident slot holds while no cartridge is
    active (SGLANG_EXL3_CARTRIDGES=resident)."""
    return LayerCartridge(live_layer_index(prefix), (), _fold(layer, lambda *_: ()))


def restore_base(layer: torch.nn.Module, slot: LayerCartridge) -> None:
    """Write the base back into a resident slot, in place (captured graphs keep reading the same addresses)."""
    for dst, src in zip(slot.weights, _fold(layer, lambda *_: ()), strict=True):
        dst.copy_(src)


def prepare_layer(layer: torch.nn.Module, prefix: str, index: CartridgeIndex) -> LayerCartridge | None:
    """Check the cartridge against one live layer and fold its stages into new weights (nothing live changes).
    None if the manifest does not select this layer. The layer's MoE TP rank and size pick its slice."""
    number = check_base(layer, prefix, index)
    if number is None:
        return None
    manifest = index.manifest
    tp_rank, tp_size = getattr(layer, "moe_tp_rank", 0), getattr(layer, "moe_tp_size", 1)
    stored = index.layer(number, 0 if manifest.layout == "full" else tp_rank)
    inter = layer.intermediate_size_per_partition
    cut_tiles = (tp_rank * inter // TILE, inter // TILE) if manifest.layout == "full" and tp_size > 1 else None

    def residuals(role, projection, e, shard, tiles):
        if cut_tiles is not None:  # a full-layout residual holds the whole intermediate axis
            tiles = (tiles[0], tiles[1] * tp_size) if role != "w2" else (tiles[0] * tp_size, tiles[1])
        for stage in manifest.chain:
            residual = stored.get((stage.label, e, projection))
            if residual is None:  # this stage does not cover the expert: it adds nothing
                continue
            t = _residual(residual.trellis, projection, tiles, cut_tiles, shard.trellis.device, prefix)
            if shard.kernel_layout:
                from sglang_exl3.kernels.dense import prepare

                t = prepare(t)
            inverse = torch.tensor(residual.scale, dtype=torch.float32).reciprocal().item()
            yield _decode(t, Codebook.MCG, shard.kernel_layout), inverse

    return LayerCartridge(number, tuple(s.label for s in manifest.chain), _fold(layer, residuals))


def rotations(experts: list[dict[str, Exl3Shard]]) -> tuple[torch.Tensor, ...]:
    """(gate suh, gate svh, up suh, up svh, down suh, down svh), each [E, width] fp16, for `rotated_forward`."""
    out = []
    for role, _ in ROLE_PROJECTIONS:
        out += [torch.stack([e[role].suh for e in experts]).to(torch.float16),
                torch.stack([e[role].svh.reshape(-1) for e in experts]).to(torch.float16)]
    return tuple(out)


def cartridge_forward(layer: torch.nn.Module, cart: LayerCartridge, x: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, gelu: bool) -> torch.Tensor:
    """fp32 [m, H]: the layer's experts with the cartridge's weights (rotated forward; Triton grouped GEMM on CUDA)."""
    from sglang_exl3.kernels.backends import Backend
    from sglang_exl3.layers.moe_rotated import TORCH_GLUE, cuda_glue, reference_gemm, rotated_forward, triton_gemm

    e, inter, hidden = len(layer.exl3_experts), layer.intermediate_size_per_partition, layer.hidden_size
    if x.shape[0] == 0:  # no launch for an empty batch
        return torch.zeros(0, hidden, dtype=torch.float32, device=x.device)
    gemm = triton_gemm(x.shape[0], topk_ids.shape[1], e, inter, hidden) if x.is_cuda else reference_gemm
    on_our_kernels = x.is_cuda and getattr(layer, "exl3_backend", None) == int(Backend.CUDA)
    return rotated_forward(cart.weights, layer.exl3_rotation_tables, x, topk_weights, topk_ids, gelu, gemm,
                           cuda_glue() if on_our_kernels else TORCH_GLUE)
