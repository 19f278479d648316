"""The kernel build's units (CPU): every source is built, the variants the build compiles are the ones the C switch
dispatches to, and a unit's cache key follows exactly the files it includes, so an edit rebuilds its family alone."""

from __future__ import annotations

import re
import shutil

import pytest

from sglang_exl3.kernels import build


def test_every_source_file_is_a_unit_and_every_unit_exists():
    sources = {str(p.relative_to(build.CSRC)) for p in build.CSRC.rglob("*.cu")}
    units = {u.source for u in build.units()}
    assert units == sources
    names = [u.name for u in build.units()]
    assert len(names) == len(set(names)) == len(build.PLAIN_UNITS) + 6 * 27 + 21


def test_the_variants_are_the_ones_the_dispatch_switch_calls():
    text = (build.CSRC / "common" / "dispatch.cuh").read_text()
    full = text[text.index("#else"):]
    threes = {int(k) for k in re.findall(r"EXL3_CASE3\((\d+), FAMILY", full)}
    ones = {(int(k), int(c)) for k, c in re.findall(r"EXL3_CASE1\((\d+), (\d), FAMILY", full)}
    assert {(k, c) for k in threes for c in range(3)} | ones == set(build.VARIANTS)
    dev = text[text.index("#ifdef EXL3_DEV_4BIT_MCG"):text.index("#else")]
    assert {(int(k), int(c)) for k, c in re.findall(r"EXL3_CASE1\((\d+), (\d), FAMILY", dev)} == set(
        build.DEV_VARIANTS)
    encode = (build.CSRC / "encode" / "encode.cu").read_text()
    full = encode[encode.index("#else"):]
    assert {(int(k), c) for k in re.findall(r"EXL3_ENCODE_CASE3\((\d+), ARGS\)", full) for c in range(3)} == set(
        build.ENCODE_VARIANTS)


def test_unit_names_say_what_they_build():
    names = {u.name for u in build.units()}
    assert {"abi", "linear", "moe-tables", "gemm-4bit-mcg", "wgmma-2.5bit-mul1", "encode-k4-3inst"} <= names
    assert {u.name for u in build.units(dev=True)} >= {"gemm-4bit-mcg", "encode-k4-mcg"}


@pytest.fixture
def csrc_copy(tmp_path, monkeypatch):
    copy = tmp_path / "csrc"
    shutil.copytree(build.CSRC, copy)
    monkeypatch.setattr(build, "CSRC", copy)
    monkeypatch.setattr(build, "_nvcc_version", lambda nvcc: "nvcc 13")
    return copy


def _hashes(dev: bool = False) -> dict[str, str]:
    return {u.name: build.unit_hash("nvcc", u, "90", dev) for u in build.units(dev)}


def test_a_family_header_edit_changes_that_familys_units_alone(csrc_copy):
    before = _hashes()
    kernel = csrc_copy / "ring" / "ring_kernel.cuh"
    kernel.write_text(kernel.read_text() + "\n// an edit\n")
    after = _hashes()
    changed = {name for name in before if before[name] != after[name]}
    assert changed == {u.name for u in build.units() if u.source == "ring/ring_instances.cu"}
    assert len(changed) == 27


def test_a_shared_header_edit_changes_every_unit_that_includes_it(csrc_copy):
    before = _hashes()
    decode = csrc_copy / "common" / "decode.cuh"
    decode.write_text(decode.read_text() + "\n// an edit\n")
    after = _hashes()
    changed = {u.source for u in build.units() if before[u.name] != after[u.name]}
    assert changed == {"reconstruct/reconstruct_instances.cu", "gemm/gemm_instances.cu", "ring/ring_instances.cu",
                       "wgmma/wgmma_instances.cu", "one_launch/one_launch_instances.cu",
                       "moe/moe_decode_instances.cu", "encode/encode_instances.cu"}


def test_the_abi_digest_reaches_the_abi_unit_alone(monkeypatch):
    before = _hashes()
    monkeypatch.setattr(build.abi, "digest", lambda: "0123456789abcdef")
    after = _hashes()
    assert {name for name in before if before[name] != after[name]} == {"abi"}


def test_the_development_build_is_its_own_set_of_objects():
    full, dev = _hashes(), _hashes(dev=True)
    assert not set(full.values()) & set(dev.values())


@pytest.mark.slow
def test_a_second_build_compiles_nothing_and_links_the_same_units(kernel_build, tmp_path):
    """The development build of conftest.kernel_build, again from its object folder: every unit cached."""
    lib, objects = kernel_build
    report = build.build(tmp_path / "again.so", "90", objects, dev=True)
    assert report.compiled == [] and len(report.cached) == len(build.units(dev=True))
    assert (tmp_path / "again.so").stat().st_size == lib.stat().st_size
