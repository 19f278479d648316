"""SGLANG_EXL3_* knobs: blank = unset, bad values name the variable, unknown and removed names are refused with the
fix, aliases, and each audience documented where it belongs."""

import re
from pathlib import Path

import pytest

from sglang_exl3 import knobs
from sglang_exl3.knobs import KnobError

ROOT = Path(__file__).parents[1]
DOCS = {"user": "README.md", "moe": "docs/moe.md", "dev": "docs/kernels.md", "test": "docs/cartridges.md"}


def test_defaults_and_blank_means_unset():
    values = knobs.validate_all({"SGLANG_EXL3_BACKEND": "  ", "SGLANG_EXL3_MOE_DECODE_MAX_M": "",
                                 "SGLANG_EXL3_TRELLIS_MIN_M": " "})
    assert values["BACKEND"] == "auto" and values["MOE_DECODE_MAX_M"] == 32 and values["MOE_DECODE_MIN_M"] == 1
    assert values["MOE_PREFILL_PLAN"] is True and values["MOE_PARITY_CHUNK"] == 128 and values["EXT_PATH"] is None
    assert values["DEV_FUSED_MAX_M"] is None and values["DEV_ONE_LAUNCH_MAX_M"] == 1
    assert values["DEV_WG_ROTATING"] == "one-split" and values["ONLINE_CACHE"] == "readwrite"
    assert set(values) == set(knobs.KNOBS)


@pytest.mark.parametrize("env, message", [
    ({"SGLANG_EXL3_BACKEND": "cutlass"}, "SGLANG_EXL3_BACKEND must be one of auto, cuda, exllamav3, torch"),
    ({"SGLANG_EXL3_MOE_DECODE_MAX_M": "lots"},
     "SGLANG_EXL3_MOE_DECODE_MAX_M must be a positive integer or unset, got 'lots'"),
    ({"SGLANG_EXL3_MOE_PARITY_CHUNK": "0"}, "SGLANG_EXL3_MOE_PARITY_CHUNK must be positive, got 0"),
    ({"SGLANG_EXL3_MOE_PREFILL_PLAN": "yes"}, "SGLANG_EXL3_MOE_PREFILL_PLAN must be 0 or 1 or unset"),
    ({"SGLANG_EXL3_EXT_PATH": "/nonexistent/ext.so"},
     "SGLANG_EXL3_EXT_PATH='/nonexistent/ext.so' is refused: it cannot be read (No such file or directory)"),
    ({"SGLANG_EXL3_MOE_DECODE_MIN_M": "8", "SGLANG_EXL3_MOE_DECODE_MAX_M": "4"},
     "SGLANG_EXL3_MOE_DECODE_MIN_M (8) exceeds SGLANG_EXL3_MOE_DECODE_MAX_M (4)"),
    ({"SGLANG_EXL3_TRELLIS_MIN_M": "8", "SGLANG_EXL3_TRELLIS_MAX_M": "4"},  # the aliases are cross-checked too
     "SGLANG_EXL3_MOE_DECODE_MIN_M (8) exceeds SGLANG_EXL3_MOE_DECODE_MAX_M (4)"),
    ({"SGLANG_EXL3_DEV_ONE_LAUNCH_MAX_M": "17"}, "SGLANG_EXL3_DEV_ONE_LAUNCH_MAX_M must be at most 16, got 17"),
    ({"SGLANG_EXL3_DEV_ONE_LAUNCH_MAX_M": "-1"}, "SGLANG_EXL3_DEV_ONE_LAUNCH_MAX_M must be at least 0, got -1"),
    ({"SGLANG_EXL3_DEV_WGMMA": "on"}, "SGLANG_EXL3_DEV_WGMMA must be one of auto, off or unset, got 'on'"),
    ({"SGLANG_EXL3_BACKNED": "torch"}, "unknown variable(s) SGLANG_EXL3_BACKNED (did you mean SGLANG_EXL3_BACKEND "
                                       "for SGLANG_EXL3_BACKNED?)"),
    ({"SGLANG_EXL3_DEV_FUSED": "1"}, "unknown variable(s) SGLANG_EXL3_DEV_FUSED"),
])
def test_bad_values_name_the_variable(env, message):
    with pytest.raises(KnobError) as info:
        knobs.validate_all(env)
    assert message in str(info.value)


def test_sections_follow_the_name_prefixes():
    """An audience is told by the name: DEV_ for kernel A/B switches, TEST_ for fault injection, MOE_ for the MoE
    plan; a user knob carries none of those prefixes."""
    prefix = {"dev": "DEV_", "test": "TEST_", "moe": "MOE_"}
    assert {k.audience for k in knobs.KNOBS.values()} == set(knobs.AUDIENCES)
    for knob in knobs.KNOBS.values():
        if knob.audience == "user":
            assert not knob.name.startswith(tuple(prefix.values())), knob.name
        else:
            assert knob.name.startswith(prefix[knob.audience]), knob.name
    assert [k.name for k in knobs.USER] == ["BACKEND", "KERNEL_LIB", "AUTO_BUILD", "EXT_PATH", "LOG_PATH_SELECTION",
                                            "EMBED_ONLINE_BITS", "ONLINE_BITS", "ONLINE_MODULES", "ONLINE_FP8",
                                            "ONLINE_CACHE", "ONLINE_CACHE_DIR", "CARTRIDGES", "CHECK_OUTPUTS"]


def test_every_knob_is_documented_where_its_audience_reads():
    missing = []
    for knob in knobs.KNOBS.values():
        page = (ROOT / DOCS[knob.audience]).read_text()
        names = [knob.env, knob.vllm_name, knob.alias and knobs.PREFIX + knob.alias]
        missing += [f"{DOCS[knob.audience]}: {n}" for n in names if n and not re.search(f"`{n}[`=]", page)]
    assert not missing, "undocumented knobs:\n" + "\n".join(missing)


def test_the_readme_lists_the_user_knobs_only():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Knobs\n"):]
    section = section[:section.index("\n## ", 1)]
    rows = re.findall(r"^\| `(SGLANG_EXL3_\w+)` \|", section, re.MULTILINE)
    assert rows == [k.env for k in knobs.USER]
    assert "docs/moe.md" in section and "docs/kernels.md" in section


@pytest.mark.parametrize("alias, knob, raw, value", [
    ("TRELLIS_MIN_M", "MOE_DECODE_MIN_M", "4", 4), ("TRELLIS_MAX_M", "MOE_DECODE_MAX_M", "64", 64),
    ("PREFILL_CHUNK", "MOE_PARITY_CHUNK", "256", 256), ("PREFILL_TRELLIS", "MOE_PREFILL_PLAN", "0", False),
])
def test_aliases_set_their_knob_and_may_not_be_set_with_it(alias, knob, raw, value):
    assert knobs.ALIASES[alias] == knob
    assert knobs.validate_all({knobs.PREFIX + alias: raw})[knob] == value
    assert knobs.get(knob, {knobs.PREFIX + alias: raw}) == value
    assert knobs.get(knob, {knobs.PREFIX + alias: raw, knobs.PREFIX + knob: " "}) == value  # blank = unset
    both = {knobs.PREFIX + alias: raw, knobs.PREFIX + knob: raw}
    for read in (knobs.validate_all, lambda env: knobs.get(knob, env)):
        with pytest.raises(KnobError, match=f"SGLANG_EXL3_{knob} and its alias SGLANG_EXL3_{alias} are both set"):
            read(both)
    with pytest.raises(KnobError, match=f"^SGLANG_EXL3_{alias} must be"):  # names the variable that is set
        knobs.get(knob, {knobs.PREFIX + alias: "x"})


@pytest.mark.parametrize("old, new", sorted(knobs.RENAMED.items()))
def test_renamed_knobs_are_refused_naming_the_new_name(old, new):
    assert new in knobs.KNOBS and knobs.KNOBS[new].audience in ("dev", "test")
    kind = "a developer knob, docs/kernels.md" if new.startswith("DEV_") else "a test knob, docs/cartridges.md"
    message = f"SGLANG_EXL3_{old} is now SGLANG_EXL3_{new} ({kind})"
    with pytest.raises(KnobError) as info:
        knobs.validate_all({knobs.PREFIX + old: "1"})
    assert str(info.value) == message
    with pytest.raises(KnobError, match=re.escape(message)):
        knobs.get(old, {})  # a caller still reading the old name
    assert knobs.validate_all({knobs.PREFIX + old: " "})[new] == knobs.KNOBS[new].default  # blank: not refused


@pytest.mark.parametrize("name, why", [
    ("TRELLIS_BLOCK_M", "no kernel read it; unset it"), ("PREFILL_BLOCK_M", "no kernel read it; unset it"),
    ("TWO_LAUNCH_MAX_M", "the two-launch form, which lost to three launches (docs/decisions.md); unset it"),
])
def test_removed_knobs_are_refused_naming_why(name, why):
    with pytest.raises(KnobError, match=f"SGLANG_EXL3_{name} was removed.*{re.escape(why)}"):
        knobs.validate_all({knobs.PREFIX + name: "8"})
    with pytest.raises(KnobError, match=f"SGLANG_EXL3_{name} was removed"):
        knobs.get(name)
    knobs.validate_all({knobs.PREFIX + name: ""})  # blank means unset


@pytest.mark.parametrize("old, canonical", [("rw", "readwrite"), ("read-write", "readwrite"), ("RO", "readonly"),
                                            ("read-only", "readonly"), ("none", "off")])
def test_online_cache_takes_three_spellings_and_names_the_canonical_one(old, canonical):
    assert [knobs.get("ONLINE_CACHE", {"SGLANG_EXL3_ONLINE_CACHE": m}) for m in ("readwrite", "READONLY", "off")] == [
        "readwrite", "readonly", "off"]
    with pytest.raises(KnobError, match=f"SGLANG_EXL3_ONLINE_CACHE={old} is refused: spell it {canonical}$"):
        knobs.validate_all({"SGLANG_EXL3_ONLINE_CACHE": old})


def test_removed_values_are_refused_naming_why():
    with pytest.raises(KnobError, match="SGLANG_EXL3_BACKEND=Triton is refused: the Triton backend was removed "
                                        r"because it measured slower than our CUDA kernels \(4-8x bf16's time\); "
                                        "use auto or cuda"):
        knobs.validate_all({"SGLANG_EXL3_BACKEND": "Triton"})
    with pytest.raises(KnobError, match=r"SGLANG_EXL3_DEV_WG_ROTATING=1 is refused: .*measured 0\.90x.*"
                                        "use one-split or off"):
        knobs.validate_all({"SGLANG_EXL3_DEV_WG_ROTATING": "1"})
    with pytest.raises(KnobError, match="SGLANG_EXL3_DEV_WG_ROTATING=0 is refused: spell it off"):
        knobs.validate_all({"SGLANG_EXL3_DEV_WG_ROTATING": "0"})
    assert knobs.get("DEV_WG_ROTATING", {"SGLANG_EXL3_DEV_WG_ROTATING": "off"}) == "off"


def test_dev_fused_max_m_takes_auto_and_its_widest_value():
    """Unset or auto: None (the kernels choose 256 where the wgmma ring serves, else 128); else 1-256."""
    def read(raw):
        return knobs.get("DEV_FUSED_MAX_M", {"SGLANG_EXL3_DEV_FUSED_MAX_M": raw})

    assert [read(raw) for raw in ("", "auto", "AUTO", "1", "128", "256")] == [None, None, None, 1, 128, 256]
    for raw, message in (("257", "must be at most 256, got 257"), ("0", "must be positive, got 0"),
                         ("lots", "must be auto, an integer from 1 to 256 or unset, got 'lots'")):
        with pytest.raises(KnobError, match=f"SGLANG_EXL3_DEV_FUSED_MAX_M {re.escape(message)}"):
            read(raw)


def test_dev_one_launch_max_m_is_an_int_from_0_to_16():
    assert [knobs.get("DEV_ONE_LAUNCH_MAX_M", {"SGLANG_EXL3_DEV_ONE_LAUNCH_MAX_M": raw}) for raw in ("0", "16", "")] \
        == [0, 16, 1]


def test_backend_resolution_on_cpu(monkeypatch):
    import torch

    from sglang_exl3.kernels.backends import Backend, BackendUnavailable, resolve_backend

    assert resolve_backend(torch.device("cpu")) == Backend.TORCH
    monkeypatch.setenv("SGLANG_EXL3_BACKEND", "exllamav3")
    with pytest.raises(BackendUnavailable, match="needs a CUDA device"):
        resolve_backend(torch.device("cpu"))
    monkeypatch.setenv("SGLANG_EXL3_BACKEND", "cuda")
    with pytest.raises(BackendUnavailable, match="cuda needs a CUDA device"):
        resolve_backend(torch.device("cpu"))


def test_fused_max_m_is_read_by_the_dispatch(monkeypatch, request):
    """SGLANG_EXL3_DEV_FUSED_MAX_M is what the dense dispatch (kernels/dispatch.py fused_crossover_m, used by the
    dense linear and exl3::gemm_group) reads, capped at what the GPU's rings serve; unset or auto it is the kernels'
    crossover: the mma.sync ring's, or the wgmma ring's where that serves."""
    import torch

    from sglang_exl3.kernels import dispatch
    from sglang_exl3.kernels.crossovers import CROSSOVERS

    def fresh(raw: str) -> None:
        monkeypatch.setenv("SGLANG_EXL3_DEV_FUSED_MAX_M", raw)
        dispatch.fused_max_m_knob.cache_clear()

    request.addfinalizer(dispatch.fused_max_m_knob.cache_clear)  # read once per process: the next test reads afresh
    fresh("32")
    assert dispatch.fused_crossover_m() == 32
    for unset in (" ", "auto", "256"):  # no GPU here: the mma.sync ring's crossover, which also caps a set 256
        fresh(unset)
        assert dispatch.fused_crossover_m() == CROSSOVERS.fused_crossover_m == 128
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(dispatch._WGMMA, 0, True)
    wgmma = torch.device("cuda", 0)
    assert dispatch.fused_crossover_m(wgmma) == CROSSOVERS.wg_max_m == 256  # 256 accepted and served
    fresh("auto")
    assert dispatch.fused_crossover_m(wgmma) == 256  # the wgmma ring's own crossover
    fresh("64")
    assert dispatch.fused_crossover_m(wgmma) == 64  # a set knob caps it


def test_pdl_follows_the_knob_unless_a_caller_pins_it(monkeypatch):
    """SGLANG_EXL3_DEV_PDL (on by default) decides whether the one-launch linears and the MoE decode forward launch
    as programmatic dependents, read once per process (a read costs ~2 µs, too much per eager call); a caller's
    explicit pdl (the A/B benchmarks, the GPU tests) wins over it."""
    from sglang_exl3.kernels import dispatch

    def fresh(env: str | None) -> None:
        if env is None:
            monkeypatch.delenv("SGLANG_EXL3_DEV_PDL", raising=False)
        else:
            monkeypatch.setenv("SGLANG_EXL3_DEV_PDL", env)
        dispatch._pdl_knob.cache_clear()

    try:
        fresh(None)
        assert dispatch.launch_pdl(None) is True and dispatch.launch_pdl(False) is False
        fresh("0")
        assert dispatch.launch_pdl(None) is False and dispatch.launch_pdl(True) is True
        monkeypatch.setenv("SGLANG_EXL3_DEV_PDL", "1")
        assert dispatch.launch_pdl(None) is False  # read once: a later change is not seen
        fresh("off")
        with pytest.raises(KnobError, match="SGLANG_EXL3_DEV_PDL must be 0 or 1"):
            dispatch.launch_pdl(None)
    finally:
        monkeypatch.undo()
        dispatch._pdl_knob.cache_clear()
