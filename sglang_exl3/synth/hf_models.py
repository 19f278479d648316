"""Tiny random-weight Hugging Face models (Llama, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4.5 MoE) for the
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
}


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
