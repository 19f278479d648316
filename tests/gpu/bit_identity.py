"""The dense and MoE outputs of two builds on the same inputs, bit for bit: `record OUT` runs every entry point the
layers call (exl3_linear by its dispatch, the group op, the one-launch op, the MoE decode, per-pair and sorted
forwards) over seeded random weights and activations at the row counts serving reaches, and saves the outputs;
`compare A B` says which differ. Run `record` once with each build on the same GPU (PYTHONPATH selects the package,
SGLANG_EXL3_KERNEL_LIB its library), then `compare`.

The package of commit 3f2eadf (one CUDA file, `kernels/cuda_trellis.py`) and the split one are both read: the names
below are looked up in either layout, so a refactor of the kernel layout is checked against the build before it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sglang_exl3.format.constants import Codebook

DENSE_MS = (1, 2, 3, 4, 8, 12, 16, 24, 32, 33, 48, 64, 96, 128, 192, 256, 512)
GROUP_MS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256)
MOE_MS = (1, 2, 4, 8, 16, 32, 64, 128, 512)
# (K, N) of single linears, (K, [N...]) of same-input groups: Llama-3-8B's o, down, q/k/v and gate/up at TP 1
DENSE_SHAPES = ((4096, 4096), (14336, 4096), (4096, 1024))
GROUP_SHAPES = ((4096, (4096, 1024, 1024)), (4096, (14336, 14336)))
BITS = ((2, Codebook.MUL1), (3, Codebook.MCG), (4, Codebook.MCG), (4, Codebook.MUL1), (4, Codebook.INST3),
        (5, Codebook.MUL1), (6, Codebook.MCG), (8, Codebook.MUL1), (2.5, Codebook.MUL1))


def kernel_api():
    """The entry points, from the split modules or from the single module of 3f2eadf."""
    try:
        dense, groups = importlib.import_module("sglang_exl3.kernels.dense"), importlib.import_module(
            "sglang_exl3.kernels.groups")
        tables, ops = importlib.import_module("sglang_exl3.kernels.moe_tables"), importlib.import_module(
            "sglang_exl3.kernels.moe_ops")
        api = {"prepare": dense.prepare, "exl3_linear": dense.exl3_linear, "make_group": groups.make_group,
               "make_one_launch": groups.make_one_launch, "make_expert_bank": tables.make_expert_bank,
               "moe_decode": ops.moe_decode, "decode_counters": ops.decode_counters,
               "flat_routing_ids": tables.flat_routing_ids}
        layout = "split"
    except ImportError:
        ck = importlib.import_module("sglang_exl3.kernels.cuda_trellis")
        api = {name: getattr(ck, name) for name in ("prepare", "exl3_linear", "make_group", "make_one_launch",
                                                     "make_expert_bank", "moe_decode", "decode_counters",
                                                     "flat_routing_ids")}
        layout = "single"
    api["sorted_moe"] = importlib.import_module("sglang_exl3.kernels.moe_sorted").sorted_moe
    api["routed_moe"] = importlib.import_module("sglang_exl3.kernels.moe_routed").routed_moe
    return api, layout


def random_linear(k: int, n: int, bits: float, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Checkpoint-layout trellis [K/16, N/16, 16 * bits] (any bits are a valid trellis) and +-1 sign scales."""
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, int(16 * bits)), generator=gen, dtype=torch.int32)
    signs = lambda size: (torch.randint(0, 2, (size,), generator=gen) * 2 - 1).half()  # noqa: E731
    return trellis.to(torch.int16), signs(k), signs(n)


def activations(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(m, k, generator=gen).bfloat16()


def record(out: Path) -> None:
    import sglang_exl3.kernels.ops  # noqa: F401 - registers torch.ops.exl3.*

    api, layout = kernel_api()
    results: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(2026)
    dev = torch.device("cuda")

    def keep(name: str, y: torch.Tensor) -> None:
        torch.cuda.synchronize()
        results[name] = y.detach().contiguous().cpu()

    for k, n in DENSE_SHAPES:
        for bits, cb in BITS:
            trellis, suh, svh = random_linear(k, n, bits, gen)
            tiles, suh, svh = api["prepare"](trellis.to(dev)), suh.to(dev), svh.to(dev)
            for m in DENSE_MS:
                x = activations(m, k, gen).to(dev)
                keep(f"linear/{k}x{n}/{bits}b-{cb.name}/m{m}", api["exl3_linear"](x, tiles, suh, svh, cb))
    for k, widths in GROUP_SHAPES:
        for bits, cb in ((4, Codebook.MUL1), (3, Codebook.MCG)):
            parts = [random_linear(k, n, bits, gen) for n in widths]
            tiles = [api["prepare"](t.to(dev)) for t, _, _ in parts]
            suh, svh = [s.to(dev) for _, s, _ in parts], [v.to(dev) for _, _, v in parts]
            group = api["make_group"](tiles, suh, svh, cb)
            one = api["make_one_launch"](tiles, suh, svh, cb)
            tag = f"{k}x{'+'.join(map(str, widths))}/{bits}b-{cb.name}"
            for m in GROUP_MS:
                x = activations(m, k, gen).to(dev)
                keep(f"group/{tag}/m{m}", torch.ops.exl3.gemm_group(x, tiles, suh, svh, group.table, group.meta,
                                                                     group.codebook))
                if m <= 16 and one is not None:
                    keep(f"one_launch/{tag}/m{m}", torch.ops.exl3.one_launch(x, one.group.table, one.counters,
                                                                             one.group.meta, one.group.codebook))
    record_moe(api, keep, gen, dev)
    save_file(results, str(out), metadata={"layout": layout, "gpu": torch.cuda.get_device_name()})
    print(json.dumps({"recorded": len(results), "layout": layout, "out": str(out)}))


def record_moe(api, keep, gen: torch.Generator, dev: torch.device) -> None:
    """A Qwen3-30B-A3B-shaped layer (hidden 2048, intermediate 768, 128 experts, top-8) at 4 bits MUL1."""
    hidden, inter, experts, topk = 2048, 768, 128, 8
    banks = []
    for k, n in ((hidden, inter), (hidden, inter), (inter, hidden)):
        parts = [random_linear(k, n, 4, gen) for _ in range(experts)]
        banks.append(api["make_expert_bank"]([api["prepare"](t.to(dev)) for t, _, _ in parts],
                                             [s.to(dev) for _, s, _ in parts], [v.to(dev) for _, _, v in parts],
                                             Codebook.MUL1))
    gate, up, down = banks
    counters = api["decode_counters"](64 * topk, 64, hidden, inter, dev)
    for m in MOE_MS:
        x = activations(m, hidden, gen).to(dev)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(m)]).to(torch.int32).to(dev)
        w = torch.rand(m, topk, generator=gen).to(dev)
        if m <= 64:
            flat = api["flat_routing_ids"](ids)
            keep(f"moe_decode/m{m}", api["moe_decode"](x, flat, w.reshape(-1), gate, up, down, topk, False, counters,
                                                       out_dtype=torch.bfloat16))
            keep(f"moe_routed/m{m}", api["routed_moe"](x, ids, w, gate, up, down, False))
        keep(f"moe_sorted/m{m}", api["sorted_moe"](x, ids, w, gate, up, down, False))


def compare(a: Path, b: Path) -> int:
    ra, rb = load_file(str(a)), load_file(str(b))
    missing = sorted(set(ra) ^ set(rb))
    differ = []
    for name in sorted(set(ra) & set(rb)):
        ta, tb = ra[name], rb[name]
        same = ta.shape == tb.shape and ta.dtype == tb.dtype and torch.equal(ta.view(torch.uint8), tb.view(torch.uint8))
        if not same:
            gap = (ta.float() - tb.float()).abs().max().item() if ta.shape == tb.shape else float("nan")
            differ.append((name, gap))
    report = {"compared": len(set(ra) & set(rb)), "identical": len(set(ra) & set(rb)) - len(differ),
              "differ": differ[:50], "only_in_one": missing[:50]}
    print(json.dumps(report, indent=1))
    return 0 if not differ and not missing else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "record":
        record(args.out)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
