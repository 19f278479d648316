"""What a speculative server must keep, checked against a running one: greedy output with speculation against greedy
output without it, and structured output under speculation through the three ways SGLang users ask for it (a regex
on /generate, the frontend DSL, the OpenAI `response_format`). One definition for the GPU check
(tests/gpu/spec_lossless.py) and the benchmark (benchmarks/spec_decode.py), so both hold a server to the same rule."""

from __future__ import annotations

import json
import re

from sglang_exl3.integration.routed_experts import first_routing_difference, routed_experts
from sglang_exl3.integration.server import post

# SGLang's logits are bf16, so two tokens' logprobs differ by a multiple of the logit's ulp: 1/32 for |logit| in
# [4, 8), 1/16 in [8, 16), 1/8 in [16, 32). Where the baseline's top two are at most two ulps of a logit below 16
# apart, their order is decided by rounding, and a verify pass (m = batch x draft tokens rows) or another prefill
# batch sums in another order. Measured on the trained 327M target (benchmarks/results/spec-decode-h200.json): every
# differing position of EAGLE3 on the EXL3 target and on its bf16 twin had a margin of 1/32, 1/16 or 1/8, a few
# at position 0, which comes from the prefill alone and is not touched by speculation.
TOL = 0.125
REGEX = r"[0-9]{3}"
# Bounded on purpose: every field closes after a few tokens whatever the model prefers (a random or small model
# never closes an unbounded string); servers run with --constrained-json-disable-any-whitespace.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "mood": {"enum": ["calm", "angry", "merry"]}},
          "required": ["name", "mood"], "additionalProperties": False}
SERVER_ARGS = ["--constrained-json-disable-any-whitespace"]


def output_tokens(result: dict) -> list[int]:
    """The generated ids, read from the logprobs both sides are asked for (one source for baseline and candidate)."""
    return [t[1] for t in result["meta_info"]["output_token_logprobs"]]


def compare(base: list[dict], spec: list[dict], moe: tuple[int, int] | None = None) -> dict:
    """Per prompt: identical, a near-tie (the first differing position had a baseline top-2 margin under TOL: the
    verify pass runs m = batch x draft tokens rows, whose fp16 sums may round differently), or a failure. With `moe`
    = (layers, top-k) and both runs' routed experts, a divergence after a token the two runs routed differently (a
    router near-tie decided by the same rounding, in some layer) is recorded under `after_routing_difference` with
    that token, not as a failure."""
    identical, near_ties, after_routing, failures = 0, [], [], []
    for i, (a, b) in enumerate(zip(base, spec, strict=True)):
        ta, tb = output_tokens(a), output_tokens(b)
        if ta == tb:
            identical += 1
            continue
        j = next((k for k in range(min(len(ta), len(tb))) if ta[k] != tb[k]), None)
        if j is None:  # one is a prefix of the other: a length difference is never a rounding near-tie
            j, margin = min(len(ta), len(tb)), float("inf")
        else:
            top = a["meta_info"]["output_top_logprobs"][j]
            margin = top[0][0] - top[1][0] if len(top) > 1 else float("inf")
        entry = {"prompt": i, "position": j, "margin": margin}
        if margin <= TOL:
            near_ties.append(entry)
            continue
        routed = _routed_differently_before(a, b, moe, j) if moe and margin != float("inf") else None
        if routed is not None:
            after_routing.append({**entry, "first_token_routed_differently": routed})
        else:
            failures.append(entry)
    out = {"identical": identical, "near_ties": near_ties, "failures": failures}
    if moe:
        out["after_routing_difference"] = after_routing
    return out


def _routed_differently_before(a: dict, b: dict, moe: tuple[int, int], j: int) -> int | None:
    """The first token (counted from the prompt's first) the two runs routed differently, if it is one the output
    position j depends on (tokens before prompt + j), else None; None also where a run returned no routes."""
    first, _ = first_routing_difference(routed_experts(a["meta_info"], *moe), routed_experts(b["meta_info"], *moe))
    if first is None:
        return None
    return first if first < a["meta_info"]["prompt_tokens"] + j else None  # output j is token prompt + j


def settle(check: dict) -> dict:
    """`check` (compare's output, possibly recorded under another TOL) re-split at the current TOL."""
    ties = [t for t in check.get("near_ties") or [] if isinstance(t, dict)]
    every = ties + list(check.get("failures") or [])
    return {**check, "near_ties": [e for e in every if e["margin"] <= TOL],
            "failures": [e for e in every if e["margin"] > TOL]}


def _schema_ok(text: str) -> bool:
    """The JSON's structure against SCHEMA. Raw control characters inside strings are accepted (strict=False):
    SGLang's grammar backend lets a byte-level tokenizer put them there, with or without speculation (seen on a
    random DeepSeek-V3 hybrid: spec-nextn-h200-deepseek_v3.json), and the check is about the grammar's state."""
    try:
        parsed = json.loads(text, strict=False)
    except ValueError:
        return False
    return (isinstance(parsed, dict) and set(parsed) == {"name", "mood"} and isinstance(parsed["name"], str)
            and len(parsed["name"]) <= 12 and parsed["mood"] in SCHEMA["properties"]["mood"]["enum"])


def dsl(base: str) -> dict:
    """The SGLang frontend DSL (`sgl.function`, `sgl.gen(regex=...)`) against the running server."""
    import sglang as sgl

    @sgl.function
    def person(s):
        s += "Name a person and their mood. " + sgl.gen("answer", max_tokens=48, temperature=0,
                                                          json_schema=json.dumps(SCHEMA))
        s += " The number is " + sgl.gen("number", max_tokens=8, temperature=0, regex=REGEX)

    state = person.run(backend=sgl.RuntimeEndpoint(base))
    return {"dsl_json_text": state["answer"], "dsl_json_ok": _schema_ok(state["answer"]),
            "dsl_regex_text": state["number"], "dsl_regex_ok": re.fullmatch(REGEX, state["number"]) is not None}


def structured(base: str) -> dict:
    """A regex and a JSON schema through /generate, the same through the DSL, the schema through the OpenAI
    `response_format`; each output must be valid. The texts are recorded to compare with the server without
    speculation."""
    regex = post(base + "/generate", {"text": "The number is", "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "regex": REGEX}})["text"]
    as_json = post(base + "/generate", {"text": "A person:", "sampling_params": {
        "max_new_tokens": 48, "temperature": 0, "json_schema": json.dumps(SCHEMA)}})["text"]
    chat = post(base + "/v1/chat/completions", {"model": "default", "max_tokens": 48, "temperature": 0,
                                                "messages": [{"role": "user", "content": "Describe a person."}],
                                                "response_format": {"type": "json_schema", "json_schema": {
                                                    "name": "person", "schema": SCHEMA}}})
    openai = chat["choices"][0]["message"]["content"]
    return {"regex_text": regex, "regex_ok": re.fullmatch(REGEX, regex) is not None, "json_text": as_json,
            "json_ok": _schema_ok(as_json), "response_format_text": openai, "response_format_ok": _schema_ok(openai),
            **dsl(base)}


def structured_ok(result: dict) -> bool:
    return all(v for k, v in result.items() if k.endswith("_ok"))
