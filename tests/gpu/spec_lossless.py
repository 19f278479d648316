"""Speculative decoding on an EXL3 target is lossless: greedy output with each algorithm equals greedy output without
speculation, token for token, served by SGLang with CUDA graphs on. Also structured output under speculation
(sglang_exl3/integration/spec_checks.py: regex and JSON schema through /generate, the frontend DSL and the OpenAI
`response_format`) must stay valid.

Per algorithm one server: NGRAM (no draft), EAGLE (a random BF16 draft, `synth/eagle_writer.py`: the target's EXL3
lm_head and embedding are shared with it at SGLang's hand-over), STANDALONE (the target itself as an EXL3 draft, an
upper bound on acceptance). A token may differ only where the baseline's top two were within TOL (the verify pass
runs m = batch x draft tokens rows, whose fp16 sums may round differently), or, on an MoE target, after a token the
two servers routed to different experts (both return their routes: the same rounding decides a router near-tie);
every such place is recorded.
Accept length = completion tokens / verify passes. Writes OUT/spec-lossless.json; exits non-zero on a failure.

  python tests/gpu/spec_lossless.py OUT --target CKPT [--algorithms NGRAM,EAGLE,STANDALONE]
  python tests/gpu/spec_lossless.py OUT --target MTP-CKPT --algorithms NEXTN    (a checkpoint with its MTP layer)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from sglang_exl3.integration.routed_experts import moe_shape  # noqa: E402
from sglang_exl3.integration.server import launch, post, stop, wait_ready  # noqa: E402
from sglang_exl3.integration.spec_checks import SERVER_ARGS, TOL, compare, structured, structured_ok  # noqa: E402

PROMPTS, NEW_TOKENS = 24, 48
SPEC = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]


def prompts() -> list[list[int]]:
    import random

    rng = random.Random(19)
    # repeated spans give NGRAM something to match
    out = []
    for _ in range(PROMPTS):
        span = [rng.randrange(5, 1000) for _ in range(rng.randrange(4, 12))]
        out.append((span * 6)[: rng.randrange(16, 64)])
    return out


def greedy(base: str, top: bool, routed: bool = False) -> list[dict]:
    payload = {"input_ids": prompts(), "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                                           "ignore_eos": True}, "return_routed_experts": routed}
    if top:
        payload.update(return_logprob=True, top_logprobs_num=2)
    return post(base + "/generate", payload, timeout=600)


def serve(path: Path, port: int, extra: list[str], log: Path) -> tuple[object, str, float]:
    t0 = time.time()
    proc = launch(path, port, ["--quantization", "exl3", "--mem-fraction-static", "0.3",
                               "--cuda-graph-max-bs-decode", "32", *SERVER_ARGS, *extra], log_path=log)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, proc)
    return proc, base, time.time() - t0


def main() -> int:
    from sglang_exl3.synth.eagle_writer import write_eagle_draft

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--target", required=True)
    ap.add_argument("--algorithms", default="NGRAM,EAGLE,STANDALONE")
    args = ap.parse_args()
    out, target = Path(args.out), Path(args.target)
    out.mkdir(parents=True, exist_ok=True)
    draft = Path("/tmp/spec-eagle-draft")
    if "EAGLE" in args.algorithms.split(",") and not draft.exists():
        write_eagle_draft(target, draft)
    algorithms = {"NGRAM": ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4"],
                  "EAGLE": ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(draft), *SPEC],
                  # the checkpoint's own MTP layer (synth/nextn_writer.py for DeepSeek-V3 / GLM-4.5 hybrids)
                  "NEXTN": ["--speculative-algorithm", "NEXTN", *SPEC],
                  "STANDALONE": ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
                                 str(target), *SPEC]}
    report = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "target": str(target), "prompts": PROMPTS, "new_tokens": NEW_TOKENS, "tolerance_nats": TOL,
              "spec_args": SPEC, "runs": {}}
    ok = True
    moe = moe_shape(target)
    routed = ["--enable-return-routed-experts"] if moe else []
    proc, base, ready = serve(target, 34000, routed, out / "server-baseline.log")
    try:
        want = greedy(base, top=True, routed=bool(moe))
        report["runs"]["none"] = {"ready_s": ready, "structured": structured(base)}
    finally:
        stop(proc)
    for i, name in enumerate(a for a in args.algorithms.split(",") if a):
        entry = report["runs"].setdefault(name, {})
        try:
            proc, base, entry["ready_s"] = serve(target, 34001 + i, [*routed, *algorithms[name]],
                                                 out / f"server-{name}.log")
            try:
                got = greedy(base, top=True, routed=bool(moe))
                entry.update(compare(want, got, moe))
                verify = sum(o["meta_info"].get("spec_verify_ct", 0) or 0 for o in got)
                tokens = sum(o["meta_info"]["completion_tokens"] for o in got)
                entry["accept_length"] = tokens / verify if verify else None
                entry["structured"] = structured(base)
            finally:
                stop(proc)
            entry["lossless"] = not entry["failures"]
            got_s, want_s = entry["structured"], report["runs"]["none"]["structured"]
            got_s["response_format_same"] = got_s["response_format_text"] == want_s["response_format_text"]
            passed = entry["lossless"] and structured_ok(got_s)
        except Exception as e:  # noqa: BLE001 - recorded in the evidence, then the run fails
            entry["error"] = f"{type(e).__name__}: {e}"
            passed = False
        ok &= passed
        print(name, "PASS" if passed else "FAIL", json.dumps({k: v for k, v in entry.items()
                                                              if k in ("identical", "accept_length", "error")}),
              f"near_ties={len(entry.get('near_ties', []))} failures={len(entry.get('failures', []))}",
              f"after_routing_difference={len(entry.get('after_routing_difference', []))}",
              json.dumps({k: v for k, v in entry.get("structured", {}).items() if k.endswith(("_ok", "_same"))}),
              flush=True)
        (out / "spec-lossless.json").write_text(json.dumps({**report, "passed": ok}, indent=1))
    report["passed"] = ok
    (out / "spec-lossless.json").write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
