"""Tiny random-weight Hugging Face models (Llama, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4.5 MoE, Qwen3.5) for the
converter and the hybrid writer.

Dims are multiples of 128 so that exllamav3 pads nothing unexpected; each model is a few MB.
"""

from __future__ import annotations

import json
from pathlib import Path

from sglang_exl3.synth.tokenizer import write_tokenizer

TINY_COMMON = dict(
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=1024,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

TINY_ARCHS: dict[str, dict] = {
    "llama": dict(intermediate_size=512),
    "qwen3": dict(intermediate_size=512),
    "qwen3_moe": dict(
        intermediate_size=512, moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    ),
    "mixtral": dict(intermediate_size=256, num_local_experts=4, num_experts_per_tok=2),
    # layer 0 dense, layer 1: 8 routed experts of 128 in 2 groups (top-2 from 1 group, sigmoid scores with a correction
    # bias), one shared expert, routed scaling; MLA attention. YaRN rope: SGLang's CPU rope requires a scaling config.
    "deepseek_v3": dict(
        intermediate_size=512, moe_intermediate_size=128, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        # kv_lora_rank + qk_rope_head_dim = 288: a split SGLang's Triton MLA decode kernel knows (576 or 288; other
        # sums fail to compile at graph capture)
        q_lora_rank=64, kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
        routed_scaling_factor=2.5, moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, max_position_embeddings=512,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "rope_theta": 10000.0}),
    # GLM-4.5 MoE: layer 0 dense, layer 1 with 8 routed experts of 128 (sigmoid scores with a correction bias), one
    # shared expert, routed scaling; GQA attention with half-width rotary.
    "glm4_moe": dict(
        intermediate_size=512, moe_intermediate_size=128, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, partial_rotary_factor=0.5, max_position_embeddings=512),
    # Qwen3.5 (text): Gated DeltaNet then gated full attention; whole 128-wide blocks everywhere (key_dim 128, value_dim
    # 256, q 2 x 4 x 64 with its output gate)
    "qwen3_5_text": dict(intermediate_size=512, linear_num_key_heads=2, linear_key_head_dim=64,
                         linear_num_value_heads=4, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                         layer_types=["linear_attention", "full_attention"], full_attention_interval=2),
}
# Qwen3.5-MoE: the same trunk with 4 routed experts of 256 (top-2) and a shared expert of 512 in every layer
TINY_ARCHS["qwen3_5_moe_text"] = dict(TINY_ARCHS["qwen3_5_text"], num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=256, shared_expert_intermediate_size=512)


def make_random_hf_model(arch: str, directory: str | Path, seed: int = 0, **overrides) -> Path:
    """Write config.json, model.safetensors (bf16) and a tokenizer for a random tiny model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory)
    ids = write_tokenizer(directory, TINY_COMMON["vocab_size"])
    kwargs = {**TINY_COMMON, **TINY_ARCHS[arch], **overrides}
    kwargs.update(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    config = AutoConfig.for_model(arch, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # routers' correction biases start at zero; give the grouped top-k something to correct
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.uniform_(-0.1, 0.1)
    model.save_pretrained(directory)
    cfg_path = directory / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if arch == "qwen3_moe":
        # exllamav3 reads num_experts; transformers 5 writes num_local_experts.
        cfg.setdefault("num_experts", kwargs["num_experts"])
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return directory


def make_qwen3_5_source(directory: str | Path, seed: int = 0, moe: bool = False, vl: bool = False) -> Path:
    """A tiny Qwen3.5 (`moe`: Qwen3.5-MoE) as exllamav3's converter reads one: the trunk under
    `model.language_model.*` (its only Qwen3.5 layout) and a random MTP block (`mtp.fc`, the pre-fc norms, one
    full-attention layer, `mtp.norm`), which Hugging Face's classes do not build. exllamav3 1.6.5 converts the MTP
    block only for the VL architecture (`vl`: `Qwen3_5ForConditionalGeneration`, as Qwen3.5 releases are, with a
    one-block vision tower and its preprocessor config); the text architecture's conversion drops it."""
    import torch
    from safetensors.torch import load_file, save_file

    arch = "qwen3_5_moe_text" if moe else "qwen3_5_text"
    directory = _make_qwen3_5_vl(arch, directory, seed) if vl else make_random_hf_model(arch, directory, seed=seed)
    shard = directory / "model.safetensors"
    tensors = {("model.language_model." + n[len("model."):]) if n.startswith("model.layers.") or n in (
        "model.embed_tokens.weight", "model.norm.weight") else n: t for n, t in load_file(str(shard)).items()}
    gen = torch.Generator().manual_seed(seed + 1)
    for name, t in list(tensors.items()):  # the MTP layer: a copy of the shape of the full-attention layer 1
        if name.startswith("model.language_model.layers.1."):
            mtp = "mtp.layers.0." + name[len("model.language_model.layers.1."):]
            tensors[mtp] = (t.float() + 0.01 * torch.randn(t.shape, generator=gen)).to(t.dtype)
    hidden = tensors["model.language_model.norm.weight"].shape[0]
    for norm in ("pre_fc_norm_hidden", "pre_fc_norm_embedding", "norm"):
        tensors[f"mtp.{norm}.weight"] = (0.1 * torch.randn(hidden, generator=gen)).bfloat16()  # Gemma-style: 1 + w
    tensors["mtp.fc.weight"] = (0.02 * torch.randn(hidden, 2 * hidden, generator=gen)).bfloat16()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    cfg_path = directory / "config.json"
    cfg = json.loads(cfg_path.read_text())
    (cfg["text_config"] if vl else cfg)["mtp_num_hidden_layers"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return directory


# exllamav3 reads these from a Qwen3-VL-style preprocessor_config.json (architecture/qwen3_vl.py)
_QWEN3_5_PREPROCESSOR = {"size": {"shortest_edge": 65536, "longest_edge": 1048576}, "patch_size": 16,
                         "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                         "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessorFast"}


def _make_qwen3_5_vl(text_arch: str, directory: str | Path, seed: int) -> Path:
    """The VL architecture around TINY_ARCHS[text_arch], with a one-block vision tower (bf16, `model.visual.*`)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from sglang_exl3.synth.qwen3_5_layout import TINY_VISION

    directory = Path(directory)
    ids = write_tokenizer(directory, TINY_COMMON["vocab_size"])
    text = {**TINY_COMMON, **TINY_ARCHS[text_arch], "bos_token_id": ids["bos"], "eos_token_id": ids["eos"],
            "pad_token_id": ids["pad"]}
    vision = {**TINY_VISION, "out_hidden_size": text["hidden_size"]}
    vocab = text["vocab_size"]
    config = AutoConfig.for_model(text_arch.removesuffix("_text"), text_config=text, vision_config=vision,
                                  image_token_id=vocab - 4, video_token_id=vocab - 3, vision_start_token_id=vocab - 6,
                                  vision_end_token_id=vocab - 5, tie_word_embeddings=False)
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16).save_pretrained(directory)
    cfg_path = directory / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["vision_config"].setdefault("deepstack_visual_indexes", [])  # exllamav3 requires the key
    cfg_path.write_text(json.dumps(cfg, indent=2))
    (directory / "preprocessor_config.json").write_text(json.dumps(_QWEN3_5_PREPROCESSOR, indent=2))
    return directory
