"""Entry point of `python -m sglang_exl3` (also installed as `sglang-exl3`)."""

from __future__ import annotations

import argparse
import sys


def _inspect(args: argparse.Namespace) -> int:
    from sglang_exl3.tools.inspect_checkpoint import inspect_checkpoint

    text, code = inspect_checkpoint(args.checkpoint, as_json=args.json, verbose=args.verbose)
    print(text)
    return code


def _dequantize(args: argparse.Namespace) -> int:
    from sglang_exl3.format import Exl3FormatError
    from sglang_exl3.tools.dequantize import dequantize_checkpoint

    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return _run_writer(lambda: dequantize_checkpoint(
        args.checkpoint, args.out, dtype=args.dtype, device=device, max_shard_bytes=int(args.max_shard_gib * 2**30),
        progress=not args.quiet), (Exl3FormatError, FileExistsError, ValueError), lambda summary: (
        f"wrote {args.out}: {summary['exl3_modules']} EXL3 modules dequantized to {summary['dtype']}, "
        f"{summary['plain_tensors']} tensors copied, {len(summary['shards'])} shard(s)"))


def _run_writer(write, errors: tuple, report) -> int:
    """Run a checkpoint writer: its summary printed, or its error on stderr with exit status 1."""
    try:
        summary = write()
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(report(summary))
    return 0


def _write_fixture(args: argparse.Namespace) -> int:
    from sglang_exl3.synth.exl3_writer import SHAPES, ModelDims, write_exl3_checkpoint

    if args.shape != "tiny" and SHAPES[args.shape][0] != args.arch:
        want = SHAPES[args.shape][0]
        raise SystemExit(f"--shape {args.shape} is a {want} shape; pass --arch {want}")
    dims = SHAPES[args.shape][1] if args.shape != "tiny" else ModelDims()
    from dataclasses import replace

    if args.kv_heads:
        dims = replace(dims, num_key_value_heads=args.kv_heads)
    if args.layers:
        dims = replace(dims, num_hidden_layers=args.layers)
    if args.r7:
        from sglang_exl3.synth.r7_writer import write_r7_checkpoint

        if args.arch != "qwen3_moe" or args.shape != "tiny" or args.rank_sliced_tp:
            raise SystemExit("--r7 writes the reference's R7 routed experts for --arch qwen3_moe --shape tiny "
                             "(not with --rank-sliced-tp)")
        write_r7_checkpoint(args.out, dims=dims, bits=int(args.bits), seed=args.seed, with_tokenizer=True,
                            quant_method="modelopt")
    elif args.rank_sliced_tp:
        from sglang_exl3.synth.rank_sliced_writer import write_rank_sliced_checkpoint

        if args.arch != "qwen3_moe" or args.shape != "tiny" or args.codebook != "mcg" or args.bits != int(args.bits):
            raise SystemExit("--rank-sliced-tp writes the reference's rank-sliced layout for --arch qwen3_moe "
                             "--shape tiny --codebook mcg with integer --bits")
        write_rank_sliced_checkpoint(args.out, dims=dims, bits=int(args.bits), tp=args.rank_sliced_tp,
                                     rotation_layout=args.rotation_layout, seed=args.seed, with_tokenizer=True)
    else:
        write_exl3_checkpoint(args.out, args.arch, dims=dims, bits=args.bits, codebook=args.codebook,
                              head_bits=args.head_bits, seed=args.seed, progress=True)
    print(f"wrote {args.out}")
    return 0


def _encode(args: argparse.Namespace) -> int:
    from sglang_exl3.tools.encode_checkpoint import encode_checkpoint

    encoder = None
    if args.device.startswith("cuda"):
        from sglang_exl3.kernels.cuda_encode import encode_tiles_cuda as encoder
    return _run_writer(lambda: encode_checkpoint(
        args.checkpoint, args.out, args.bits, args.codebook, args.head_bits, args.modules, args.device,
        progress=not args.quiet, encoder=encoder), (ValueError, FileExistsError), lambda summary: (
        f"wrote {args.out}: {summary['encoded']} linears encoded at {summary['bits']} bits ({summary['codebook']}), "
        f"{summary['plain']} modules copied"))


def _write_msrt_base(args: argparse.Namespace) -> int:
    from sglang_exl3.synth.msrt_base_writer import write_msrt_base

    print(f"wrote {write_msrt_base(args.source, args.out)}")
    return 0


def _stage_spec(text: str):
    """LABEL:K[:SCALE[:E1,E2,...]] -> StageSpec (argparse type)."""
    from sglang_exl3.synth.cartridge_writer import StageSpec

    parts = text.split(":")
    try:
        if not 2 <= len(parts) <= 4:
            raise ValueError
        experts = tuple(int(e) for e in parts[3].split(",")) if len(parts) == 4 else None
        return StageSpec(parts[0], int(parts[1]), float(parts[2]) if len(parts) > 2 else 16.0, experts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--stage wants LABEL:K[:SCALE[:E1,E2,...]], got {text!r}") from None


def _write_cartridge(args: argparse.Namespace) -> int:
    from sglang_exl3.format.cartridge_manifest import CartridgeError
    from sglang_exl3.format.cartridge_staging import stage_cartridge
    from sglang_exl3.synth.cartridge_writer import write_cartridge

    out = write_cartridge(args.base, args.out, args.stage, layers=args.layers, experts=args.experts,
                          layout=args.layout, world_size=args.world_size, seed=args.seed, assembly=args.assembly)
    try:  # what a server will check first: refuse to leave a cartridge it would refuse
        stage_cartridge(out, runtime_tp=args.world_size if args.layout == "rank-sharded" else None).discard()
    except CartridgeError as e:
        import shutil

        shutil.rmtree(out)
        print(f"error: the written cartridge does not validate: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from sglang_exl3.integration.demo import run_demo

    return run_demo(port=args.port, workdir=args.workdir)


def _build_kernels(args: argparse.Namespace) -> int:
    from sglang_exl3.kernels.library import KernelLibraryUnavailable, build_library

    try:
        path = build_library(out=args.out, arch=args.arch, verbose=args.verbose, only_4bit_mcg=args.only_4bit_mcg,
                             jobs=args.jobs)
    except (KernelLibraryUnavailable, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"built {path}")
    return 0


def _positive_int(text: str) -> int:
    """argparse type for counts that override a shape (0 = keep the shape's own is the option's default)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_exl3", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="summarise and validate an EXL3 checkpoint (exit 1 on any problem)")
    i.add_argument("checkpoint")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.add_argument("--verbose", "-v", action="store_true", help="list every module even for large models")
    i.set_defaults(func=_inspect)
    d = sub.add_parser("dequantize", help="write a plain Hugging Face checkpoint with every EXL3 weight decoded")
    d.add_argument("checkpoint")
    d.add_argument("out", help="output folder (must not exist or be empty)")
    d.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    d.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    d.add_argument("--max-shard-gib", type=float, default=4.0)
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    d.set_defaults(func=_dequantize)
    w = sub.add_parser("write-fixture", help="write a random-trellis EXL3 checkpoint in exllamav3's layout")
    w.add_argument("out")
    w.add_argument("--arch", choices=["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral"], default="llama")
    w.add_argument("--shape", choices=["tiny", "llama3-8b", "qwen3-30b-a3b", "llama-spec-target"], default="tiny",
                   help="real model dimensions (random trellis) for benchmarks; tiny for tests")
    w.add_argument("--bits", type=float, default=4)
    w.add_argument("--head-bits", type=float, default=6)
    w.add_argument("--codebook", choices=["mul1", "mcg", "3inst"], default="mul1")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--kv-heads", type=_positive_int, default=0,
                   help="override the shape's KV-head count (1: tp > KV heads)")
    w.add_argument("--layers", type=_positive_int, default=0,
                   help="override the shape's layer count (1: a one-layer model for per-layer benchmarks)")
    w.add_argument("--rank-sliced-tp", type=int, default=0,
                   help="write routed experts in the reference's rank-sliced layout (hybrid_tr3_tail) for this TP")
    w.add_argument("--rotation-layout", choices=["per_expert_v1", "shared_h_v1"], default="per_expert_v1")
    w.add_argument("--r7", action="store_true",
                   help="write routed experts as R7 (quantization_config.r7_routed_experts: per-projection K3/K4/K5, "
                        "shared hidden-side rotations) under a modelopt label, as the reference's R7 checkpoints")
    w.set_defaults(func=_write_fixture)
    e = sub.add_parser("encode", help="rewrite a BF16 / FP16 checkpoint as EXL3 with the uncalibrated trellis "
                       "encoder (--device cuda for anything but small models)")
    e.add_argument("checkpoint")
    e.add_argument("out", help="output folder (must not exist or be empty)")
    e.add_argument("--bits", type=int, choices=range(1, 9), default=4)
    e.add_argument("--codebook", choices=["mcg", "mul1", "3inst"], default="mcg")
    e.add_argument("--head-bits", type=int, choices=range(1, 9), default=None,
                   help="encode the lm_head too (default: keep it as it is)")
    e.add_argument("--modules", default=None, help="regex: encode only the decoder linears whose key matches")
    e.add_argument("--device", default="cpu", help="where the encoder runs (cuda: much faster)")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.set_defaults(func=_encode)
    mb = sub.add_parser("write-msrt-base", help="rewrite a rank-sliced checkpoint of tp=1 as an exl3-msrt-base/1 "
                        "cartridge base (closed profile, compatibility digests)")
    mb.add_argument("source")
    mb.add_argument("out")
    mb.set_defaults(func=_write_msrt_base)
    c = sub.add_parser("write-cartridge", help="write an fq-cartridge-adapter/3 expert cartridge of random residual "
                       "stages for an exl3-msrt-base/1 base (tests, benchmarks)")
    c.add_argument("base")
    c.add_argument("out")
    c.add_argument("--stage", action="append", type=_stage_spec, required=True,
                   help="LABEL:K[:SCALE[:E1,E2,...]], in chain order (scale default 16, experts default all)")
    c.add_argument("--layers", type=int, nargs="+", default=None, help="layers to cover (default: every base layer)")
    c.add_argument("--experts", type=int, nargs="+", default=None, help="selected experts (default: all)")
    c.add_argument("--layout", choices=["full", "rank-sharded"], default="full")
    c.add_argument("--world-size", type=int, default=1, help="ranks of a rank-sharded layout")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--assembly", default="synthetic", help="the cartridge's label")
    c.set_defaults(func=_write_cartridge)
    b = sub.add_parser("build-kernels", help="compile the EXL3 CUDA kernels with nvcc (once per GPU arch)")
    b.add_argument("--arch", default=None, help="e.g. 90 or sm_90 (default: this GPU's, else 90)")
    b.add_argument("--out", default=None, help="where to write the .so (default: the per-user cache, which the "
                   "server finds; elsewhere, point SGLANG_EXL3_KERNEL_LIB at it)")
    b.add_argument("--verbose", action="store_true", help="print ptxas register and spill reports")
    b.add_argument("--only-4bit-mcg", action="store_true", help="kernel development: the 4-bit MCG variant of every "
                   "kernel only (docs/kernels.md gives the build times); needs --out, and never serves other bitrates")
    b.add_argument("--jobs", type=int, default=None, help="units compiled at once (default: the CPU count)")
    b.set_defaults(func=_build_kernels)
    m = sub.add_parser("demo", help="serve a small EXL3 model with SGLang and chat with it (needs a GPU)")
    m.add_argument("--port", type=int, default=30117)
    m.add_argument("--workdir", default=None, help="where to write the checkpoint and the server log")
    m.set_defaults(func=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
