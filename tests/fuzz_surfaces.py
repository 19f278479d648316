"""Generated malformed inputs for every surface that reaches the project from outside, and the rule they must keep:
each case either loads or raises the project's own named error (the file, module, tensor, knob or key in its
message); no other exception, no hang, nothing written.

Surfaces: `config.json`, `quantization_config.json` (tensor_storage), safetensors shards and their index,
rank-sliced metadata (`hybrid_tr3_tail` and its `bits_per_expert` file), and the SGLANG_EXL3_* knobs. Each case
mutates a valid input (an exllamav3-made checkpoint, a rank-sliced fixture from the project's writer, a valid knob
set) with hypothesis and runs the real entry point: `load_checkpoint`, `rank_sliced.parse`, `knobs.validate_all`.

Used by tests/test_fuzz.py (1,000 cases per surface in CI) and benchmarks/fuzz.py (a larger run and the table in
benchmarks/results/fuzz.{json,md}).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import struct
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from sglang_exl3 import knobs
from sglang_exl3.format import Exl3FormatError, load_checkpoint
from sglang_exl3.format.rank_sliced import (
    SHARED_H_SCHEMA,
    TENSOR_SCHEMA,
    RankSlicedError,
    normalize_weight_name,
    parse,
)

DATA = Path(__file__).parent / "data" / "exllamav3"
DENSE = DATA / "tiny-llama-mul1-4bpw"
CASE_SECONDS = 10  # a case that runs longer counts as a hang
NAMED_ERRORS = (Exl3FormatError, RankSlicedError, knobs.KnobError)


class Hang(Exception):
    pass


@dataclass
class Tally:
    """What the cases of one surface did."""

    cases: int = 0
    loaded: int = 0
    named_errors: int = 0
    other_exceptions: int = 0
    hangs: int = 0
    wrote_files: int = 0
    errors: Counter = field(default_factory=Counter)  # named-error message shapes seen
    others: list[str] = field(default_factory=list)  # first lines of anything else

    def row(self, surface: str) -> dict:
        return {"surface": surface, "cases": self.cases, "loaded": self.loaded, "named_errors": self.named_errors,
                "other_exceptions": self.other_exceptions, "hangs": self.hangs, "wrote_files": self.wrote_files,
                "distinct_named_errors": len(self.errors), "others": self.others[:10]}


# -- JSON mutations ---------------------------------------------------------------------------------------------

JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                      st.text(max_size=12), st.sampled_from(["exl3", "mcg", "mul1", "3inst", "mixed", "torch.int16",
                                                             "", "..", "/etc/passwd", "F16", "I16"]))
JSON_VALUE = st.recursive(JSON_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                          max_leaves=8)


def _paths(doc, prefix=()):
    """Every (path to a value) in a JSON document."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


def _apply(doc, path, op: str, value):
    """Replace, delete or add at `path` (the root is replaced by `value` for every op)."""
    if not path:
        return value
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    if op == "delete":
        del parent[last]
    elif op == "add" and isinstance(parent, dict):
        parent[f"{last}_extra"] = value
    else:
        parent[last] = value
    return doc


@st.composite
def mutated_json(draw, base, focus: tuple = (), edits: int = 3):
    """`base` with up to `edits` random replacements, deletions or additions, drawn under `focus` where it exists."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, edits))):
        paths = [p for p in _paths(doc) if p[:len(focus)] == focus] or list(_paths(doc))
        path = draw(st.sampled_from(paths))
        doc = _apply(doc, path, draw(st.sampled_from(["replace", "delete", "add"])), draw(JSON_VALUE))
    return doc


RAW_TEXT = st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode), st.just(b""),
                     st.just(b"{\"a\": "), st.just(b"\xff\xfe{}"))


def _document(draw, base, focus=()) -> bytes:
    """Mostly a mutated JSON document, sometimes raw bytes instead."""
    if draw(st.integers(0, 9)) == 0:
        return draw(RAW_TEXT)
    return json.dumps(draw(mutated_json(base, focus))).encode()


# -- the cases --------------------------------------------------------------------------------------------------


def _snapshot(folder: Path) -> dict:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def run_case(tally: Tally, fn: Callable[[], object], folder: Path | None = None, raise_other: bool = False) -> None:
    """Run one case under a time limit and file its outcome."""
    before = _snapshot(folder) if folder else None

    def on_alarm(*_):
        raise Hang()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
    tally.cases += 1
    try:
        fn()
        tally.loaded += 1
    except NAMED_ERRORS as e:
        tally.named_errors += 1
        tally.errors[_shape(str(e))] += 1
    except Hang:
        tally.hangs += 1
        if raise_other:
            raise
    except Exception as e:  # noqa: BLE001 - counting exactly these is the point
        tally.other_exceptions += 1
        tally.others.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        if raise_other:
            raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if folder and _snapshot(folder) != before:
        tally.wrote_files += 1
        if raise_other:
            raise AssertionError(f"the case wrote into {folder}")


def _shape(message: str) -> str:
    """A named error's message with names and numbers blurred, to count distinct kinds."""
    import re

    first = message.splitlines()[1] if "\n" in message else message
    return re.sub(r"'[^']*'|\"[^\"]*\"|[\w.]*\d[\w.]*", "_", first)[:120]


class Workspace:
    """A scratch folder per case: the base checkpoint's files hard-linked (nothing copied), one file replaced."""

    def __init__(self, base: Path):
        self.base = base
        self.root = Path(tempfile.mkdtemp(prefix="exl3-fuzz-"))
        self.n = 0

    def case(self, replaced: dict[str, bytes]) -> Path:
        self.n += 1
        folder = self.root / f"c{self.n}"
        folder.mkdir()
        for f in self.base.iterdir():
            if f.is_file() and f.name not in replaced:
                os.link(f, folder / f.name)
        for name, data in replaced.items():
            if data is not None:
                (folder / name).write_bytes(data)
        return folder

    def done(self, folder: Path) -> None:
        shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _load(folder: Path) -> Callable[[], object]:
    return lambda: load_checkpoint(folder)


# -- surfaces ----------------------------------------------------------------------------------------------------


def surface_config(ws: Workspace):
    base = json.loads((DENSE / "config.json").read_text())

    @st.composite
    def case(draw):
        return _document(draw, base, draw(st.sampled_from([(), ("quantization_config",)])))

    return case(), lambda data: {"config.json": data}


def surface_sidecar(ws: Workspace):
    base = json.loads((DENSE / "quantization_config.json").read_text())
    modules = sorted(base["tensor_storage"])

    @st.composite
    def case(draw):
        focus = ("tensor_storage", draw(st.sampled_from(modules)))
        if draw(st.booleans()):
            focus = (*focus, "stored_tensors")
        return _document(draw, base, focus)

    return case(), lambda data: {"quantization_config.json": data}


def _split_shard(raw: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def _join_shard(header, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def surface_safetensors(ws: Workspace):
    raw = (DENSE / "model.safetensors").read_bytes()
    header, data = _split_shard(raw)
    names = sorted(header)
    entry = st.fixed_dictionaries({}, optional={
        "dtype": st.one_of(st.sampled_from(["F16", "I16", "I32", "BF16", "F32", "U8", "F8_E4M3", "Q4", ""]), JSON_LEAF),
        "shape": st.one_of(st.lists(st.integers(-2, 300), max_size=4), JSON_VALUE),
        "data_offsets": st.one_of(st.lists(st.integers(-10, len(data) + 10), min_size=2, max_size=2), JSON_VALUE)})

    @st.composite
    def case(draw):
        kind = draw(st.sampled_from(["truncate", "header bytes", "entry", "entries", "two shards", "index"]))
        if kind == "truncate":
            return {"model.safetensors": raw[:draw(st.integers(0, len(raw) - 1))]}
        if kind == "header bytes":
            cut = bytearray(raw[:8 + 4096])
            for _ in range(draw(st.integers(1, 8))):
                cut[draw(st.integers(0, len(cut) - 1))] = draw(st.integers(0, 255))
            return {"model.safetensors": bytes(cut) + raw[len(cut):]}
        h = copy.deepcopy(header)
        if kind in ("entry", "entries"):
            for _ in range(1 if kind == "entry" else draw(st.integers(2, 6))):
                name = draw(st.sampled_from([*names, "__metadata__", "new.tensor"]))
                h[name] = {**(h.get(name) if isinstance(h.get(name), dict) else {}), **draw(entry)}
                if draw(st.integers(0, 5)) == 0:
                    h[name] = draw(JSON_VALUE)
            return {"model.safetensors": _join_shard(h, data)}
        if kind == "two shards":
            moved = draw(st.lists(st.sampled_from(names), min_size=1, max_size=4, unique=True))
            extra = {n: h[n] for n in moved}
            keep = draw(st.booleans())  # keep: the same names in both shards
            main = h if keep else {n: v for n, v in h.items() if n not in moved}
            return {"model.safetensors": _join_shard(main, data), "model-extra.safetensors": _join_shard(extra, data)}
        weight_map = draw(st.one_of(JSON_VALUE, st.dictionaries(
            st.sampled_from(names), st.sampled_from(["model.safetensors", "missing.safetensors", "../model.safetensors",
                                                     "", "."]), max_size=4)))
        return {"model.safetensors.index.json": json.dumps({"weight_map": weight_map}).encode()}

    return case(), lambda files: files


def rank_sliced_base() -> tuple[dict, dict]:
    """A valid mixed-bitrate hybrid_tr3_tail block and its bits_per_expert file."""
    meta = {"format": "exl3-trellis", "bits": "mixed", "codebook": "mcg", "experts_per_layer": 4,
            "moe_layers": [0, 1], "tensor_schema": TENSOR_SCHEMA, "tp": 2, "k_values": [2, 3, 4],
            "bits_per_expert": "bits.json:k", "rotation_layout": "shared_h_v1",
            "shared_h_tensor_schema": SHARED_H_SCHEMA}
    bits = {"0": {"k": [2, 3, 4, 3]}, "1": {"k": [4, 4, 2, 2]}}
    return meta, bits


NAMES = st.one_of(
    st.builds(lambda L, E, p, r, f: f"model.layers.{L}.mlp.experts.{E}.{p}.rank{r}.{f}", st.integers(0, 3),
              st.integers(0, 5), st.sampled_from(["gate_proj", "up_proj", "down_proj", "o_proj"]), st.integers(0, 3),
              st.sampled_from(["trellis", "suh", "svh", "mcg", "mul1", "weight"])),
    st.builds(lambda L, p, r, f: f"model.layers.{L}.mlp.experts.shared_h.{p}.rank{r}.{f}", st.integers(0, 3),
              st.sampled_from(["gate_proj", "up_proj", "down_proj"]), st.integers(0, 3),
              st.sampled_from(["suh", "svh", "trellis"])),
    st.text(max_size=40))


def surface_rank_sliced(ws: Workspace):
    meta, bits = rank_sliced_base()
    spec = parse({"hybrid_tr3_tail": meta}, _bits_dir(ws, bits))

    @st.composite
    def case(draw):
        kind = draw(st.sampled_from(["meta", "meta", "bits file", "names"]))
        if kind == "names":
            return ("names", draw(st.lists(NAMES, min_size=1, max_size=8)), draw(st.integers(0, 3)))
        m = draw(mutated_json(meta)) if kind == "meta" else meta
        b = draw(RAW_TEXT) if kind == "bits file" and draw(st.integers(0, 4)) == 0 else \
            json.dumps(draw(mutated_json(bits)) if kind == "bits file" else bits).encode()
        return ("parse", m, b)

    def run(drawn):
        if drawn[0] == "names":
            _, names, rank = drawn
            return lambda: [normalize_weight_name(n, rank, spec) for n in names]
        _, m, b = drawn
        folder = ws.case({"bits.json": b})
        return lambda: parse({"hybrid_tr3_tail": m}, folder)

    return case(), run


def _bits_dir(ws: Workspace, bits: dict) -> Path:
    folder = ws.root / "bits-base"
    folder.mkdir(exist_ok=True)
    (folder / "bits.json").write_text(json.dumps(bits))
    return folder


def surface_knobs(ws: Workspace):
    folder = ws.root / "paths"
    folder.mkdir(exist_ok=True)
    os.chmod(ws.root, 0o755)
    lib = folder / "lib.so"
    lib.write_bytes(b"\x7fELF")
    lib.chmod(0o644)
    (folder / "link.so").symlink_to(lib)
    (folder / "open").mkdir(mode=0o777)
    os.chmod(folder / "open", 0o777)
    values = st.one_of(
        st.text(max_size=10), st.integers(-5, 200).map(str), st.sampled_from(
            ["auto", "cuda", "torch", "triton", "exllamav3", "off", "rw", "one-split", "0", "1", " 1 ", "64", "65",
             "256", "8", "48", "", " ", str(lib), str(folder / "link.so"), str(folder / "open"), str(folder), "lib.so",
             "/nonexistent", f"{folder}/../paths/lib.so", "/dev/null"]))
    names = st.sampled_from([*knobs.KNOBS, *knobs.ALIASES, *knobs.REMOVED, "BACKNED", "Backend", "FUSED",
                             "EMBED_ONLINE_BITS"])
    env = st.dictionaries(names.map(lambda n: knobs.PREFIX + n), values, max_size=6)
    return env, lambda e: (lambda: knobs.validate_all(e))


SURFACES = {
    "config.json": surface_config,
    "quantization_config.json": surface_sidecar,
    "safetensors shards": surface_safetensors,
    "rank-sliced metadata": surface_rank_sliced,
    "knobs": surface_knobs,
}


def fuzz(surface: str, cases: int, raise_other: bool = False, seed: int = 0) -> Tally:
    """Run `cases` generated cases of one surface (deterministic for a seed)."""
    ws = Workspace(DENSE)
    tally = Tally()
    try:
        strategy, make = SURFACES[surface](ws)

        @settings(max_examples=cases, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), derandomize=seed == 0)
        @given(strategy)
        def one(drawn):
            made = make(drawn)
            if isinstance(made, dict):  # files to place in a checkpoint folder, then load it
                folder = ws.case(made)
                try:
                    run_case(tally, _load(folder), folder, raise_other)
                finally:
                    ws.done(folder)
            else:
                run_case(tally, made, None, raise_other)

        if seed:
            from hypothesis import seed as with_seed

            one = with_seed(seed)(one)
        one()
    finally:
        ws.close()
    return tally
