"""SGLANG_EXL3_* knobs: blank = unset, bad values name the variable, unknown names are rejected."""

import pytest

from sglang_exl3 import knobs
from sglang_exl3.knobs import KnobError


def test_defaults_and_blank_means_unset():
    values = knobs.validate_all({"SGLANG_EXL3_BACKEND": "  ", "SGLANG_EXL3_TRELLIS_MAX_M": ""})
    assert values["BACKEND"] == "auto" and values["TRELLIS_MAX_M"] == 32 and values["TRELLIS_MIN_M"] == 1
    assert values["PREFILL_TRELLIS"] is True and values["PREFILL_BLOCK_M"] == 64 and values["EXT_PATH"] is None


@pytest.mark.parametrize("env, message", [
    ({"SGLANG_EXL3_BACKEND": "cutlass"}, "SGLANG_EXL3_BACKEND must be one of auto, cuda, triton, exllamav3, torch"),
    ({"SGLANG_EXL3_TRELLIS_MAX_M": "lots"},
     "SGLANG_EXL3_TRELLIS_MAX_M must be a positive integer or unset, got 'lots'"),
    ({"SGLANG_EXL3_TRELLIS_BLOCK_M": "0"}, "SGLANG_EXL3_TRELLIS_BLOCK_M must be positive, got 0"),
    ({"SGLANG_EXL3_PREFILL_BLOCK_M": "24"}, "SGLANG_EXL3_PREFILL_BLOCK_M must be one of 8, 16, 32, 48, 64, got 24"),
    ({"SGLANG_EXL3_PREFILL_TRELLIS": "yes"}, "SGLANG_EXL3_PREFILL_TRELLIS must be 0 or 1 or unset"),
    ({"SGLANG_EXL3_EXT_PATH": "/nonexistent/ext.so"},
     "SGLANG_EXL3_EXT_PATH='/nonexistent/ext.so' is refused: it cannot be read (No such file or directory)"),
    ({"SGLANG_EXL3_TRELLIS_MIN_M": "8", "SGLANG_EXL3_TRELLIS_MAX_M": "4"},
     "SGLANG_EXL3_TRELLIS_MIN_M (8) exceeds SGLANG_EXL3_TRELLIS_MAX_M (4)"),
    ({"SGLANG_EXL3_BACKNED": "torch"}, "unknown variable(s) SGLANG_EXL3_BACKNED"),
])
def test_bad_values_name_the_variable(env, message):
    with pytest.raises(KnobError) as info:
        knobs.validate_all(env)
    assert message in str(info.value)


def test_every_knob_is_documented_in_the_readme():
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for knob in knobs.KNOBS.values():
        assert f"`{knob.env}`" in readme
        if knob.vllm_name:
            assert f"`{knob.vllm_name}`" in readme


def test_backend_resolution_on_cpu(monkeypatch):
    import torch

    from sglang_exl3.kernels.backends import Backend, BackendUnavailable, resolve_backend

    assert resolve_backend(torch.device("cpu")) == Backend.TORCH
    monkeypatch.setenv("SGLANG_EXL3_BACKEND", "exllamav3")
    with pytest.raises(BackendUnavailable, match="needs a CUDA device"):
        resolve_backend(torch.device("cpu"))
    monkeypatch.setenv("SGLANG_EXL3_BACKEND", "triton")
    with pytest.raises(BackendUnavailable, match="triton needs a CUDA device"):
        resolve_backend(torch.device("cpu"))
    monkeypatch.setenv("SGLANG_EXL3_BACKEND", "cuda")
    with pytest.raises(BackendUnavailable, match="cuda needs a CUDA device"):
        resolve_backend(torch.device("cpu"))


def test_fused_max_m_is_bounded_by_the_kernel_and_read_by_the_dispatch(monkeypatch, request):
    """SGLANG_EXL3_FUSED_MAX_M: default = the kernels' crossover (the mma.sync ring's, or the wgmma ring's where it
    serves), at most the mma.sync ring's 128 rows, and what the dense dispatch (cuda_trellis.fused_crossover_m, used
    by exl3_linear and exl3::gemm_group) reads."""
    from sglang_exl3.kernels import cuda_trellis as ck

    assert knobs.validate_all({})["FUSED_MAX_M"] == ck.FUSED_CROSSOVER_M <= ck.RING_MAX_M
    with pytest.raises(KnobError, match="SGLANG_EXL3_FUSED_MAX_M must be at most 128, got 129"):
        knobs.validate_all({"SGLANG_EXL3_FUSED_MAX_M": "129"})
    with pytest.raises(KnobError, match="SGLANG_EXL3_FUSED_MAX_M must be positive, got 0"):
        knobs.validate_all({"SGLANG_EXL3_FUSED_MAX_M": "0"})
    request.addfinalizer(ck.fused_max_m_knob.cache_clear)  # read once per process: the next test reads afresh
    monkeypatch.setenv("SGLANG_EXL3_FUSED_MAX_M", "32")
    ck.fused_max_m_knob.cache_clear()
    assert ck.fused_crossover_m() == 32
    monkeypatch.setenv("SGLANG_EXL3_FUSED_MAX_M", " ")
    ck.fused_max_m_knob.cache_clear()
    assert ck.fused_crossover_m() == ck.FUSED_CROSSOVER_M  # no GPU here: no wgmma ring, the mma.sync crossover
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(ck._WGMMA, 0, True)
    assert ck.fused_crossover_m(torch.device("cuda", 0)) == ck.WG_MAX_M  # the wgmma ring's own crossover
    monkeypatch.setenv("SGLANG_EXL3_FUSED_MAX_M", "64")
    ck.fused_max_m_knob.cache_clear()
    assert ck.fused_crossover_m(torch.device("cuda", 0)) == 64  # a set knob caps it


def test_pdl_follows_the_knob_unless_a_caller_pins_it(monkeypatch):
    """SGLANG_EXL3_PDL (on by default) decides whether the one-launch linears and the MoE decode forward launch as
    programmatic dependents, read once per process (a read costs ~2 µs, too much per eager call); a caller's
    explicit pdl (the A/B benchmarks, the GPU tests) wins over it."""
    from sglang_exl3.kernels import cuda_trellis as ck

    def fresh(env: str | None) -> None:
        if env is None:
            monkeypatch.delenv("SGLANG_EXL3_PDL", raising=False)
        else:
            monkeypatch.setenv("SGLANG_EXL3_PDL", env)
        ck._pdl_knob.cache_clear()

    try:
        fresh(None)
        assert ck.launch_pdl(None) is True and ck.launch_pdl(False) is False
        fresh("0")
        assert ck.launch_pdl(None) is False and ck.launch_pdl(True) is True
        monkeypatch.setenv("SGLANG_EXL3_PDL", "1")
        assert ck.launch_pdl(None) is False  # read once: a later change is not seen
        fresh("off")
        with pytest.raises(KnobError, match="SGLANG_EXL3_PDL must be 0 or 1"):
            ck.launch_pdl(None)
    finally:
        monkeypatch.undo()
        ck._pdl_knob.cache_clear()
