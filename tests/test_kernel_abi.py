"""The kernel library's C ABI is declared twice, once for each side: kernels/abi.py's table (ctypes) and
csrc/exl3_abi.h (the C prototypes every export is compiled against). These tests hold the two to each other argument
by argument, so a change to one that misses the other fails here, not as shifted arguments on a GPU."""

from __future__ import annotations

import re

from sglang_exl3.kernels import abi
from sglang_exl3.kernels.build import CSRC

HEADER = CSRC / "exl3_abi.h"
_PROTOTYPE = re.compile(r"^(const char\*|int|long long)\s+(exl3_\w+)\(([^)]*)\);", re.M | re.S)


def c_kind(ctype: str) -> str:
    ctype = " ".join(ctype.replace("const ", "").split())
    if ctype == "char*":
        return "str"
    if ctype == "int*":
        return "int_ptr"
    if ctype.endswith("*"):
        return "ptr"
    return {"int": "int", "long long": "i64"}[ctype]


def header_functions(text: str) -> dict[str, abi.Fn]:
    """Every exported prototype of the header as an abi.Fn."""
    out = {}
    for ret, name, params in _PROTOTYPE.findall(text):
        args = []
        for part in params.split(","):
            part = " ".join(part.split())
            if part in ("", "void"):
                continue
            m = re.fullmatch(r"(.*?[\s*])(\w+)", part)
            assert m, f"{name}: cannot read the parameter {part!r}"
            args.append((m.group(2), c_kind(m.group(1).strip().replace(" *", "*"))))
        out[name] = abi.Fn(name, c_kind(ret), tuple(args))
    return out


def test_every_exported_prototype_matches_the_table_argument_by_argument():
    header = header_functions(HEADER.read_text())
    assert set(header) == set(abi.BY_NAME), (f"only in exl3_abi.h: {sorted(set(header) - set(abi.BY_NAME))}; only in "
                                             f"abi.py: {sorted(set(abi.BY_NAME) - set(header))}")
    for name, fn in abi.BY_NAME.items():
        assert header[name] == fn, f"{name}: exl3_abi.h has {header[name]}, abi.py has {fn}"


def test_every_definition_of_an_export_is_declared_in_the_header():
    """Each family's .cu defines its exports; a definition the header does not declare would be invisible to the
    table check above."""
    defined = set()
    for path in CSRC.rglob("*.cu"):
        defined |= set(re.findall(r"^(?:const char\*|int|long long) (exl3_\w+)\(", path.read_text(), re.M))
    assert defined == set(abi.BY_NAME)


def test_the_header_reader_notices_a_changed_argument():
    """The check above can fail: one argument's type or name changed in the header is seen."""
    text = HEADER.read_text()
    edited = text.replace("int exl3_had_in(const void* x, int x_bf16,",
                          "int exl3_had_in(const void* x, long long x_bf16,")
    assert edited != text
    assert header_functions(edited)["exl3_had_in"] != abi.BY_NAME["exl3_had_in"]
    renamed = text.replace("int tn0, int tn_count", "int tn_count, int tn0")
    assert header_functions(renamed)["exl3_reconstruct"] != abi.BY_NAME["exl3_reconstruct"]


def test_the_digest_changes_with_the_table_and_the_layouts(monkeypatch):
    before = abi.digest()
    abi.digest.cache_clear()
    monkeypatch.setattr(abi, "LAYOUTS", (*abi.LAYOUTS[:-1], "ring modes: 81 82 91 93"))
    try:
        assert abi.digest() != before
    finally:
        abi.digest.cache_clear()


def test_bind_sets_every_signature():
    class Lib:
        def __getattr__(self, name):
            fn = type("Fn", (), {})()
            setattr(self, name, fn)
            return fn

    lib = Lib()
    abi.bind(lib)
    fn = abi.BY_NAME["exl3_moe_decode"]
    assert len(lib.exl3_moe_decode.argtypes) == len(fn.args) == 28
    assert lib.exl3_quantize_tiles_fast_scratch.restype is abi.KINDS["i64"]
    assert "exl3_abi_version" not in abi.BY_NAME  # the identity is the digest, not a number bumped by hand
