"""Write EXL3 checkpoints in exllamav3's exact on-disk layout, with random trellis bits.

Random trellis words are valid EXL3 (the decoder reads any bit pattern), so these checkpoints
exercise every loader and kernel path without running the quantizer. Layout follows exllamav3
1.6.5's converter output: per-linear `trellis`/`suh`/`svh`/marker, unquantized embeddings and
norms, fp16 MoE routers, an EXL3 `lm_head` at `head_bits`, `config.json` with the summary
`quantization_config` and `quantization_config.json` with `tensor_storage` in module order.
suh/svh are scaled so that the original-basis weights have std ~0.02 (a servable model).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sglang_exl3.format.constants import SIDECAR_NAME, Codebook, padded
from sglang_exl3.format.shards import ShardPacker, marker_tensor, storage_entry
from sglang_exl3.synth import qwen3_5_layout
from sglang_exl3.synth.moe_layout import sparse_mlp

HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    **{name: variant.architecture for name, variant in qwen3_5_layout.VARIANTS.items()},
}
# MoE architectures: expert block name, (up, gate, down) projection names, intermediate-size field
_MOE_LAYOUT = {
    "qwen3_moe": ("mlp", ("up_proj", "gate_proj", "down_proj"), "moe_intermediate_size"),
    "qwen2_moe": ("mlp", ("up_proj", "gate_proj", "down_proj"), "moe_intermediate_size"),
    "mixtral": ("block_sparse_moe", ("w3", "w1", "w2"), "intermediate_size"),
}
_CODEBOOK_STD = {Codebook.INST3: 1.2437, Codebook.MCG: 1.2437, Codebook.MUL1: 1.0}
_MAX_SHARD_BYTES = 4 << 30


@dataclass
class ModelDims:
    """The config fields the writer needs; defaults are the tiny test model."""

    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 1024
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 256
    shared_expert_intermediate_size: int = 512  # qwen2_moe's always-on shared expert
    extra: dict = field(default_factory=dict)  # copied into config.json as is


LLAMA3_8B = ModelDims(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256)
QWEN3_30B_A3B = ModelDims(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, vocab_size=151936, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768)
# benchmarks/spec_models.py's trained target: where decode is bound by launches rather than weight reads
LLAMA_SPEC_TARGET = ModelDims(hidden_size=1536, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=12,
                              num_key_value_heads=4, head_dim=128, vocab_size=8192)
SHAPES = {"llama3-8b": ("llama", LLAMA3_8B), "qwen3-30b-a3b": ("qwen3_moe", QWEN3_30B_A3B),
          "llama-spec-target": ("llama", LLAMA_SPEC_TARGET)}


def hf_config(arch: str, dims: ModelDims, bos: int = 0, eos: int = 1, pad: int = 2) -> dict:
    cfg = {
        "architectures": [HF_ARCHITECTURES[arch]],
        "model_type": qwen3_5_layout.VARIANTS[arch].model_type if arch in qwen3_5_layout.VARIANTS else arch,
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.intermediate_size,
        "num_hidden_layers": dims.num_hidden_layers,
        "num_attention_heads": dims.num_attention_heads,
        "num_key_value_heads": dims.num_key_value_heads,
        "head_dim": dims.head_dim,
        "vocab_size": dims.vocab_size,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0 if arch != "mixtral" else 1e6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "dtype": "bfloat16",
    }
    if arch == "qwen3_moe":
        cfg.update(num_experts=dims.num_experts, num_local_experts=dims.num_experts,
                   num_experts_per_tok=dims.num_experts_per_tok,
                   moe_intermediate_size=dims.moe_intermediate_size, decoder_sparse_step=1,
                   mlp_only_layers=[], norm_topk_prob=True)
    if arch == "qwen2_moe":
        cfg.update(num_experts=dims.num_experts, num_experts_per_tok=dims.num_experts_per_tok,
                   moe_intermediate_size=dims.moe_intermediate_size,
                   shared_expert_intermediate_size=dims.shared_expert_intermediate_size, decoder_sparse_step=1,
                   mlp_only_layers=[], norm_topk_prob=False, qkv_bias=True)
    if arch == "mixtral":
        cfg.update(num_local_experts=dims.num_experts, num_experts_per_tok=dims.num_experts_per_tok)
    if arch in qwen3_5_layout.VARIANTS:
        cfg.update(qwen3_5_layout.config_fields(arch, dims))
    cfg.update(dims.extra)
    return cfg


def module_plan(arch: str, dims: ModelDims, shared_quantized: bool = True,
                mtp_bits: float | None = None) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """(module key, kind, shape) in exllamav3's module order. kind: 'exl3' / 'exl3_bias' (shape = (in, out)),
    'head' (EXL3 at head_bits), 'mtp' (EXL3 at mtp_bits), 'embed', 'norm', 'router', 'dense' (an unquantized
    linear; shape = the weight's shape) or 'param' (a tensor stored under the key itself, as `A_log`)."""
    if arch in qwen3_5_layout.VARIANTS:
        yield from qwen3_5_layout.module_plan(arch, dims, mtp_bits)
        return
    h, hd = dims.hidden_size, dims.head_dim
    q_out, kv_out = dims.num_attention_heads * hd, dims.num_key_value_heads * hd
    yield "model.embed_tokens", "embed", (dims.vocab_size, h)
    for i in range(dims.num_hidden_layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm", "norm", (h,)
        qkv = "exl3_bias" if arch in ("qwen2", "qwen2_moe") else "exl3"  # Qwen2 attention has q/k/v biases
        yield f"{p}.self_attn.q_proj", qkv, (h, q_out)
        yield f"{p}.self_attn.k_proj", qkv, (h, kv_out)
        yield f"{p}.self_attn.v_proj", qkv, (h, kv_out)
        yield f"{p}.self_attn.o_proj", "exl3", (q_out, h)
        if arch in ("qwen3", "qwen3_moe"):
            yield f"{p}.self_attn.q_norm", "norm", (hd,)
            yield f"{p}.self_attn.k_norm", "norm", (hd,)
        yield f"{p}.post_attention_layernorm", "norm", (h,)
        if arch in _MOE_LAYOUT:  # router, then each expert's up, gate, down (exllamav3's order)
            block, names, inter_field = _MOE_LAYOUT[arch]
            # qwen2_moe: the shared expert (EXL3, or left unquantized) and its sigmoid gate
            shared = dims.shared_expert_intermediate_size if arch == "qwen2_moe" else None
            yield from sparse_mlp(f"{p}.{block}", h, getattr(dims, inter_field), dims.num_experts, names,
                                  shared=shared, shared_kind="exl3" if shared_quantized else "dense")
        else:
            yield f"{p}.mlp.up_proj", "exl3", (h, dims.intermediate_size)
            yield f"{p}.mlp.gate_proj", "exl3", (h, dims.intermediate_size)
            yield f"{p}.mlp.down_proj", "exl3", (dims.intermediate_size, h)
    yield "model.norm", "norm", (h,)
    yield "lm_head", "head", (h, dims.vocab_size)


def random_exl3_linear(
    in_features: int, out_features: int, bits: float, codebook: Codebook, gen: torch.Generator,
    weight_std: float = 0.02,
) -> dict[str, torch.Tensor]:
    """Tensors of one EXL3 linear, in the order exllamav3 stores them (suh, svh, marker, trellis)."""
    k, n = padded(in_features), padded(out_features)
    words = int(bits * 16)
    scale = (weight_std / _CODEBOOK_STD[codebook]) ** 0.5

    def signed_scale(size: int) -> torch.Tensor:
        sign = torch.randint(0, 2, (size,), generator=gen) * 2 - 1
        jitter = 1 + 0.1 * torch.rand(size, generator=gen)
        return (sign * jitter * scale).half()

    out = {"suh": signed_scale(k), "svh": signed_scale(n)}
    if codebook.marker:
        out[codebook.marker] = marker_tensor(codebook)
    out["trellis"] = torch.randint(-32768, 32768, (k // 16, n // 16, words), generator=gen, dtype=torch.int16)
    return out


def write_exl3_checkpoint(
    out_dir: str | Path,
    arch: str = "llama",
    dims: ModelDims | None = None,
    bits: float = 4,
    codebook: Codebook | str = Codebook.MUL1,
    head_bits: float = 6,
    seed: int = 0,
    with_tokenizer: bool = True,
    progress: bool = False,
    shared_quantized: bool = True,
    mtp_bits: float | None = None,
) -> Path:
    """Write a complete EXL3 checkpoint folder (safetensors shards, config, sidecar, tokenizer). `mtp_bits`: the MTP
    block of an architecture that has one (the qwen3_5 variants), at that bitrate (16: unquantized); None: none."""
    if arch not in HF_ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {sorted(HF_ARCHITECTURES)}")
    dims = dims or ModelDims()
    codebook = Codebook.from_label(codebook) if isinstance(codebook, str) else Codebook(codebook)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = {"bos": 0, "eos": 1, "pad": 2}
    if with_tokenizer:
        from sglang_exl3.synth.tokenizer import write_tokenizer

        ids = write_tokenizer(out, dims.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    storage: dict[str, dict] = {}
    packer = ShardPacker(_MAX_SHARD_BYTES)
    plan = list(module_plan(arch, dims, shared_quantized, mtp_bits))
    if progress:
        from tqdm import tqdm

        plan = tqdm(plan, desc="writing EXL3 modules", unit="module")
    for key, kind, shape in plan:
        if kind in ("exl3", "exl3_bias", "head", "mtp"):
            rate = {"head": head_bits, "mtp": mtp_bits}.get(kind, bits)
            parts = random_exl3_linear(shape[0], shape[1], rate, codebook, gen)
            if kind == "exl3_bias":  # padded like the output features, as exllamav3 stores it
                parts["bias"] = (0.02 * torch.randn(padded(shape[1]), generator=gen)).half()
            tensors = {f"{key}.{s}": t for s, t in parts.items()}
            storage[key] = storage_entry(tensors, rate, codebook)
        else:
            if kind == "norm":
                t = (1 + 0.1 * torch.randn(shape, generator=gen)).bfloat16()
            elif kind == "router":
                t = (0.02 * torch.randn(shape, generator=gen)).half()
            else:
                t = (0.02 * torch.randn(shape, generator=gen)).bfloat16()
            tensors = {key if kind == "param" else f"{key}.weight": t}
            storage[key] = storage_entry(tensors, None, None)
        packer.add(tensors)
    packer.save(out)
    qcfg = {"quant_method": "exl3", "version": "1.6.5", "bits": float(bits), "head_bits": head_bits,
            "calibration": {"rows": 0, "cols": 0}, "out_scales": "auto", "codebook": codebook.label,
            **({"mtp_bits": mtp_bits} if mtp_bits is not None else {})}
    config = hf_config(arch, dims, ids["bos"], ids["eos"], ids["pad"])
    config["quantization_config"] = qcfg
    if arch in qwen3_5_layout.VARIANTS and qwen3_5_layout.VARIANTS[arch].vl:
        config = qwen3_5_layout.vl_config(arch, config)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / SIDECAR_NAME).write_text(json.dumps({**qcfg, "tensor_storage": storage}, indent=4))
    return out
