"""Every `SGLANG_EXL3_*` knob, parsed and validated in one place.

Blank means unset (compose/k8s render unset variables as ""). A bad value raises `KnobError`
naming the variable; `validate_all()` runs at plugin registration so that a typo fails at startup,
never mid-serve. Semantics and defaults follow the reference vLLM implementation's `VLLM_EXL3_*`
knobs (mapping in README.md).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from sglang_exl3.native_paths import UnsafeNativePath, check_native_path

PREFIX = "SGLANG_EXL3_"


class KnobError(ValueError):
    """An SGLANG_EXL3_* environment variable holds a value that cannot be used."""


@dataclass(frozen=True)
class Knob:
    name: str  # without the prefix
    default: object
    kind: str  # choice, positive_int, flag, regex, path, or a native-code path: native_file, native_file_or_dir
    choices: tuple[str, ...] = ()
    help: str = ""
    vllm_name: str | None = None
    maximum: int | None = None  # positive_int: the largest value allowed

    @property
    def env(self) -> str:
        return PREFIX + self.name

    def read(self, environ: dict[str, str] | None = None):
        raw = (os.environ if environ is None else environ).get(self.env, "")
        raw = raw.strip()
        if raw == "":
            return self.default
        if self.kind == "choice":
            value = raw.lower()
            if value not in self.choices:
                raise KnobError(f"{self.env} must be one of {', '.join(self.choices)} or unset, got {raw!r}")
            return value
        if self.kind == "positive_int":
            try:
                value = int(raw)
            except ValueError:
                raise KnobError(f"{self.env} must be a positive integer or unset, got {raw!r}") from None
            if value <= 0:
                raise KnobError(f"{self.env} must be positive, got {value}")
            if self.maximum is not None and value > self.maximum:
                raise KnobError(f"{self.env} must be at most {self.maximum}, got {value}")
            if self.choices and str(value) not in self.choices:
                raise KnobError(f"{self.env} must be one of {', '.join(self.choices)}, got {value}")
            return value
        if self.kind == "flag":
            if raw not in ("0", "1"):
                raise KnobError(f"{self.env} must be 0 or 1 or unset, got {raw!r}")
            return raw == "1"
        if self.kind == "regex":
            try:
                re.compile(raw)
            except re.error as e:
                raise KnobError(f"{self.env} is not a valid regular expression ({e}): {raw!r}") from None
            return raw
        if self.kind == "path":
            return os.path.expanduser(raw)
        if self.kind in ("native_file", "native_file_or_dir"):  # loaded into every server process
            try:
                return check_native_path(raw, self.env, self.kind.removeprefix("native_"))
            except UnsafeNativePath as e:
                raise KnobError(str(e)) from None
        raise AssertionError(self.kind)


KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("BACKEND", "auto", "choice", ("auto", "cuda", "triton", "exllamav3", "torch"),
         "dense GEMM backend: auto = our CUDA kernels (built on first use where nvcc exists), else a prebuilt "
         "exllamav3 extension, else the torch reference"),
    Knob("KERNEL_LIB", None, "native_file", help="prebuilt libexl3_trellis .so (else the per-user build cache)"),
    Knob("AUTO_BUILD", True, "flag", help="auto backend: compile our CUDA kernels at first load when nvcc is "
         "found and none are built (~1-2 min, once per GPU arch and source version; 0: never compile in a server)"),
    Knob("EXT_PATH", None, "native_file_or_dir", help="folder or .so of a prebuilt exllamav3_ext to import",
         vllm_name="VLLM_EXL3_EXT_PATH"),
    Knob("LOG_PATH_SELECTION", False, "flag", help="log the backend chosen for every EXL3 layer",
         vllm_name="VLLM_EXL3_LOG_PATH_SELECTION"),
    Knob("FUSED_MAX_M", 128, "positive_int", help="dense linears on our CUDA kernels: the most rows the fused decode "
         "GEMM serves (1-128; 65-128 only through the x ring; unset: 256 where the wgmma ring serves, else 128); "
         "above, reconstruct + cuBLAS", maximum=128),
    Knob("ONE_LAUNCH_MAX_M", "1", "choice", tuple(str(m) for m in range(17)), "dense linears and fused q/k/v, "
         "gate/up layers (not the lm_head) on our CUDA kernels with at most this many rows run as one launch, the "
         "input and output rotations folded into the GEMM; 0: three launches at every m"),
    Knob("ONE_LAUNCH_MAX_WEIGHTS", 4194304, "positive_int", help="the one- and two-launch forms only for layers "
         "of at most this many weights per rank (K x N over the sources); larger layers run three launches. As "
         "CUDA-graph replays three launches beat one on large layers (4096 x 4096: 0.89x, 1536 x 8192: 0.79x) and "
         "lose on small ones (1536 x 2560: 1.12x); end to end on Llama-3-8B (every linear above 4194304) three "
         "programmatic launches decode 1.046x faster at batch 1 (H100)", maximum=1 << 40),
    Knob("TWO_LAUNCH_MAX_M", "0", "choice", tuple(str(m) for m in range(17)), "the same layers with more rows than "
         "ONE_LAUNCH_MAX_M and at most this many run as two launches: x rotated once, then the GEMM that rotates its "
         "own output; 0: three launches above ONE_LAUNCH_MAX_M"),
    Knob("ROTATION_FORM", "auto", "choice", ("auto", "warp", "octet"), "our CUDA kernels: the form of the Hadamard "
         "rotation launches, one warp or eight threads per 128-block (the same values); auto: eight threads from a "
         "measured size. For A/B measurements"),
    Knob("WGMMA", "auto", "choice", ("auto", "off"), "our CUDA kernels on Hopper: the x-ring GEMM (16-128 rows) "
         "as warpgroup MMAs (wgmma) fed by the weight decode in registers; auto: where the kernel build has them "
         "(sm_90a); off: the mma.sync ring. For A/B measurements"),
    Knob("WG_CLUSTER", "one-split", "choice", ("0", "1", "one-split"), "our CUDA kernels on Hopper: a same-input "
         "group or single linear on the wgmma ring (33-64 rows) sums each column block's K splits inside a "
         "thread-block cluster and rotates its output in the same launch, with no split-K partials in global memory; "
         "the same values. one-split (default): only rows at one split (Llama-3-8B gate/up), which rotate in the "
         "launch with no cluster reduction (batch 64 +1.9% decode tok/s, H100); 1: every such row (0.90x); 0: never"),
    Knob("PDL", True, "flag", help="our CUDA kernels: the one-launch linears and the MoE decode forward launch as "
         "programmatic dependents of the kernel before them (their first weight loads overlap its end); 0: plain "
         "launches, the same values. For A/B measurements"),
    Knob("PDL_THREE_LAUNCH", True, "flag", help="our CUDA kernels: the three-launch path's input and output "
         "rotations and its x-slice GEMM (up to 64 rows) launch as programmatic dependents, each waiting only where "
         "it reads the launch before it (the GEMM's first weight loads ahead of that); the same values. Batch 1 "
         "step 4,066 against 4,294 µs with plain launches (H100); 0: plain launches, for A/B measurements"),
    Knob("EMBED_ONLINE_BITS", None, "choice", ("8", "6"), "the input embedding table held as int8 or int6 with a "
         "scale per row, encoded at load (unset: BF16 as in the checkpoint)", vllm_name="VLLM_EXL3_EMBED_ONLINE_BITS"),
    Knob("CHECK_OUTPUTS", False, "flag", help="debugging: recompute every eager EXL3 linear/MoE forward from its "
         "weights in fp32 and log the layer, rows and path where they disagree (slow)"),
    Knob("TRELLIS_MIN_M", 1, "positive_int", help="MoE decode plan: smallest m (below: parity path)",
         vllm_name="VLLM_EXL3_TRELLIS_MIN_M"),
    Knob("TRELLIS_MAX_M", 32, "positive_int", help="MoE decode plan: largest m",
         vllm_name="VLLM_EXL3_TRELLIS_MAX_M"),
    Knob("TRELLIS_BLOCK_M", 8, "positive_int", help="MoE decode plan block", vllm_name="VLLM_EXL3_TRELLIS_BLOCK_M"),
    Knob("PREFILL_CHUNK", 128, "positive_int", help="MoE parity chunk / staging rows",
         vllm_name="VLLM_EXL3_PREFILL_CHUNK"),
    Knob("PREFILL_TRELLIS", True, "flag", help="MoE prefill plan on (0: single-plan behaviour)",
         vllm_name="VLLM_EXL3_PREFILL_TRELLIS"),
    Knob("PREFILL_BLOCK_M", 64, "positive_int", ("8", "16", "32", "48", "64"), "MoE prefill plan block",
         vllm_name="VLLM_EXL3_PREFILL_BLOCK_M"),
    Knob("ONLINE_BITS", None, "positive_int", help="serve a BF16 / FP16 checkpoint under --quantization exl3 with "
         "its decoder linears encoded to EXL3 at this bitrate at load (uncalibrated, MCG; unset: BF16)",
         vllm_name="VLLM_EXL3_ONLINE_TRELLIS_BITS", maximum=8),
    Knob("ONLINE_MODULES", None, "regex", help="online encoding: only the linears whose SGLang prefix matches this "
         "regex (unset: every decoder linear); a regex that matches nothing stops the load"),
    Knob("ONLINE_FP8", None, "regex", help="serve the decoder linears of a BF16 / FP16 checkpoint whose SGLang prefix "
         "matches this regex with SGLang's FP8 linear method (weights quantized at load; never the lm_head or routers) "
         "instead of EXL3 or BF16"),
    Knob("ONLINE_CACHE", "readwrite", "choice", ("readwrite", "readonly", "off", "rw", "read-write", "read-only",
                                                 "ro", "none"),
         "online encoding cache: readwrite, readonly (a miss is encoded, never stored) or off",
         vllm_name="VLLM_EXL3_ONLINE_CACHE_MODE"),
    Knob("ONLINE_CACHE_DIR", None, "path", help="online encoding cache folder (unset: ~/.cache/sglang_exl3/online); "
         "must not be writable by group or others", vllm_name="VLLM_EXL3_ONLINE_CACHE_DIR"),
    Knob("CARTRIDGES", "off", "choice", ("off", "recapture", "resident"), "expert cartridges on an "
         "exl3-msrt-base/1 checkpoint and their HTTP endpoints (unauthenticated: trusted networks only): "
         "recapture = a swap recaptures CUDA graphs; resident = every base MoE layer serves from a preallocated "
         "dense slot (memory of the bf16 experts), so a swap copies in place and keeps the captured graphs",
         vllm_name="VLLM_ENABLE_EXL3_CARTRIDGE"),
    Knob("CARTRIDGE_FAULTS", False, "flag", help="testing: cartridge requests may inject a failure "
         "(inject_fault: prepare, commit or recapture) to exercise the rollback"),
)}


def get(name: str, environ: dict[str, str] | None = None):
    """Current value of knob `name` (without the SGLANG_EXL3_ prefix)."""
    return KNOBS[name].read(environ)


def validate_all(environ: dict[str, str] | None = None) -> dict[str, object]:
    """Parse every knob and reject unknown SGLANG_EXL3_* variables; returns the values."""
    env = os.environ if environ is None else environ
    unknown = sorted(k for k in env if k.startswith(PREFIX) and k[len(PREFIX):] not in KNOBS)
    if unknown:
        raise KnobError(f"unknown variable(s) {', '.join(unknown)}; known: "
                        f"{', '.join(k.env for k in KNOBS.values())}")
    values = {name: knob.read(env) for name, knob in KNOBS.items()}
    if values["TRELLIS_MIN_M"] > values["TRELLIS_MAX_M"]:
        raise KnobError(f"SGLANG_EXL3_TRELLIS_MIN_M ({values['TRELLIS_MIN_M']}) exceeds "
                        f"SGLANG_EXL3_TRELLIS_MAX_M ({values['TRELLIS_MAX_M']})")
    return values
