"""A decoder layer's EXL3 linears and glue, fused (SGLANG_EXL3_FUSED_DECODER's launches) against unfused (what a
layer runs today: SGLang's RMSNorm and SiluAndMul modules around our kernels), beside the same layer in bf16
(cuBLAS), side by side at decode-sized m: at one row the one-launch linears with and without the glue as their
prologues (`form` one-row), from two rows the group kernels with and without the glue folded into the rotations.
The attention is left out on every side: the q/k/v output's first hidden-width columns stand in for its output (one
copy kernel on each side). CUDA-graph replay, two layers' weights alternating (each more than L2); the fused output
is checked against the unfused one.

  python benchmarks/fused_layer_ab.py [--shape 4096,14336,1024] [--ms 1,2,8,16,32,64] [--bits 4] [--codebook mcg]

Needs SGLang (its RMSNorm / SiluAndMul kernels). Writes benchmarks/results/fused-layer-ab-<gpu>.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import graph_us, header, publish_sglang_args, write_results  # noqa: E402
from sglang_exl3.format import Codebook  # noqa: E402
from sglang_exl3.kernels import cuda_trellis as ck  # noqa: E402
from sglang_exl3.kernels import fused_layer as fl  # noqa: E402

EPS = 1e-5


def _source(k: int, n: int, bits: int, gen: torch.Generator):
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, bits * 16), generator=gen, dtype=torch.int16)
    return ck.prepare(trellis.cuda()), (torch.randn(k, generator=gen) * 0.1).half().cuda(), \
        (torch.randn(n, generator=gen) * 0.1).half().cuda()


def make_layer(hidden: int, inter: int, kv: int, bits: int, cb: Codebook, seed: int) -> dict:
    """One layer's EXL3 projections as groups (o and down also as the single-linear tensors the unfused path runs),
    its norms' weights and a bf16 layer of the same shape."""
    gen = torch.Generator().manual_seed(seed)

    def group(k: int, widths: tuple[int, ...]):
        srcs = [_source(k, n, bits, gen) for n in widths]
        return ck.make_group(*[[s[i] for s in srcs] for i in range(3)], cb), srcs

    layer, sources = {}, {}
    for name, k, widths in (("qkv", hidden, (hidden, kv, kv)), ("o", hidden, (hidden,)),
                            ("gate_up", hidden, (inter, inter)), ("down", inter, (hidden,))):
        layer[name], sources[name] = group(k, widths)
    layer["o_src"], layer["down_src"] = sources["o"][0], sources["down"][0]
    # the one-launch forms of the same weights, for the rows they serve (one_row_forward's linears)
    layer["one"] = {name: ck.make_one_launch(*[[s[i] for s in srcs] for i in range(3)], cb)
                    for name, srcs in sources.items()}
    layer["norms"] = [(1 + 0.1 * torch.randn(hidden, generator=gen)).bfloat16().cuda() for _ in range(2)]
    dense = {"qkv": hidden + 2 * kv, "o": hidden, "gate_up": 2 * inter, "down": hidden}
    layer["bf16"] = {name: torch.randn(n, inter if name == "down" else hidden, dtype=torch.bfloat16, device="cuda")
                     * 0.02 for name, n in dense.items()}
    return layer


def unfused(layer: dict, norm, act, h: torch.Tensor, residual: torch.Tensor, cb: Codebook) -> torch.Tensor:
    hidden = h.shape[1]
    x, _ = norm(layer["norms"][0])(h, residual)
    qkv = ck.group_linear(x, layer["qkv"])
    o = ck.exl3_linear(qkv[:, :hidden].contiguous(), *layer["o_src"], cb)
    x, _ = norm(layer["norms"][1])(o, residual)
    return ck.exl3_linear(act(ck.group_linear(x, layer["gate_up"])), *layer["down_src"], cb)


def fused(layer: dict, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    m, hidden = h.shape
    xh = fl.add_norm_rotate(layer["qkv"], layer["norms"][0], EPS, h=h, residual=residual)
    qkv = fl.group_from_rotated(layer["qkv"], xh)
    partial = fl.group_partials(layer["o"], x=qkv[:, :hidden].contiguous())
    xh = fl.add_norm_rotate(layer["gate_up"], layer["norms"][1], EPS, residual=residual, h_group=layer["o"],
                            partial=partial, m=m)
    xh = fl.mlp_mid(fl.group_partials(layer["gate_up"], xh=xh), layer["gate_up"], layer["down"], m)
    return fl.group_from_rotated(layer["down"], xh)


def unfused_one_row(layer: dict, norm, act, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """What a layer runs today at the rows the one-launch linears serve."""
    one, hidden = layer["one"], h.shape[1]

    def linear(name: str, x: torch.Tensor) -> torch.Tensor:
        return ck.one_launch_linear(x, one[name].group, one[name].counters)

    x, _ = norm(layer["norms"][0])(h, residual)
    o = linear("o", linear("qkv", x)[:, :hidden].contiguous())
    x, _ = norm(layer["norms"][1])(o, residual)
    return linear("down", act(linear("gate_up", x)))


def fused_one_row(layer: dict, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """one_row_forward's launches: the norms and SiLU-and-mul as the one-launch linears' prologues."""
    one, hidden = layer["one"], h.shape[1]
    first, second = torch.empty_like(residual), torch.empty_like(residual)
    qkv = fl.one_launch_prologue(h, one["qkv"].group, one["qkv"].counters, fl.X_ADD_NORM, residual=residual,
                                 residual_out=first, weight=layer["norms"][0], eps=EPS)
    o = ck.one_launch_linear(qkv[:, :hidden].contiguous(), one["o"].group, one["o"].counters)
    gate_up = fl.one_launch_prologue(o, one["gate_up"].group, one["gate_up"].counters, fl.X_ADD_NORM, residual=first,
                                     residual_out=second, weight=layer["norms"][1], eps=EPS)
    return fl.one_launch_prologue(gate_up, one["down"].group, one["down"].counters, fl.X_ACT_MUL)


def _calls(layers: list[dict], norm, act, h: torch.Tensor, residual: torch.Tensor, cb: Codebook, one_row: bool):
    """(today's layer, the fused one) as fn(i) over layer i; h is copied per call, as SGLang's fused add + norm
    normalises it in place."""
    if one_row:
        return (lambda i: unfused_one_row(layers[i], norm, act, h.clone(), residual),
                lambda i: fused_one_row(layers[i], h.clone(), residual))
    return (lambda i: unfused(layers[i], norm, act, h.clone(), residual, cb),
            lambda i: fused(layers[i], h.clone(), residual))


def bf16_layer(layer: dict, norm, act, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    w, hidden = layer["bf16"], h.shape[1]
    x, _ = norm(layer["norms"][0])(h, residual)
    o = (x @ w["qkv"].T)[:, :hidden].contiguous() @ w["o"].T
    x, _ = norm(layer["norms"][1])(o, residual)
    return act(x @ w["gate_up"].T) @ w["down"].T


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="4096,14336,1024", help="hidden,intermediate,kv width (Llama-3-8B)")
    ap.add_argument("--ms", default="1,2,8,16,32,64")
    ap.add_argument("--one-row-max-m", type=int, default=1, help="rows the one-row form takes (ONE_LAUNCH_MAX_M)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--codebook", default="mcg")
    args = ap.parse_args()
    publish_sglang_args()
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm

    hidden, inter, kv = (int(v) for v in args.shape.split(","))
    cb = Codebook.from_label(args.codebook)
    layers = [make_layer(hidden, inter, kv, args.bits, cb, seed) for seed in (1, 2)]
    norms: dict[int, RMSNorm] = {}

    def norm(weight: torch.Tensor) -> RMSNorm:  # SGLang's module around the layer's weight (its fused add + norm)
        if id(weight) not in norms:
            module = RMSNorm(hidden, eps=EPS).cuda().to(torch.bfloat16)
            module.weight.data = weight
            norms[id(weight)] = module
        return norms[id(weight)]

    act = SiluAndMul()
    rows = []
    for m in (int(v) for v in args.ms.split(",")):
        gen = torch.Generator().manual_seed(m)
        h = torch.randn(m, hidden, generator=gen).bfloat16().cuda()
        residual = (torch.randn(m, hidden, generator=gen) * 4).bfloat16().cuda()
        one_row = m <= args.one_row_max_m  # the one-launch linears' rows: the one-row form
        if not one_row and not all(layers[0][p].runs_fused(m) for p in ("qkv", "o", "gate_up", "down")):
            print(f"m={m}: a group does not run it fused; the fused layer would not serve it", flush=True)
            continue
        form = "one-row" if one_row else "groups"
        want = _calls(layers, norm, act, h, residual.clone(), cb, one_row)[0](0)  # each on its own residual:
        got = _calls(layers, norm, act, h, residual.clone(), cb, one_row)[1](0)  # the norms update it in place
        today, ours = _calls(layers, norm, act, h, residual, cb, one_row)
        rel = float((got.float() - want.float()).norm() / want.float().norm())
        if not rel < 2e-2:
            raise AssertionError(f"m={m}: the fused layer differs from the unfused one, rel {rel:.2e}")
        row = {"m": m, "form": form, "rel_vs_unfused": round(rel, 5), "unfused_us": graph_us(today, 2),
               "fused_us": graph_us(ours, 2),
               "bf16_us": graph_us(lambda i, h=h, r=residual: bf16_layer(layers[i], norm, act, h.clone(), r), 2)}
        row["fused_speedup"] = round(row["unfused_us"] / row["fused_us"], 3)
        row["bf16_vs_fused"] = round(row["bf16_us"] / row["fused_us"], 3)
        rows.append(row)
        print(row, flush=True)
    path = write_results("fused-layer-ab", {**header(sys.argv), "shape": args.shape, "bits": args.bits,
                                            "codebook": cb.label}, rows,
                         ["m", "form", "unfused_us", "fused_us", "fused_speedup", "bf16_us", "bf16_vs_fused",
                          "rel_vs_unfused"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
