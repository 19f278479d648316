"""Write a random EAGLE draft (`LlamaForCausalLMEagle`: one decoder layer fed by `fc([embedding, target hidden])`)
for a Llama-shaped target, in the layout SGLang's `llama_eagle.py` loads (names without the `model.` prefix).

Random weights make the draft's guesses poor, which is what a lossless check wants (most drafts rejected, the
target's verify pass deciding every token); accept rates need a trained draft. The embedding and lm_head come from
the target at SGLang's hand-over, so the draft stores an embedding only to satisfy the loader.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def write_eagle_draft(target: str | Path, out: str | Path, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    target, out = Path(target), Path(out)
    out.mkdir(parents=True, exist_ok=False)
    config = {k: v for k, v in json.loads((target / "config.json").read_text()).items()
              if k not in ("quantization_config", "hybrid_tr3_tail")}
    config.update(architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1, tie_word_embeddings=False)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    layer = {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
             "self_attn.o_proj": (hidden, q), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
             "mlp.down_proj": (hidden, inter)}
    tensors = {f"layers.0.{name}.weight": rand(*shape) for name, shape in layer.items()}
    tensors.update({"embed_tokens.weight": rand(vocab, hidden), "fc.weight": rand(hidden, 2 * hidden),
                    "fc.bias": torch.zeros(hidden, dtype=torch.bfloat16),
                    "layers.0.post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16)})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in target.iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy2(f, out / f.name)
    return out
