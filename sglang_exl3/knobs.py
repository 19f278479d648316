"""Every `SGLANG_EXL3_*` knob, parsed and validated in one place, in sections by audience.

- user: what a deployment sets (README.md).
- moe: the MoE dispatch plan's bounds (docs/moe.md); the vLLM fork's `SGLANG_EXL3_*` spellings stay aliases.
- dev: kernel A/B switches, `SGLANG_EXL3_DEV_*` (docs/kernels.md): a served model never needs them.
- test: fault injection, `SGLANG_EXL3_TEST_*`.

Blank means unset (compose/k8s render unset variables as ""). A bad value raises `KnobError` naming the variable;
`validate_all()` runs at plugin registration so that a typo, a removed knob or an old spelling fails at startup,
never mid-serve. Semantics and defaults follow the reference vLLM implementation's `VLLM_EXL3_*` knobs where one
exists (`vllm_name`).
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field, replace

from sglang_exl3.native_paths import UnsafeNativePath, check_native_path

PREFIX = "SGLANG_EXL3_"
AUDIENCES = ("user", "moe", "dev", "test")


class KnobError(ValueError):
    """An SGLANG_EXL3_* environment variable holds a value that cannot be used, or is not a knob (any more)."""


@dataclass(frozen=True, eq=False)
class Knob:
    """One variable. kind: choice, int (minimum..maximum), auto_int (`auto` or unset: None, else an int), flag,
    regex, path, or a native-code path (native_file, native_file_or_dir: loaded into every server process)."""

    name: str  # without the prefix
    default: object
    kind: str
    choices: tuple[str, ...] = ()
    help: str = ""
    vllm_name: str | None = None
    minimum: int = 1
    maximum: int | None = None
    alias: str | None = None  # a second accepted name (without the prefix); setting both is an error
    refused: dict[str, str] = field(default_factory=dict)  # value -> why it is refused and what to set instead
    audience: str = ""  # set by its section

    @property
    def env(self) -> str:
        return PREFIX + self.name

    def _raw(self, env: dict[str, str]) -> tuple[str, str]:
        """(the variable that is set, its stripped value); the value is "" where neither name is set."""
        value = env.get(self.env, "").strip()
        if self.alias is None:
            return self.env, value
        alias_env = PREFIX + self.alias
        old = env.get(alias_env, "").strip()
        if old and value:
            raise KnobError(f"{self.env} and its alias {alias_env} are both set; set only {self.env}")
        return (alias_env, old) if old else (self.env, value)

    def _int_range(self) -> str:
        if self.maximum is None:
            return "a positive integer" if self.minimum == 1 else f"an integer of at least {self.minimum}"
        return f"an integer from {self.minimum} to {self.maximum}"

    def read(self, environ: dict[str, str] | None = None):
        var, raw = self._raw(os.environ if environ is None else environ)
        if raw == "":
            return self.default
        if raw.lower() in self.refused:
            raise KnobError(f"{var}={raw} is refused: {self.refused[raw.lower()]}")
        if self.kind == "choice":
            value = raw.lower()
            if value not in self.choices:
                raise KnobError(f"{var} must be one of {', '.join(self.choices)} or unset, got {raw!r}")
            return value
        if self.kind in ("int", "auto_int"):
            if self.kind == "auto_int" and raw.lower() == "auto":
                return None
            try:
                value = int(raw)
            except ValueError:
                also = "auto, " if self.kind == "auto_int" else ""
                raise KnobError(f"{var} must be {also}{self._int_range()} or unset, got {raw!r}") from None
            if value < self.minimum:
                least = "positive" if self.minimum == 1 else f"at least {self.minimum}"
                raise KnobError(f"{var} must be {least}, got {value}")
            if self.maximum is not None and value > self.maximum:
                raise KnobError(f"{var} must be at most {self.maximum}, got {value}")
            return value
        if self.kind == "flag":
            if raw not in ("0", "1"):
                raise KnobError(f"{var} must be 0 or 1 or unset, got {raw!r}")
            return raw == "1"
        if self.kind == "regex":
            try:
                re.compile(raw)
            except re.error as e:
                raise KnobError(f"{var} is not a valid regular expression ({e}): {raw!r}") from None
            return raw
        if self.kind == "path":
            return os.path.expanduser(raw)
        if self.kind in ("native_file", "native_file_or_dir"):
            try:
                return check_native_path(raw, var, self.kind.removeprefix("native_"))
            except UnsafeNativePath as e:
                raise KnobError(str(e)) from None
        raise AssertionError(self.kind)


def _section(audience: str, *knobs: Knob) -> tuple[Knob, ...]:
    """The knobs of one audience: the table reads in sections and no row repeats its audience."""
    return tuple(replace(k, audience=audience) for k in knobs)


USER = _section(
    "user",
    Knob("BACKEND", "auto", "choice", ("auto", "cuda", "exllamav3", "torch"),
         "dense GEMM backend: auto = our CUDA kernels (built on first use where nvcc exists), else a prebuilt "
         "exllamav3 extension, else the torch reference",
         refused={"triton": "the Triton backend was removed because it measured slower than our CUDA kernels "
                            "(4-8x bf16's time); use auto or cuda"}),
    Knob("KERNEL_LIB", None, "native_file", help="prebuilt libexl3_trellis .so (else the per-user build cache)"),
    Knob("AUTO_BUILD", True, "flag", help="auto backend: compile our CUDA kernels at first load when nvcc is "
         "found and none are built (~1-2 min, once per GPU arch and source version; 0: never compile in a server)"),
    Knob("EXT_PATH", None, "native_file_or_dir", help="folder or .so of a prebuilt exllamav3_ext to import",
         vllm_name="VLLM_EXL3_EXT_PATH"),
    Knob("LOG_PATH_SELECTION", False, "flag", help="log the backend chosen for every EXL3 layer",
         vllm_name="VLLM_EXL3_LOG_PATH_SELECTION"),
    Knob("EMBED_ONLINE_BITS", None, "choice", ("8", "6"), "the input embedding table held as int8 or int6 with a "
         "scale per row, encoded at load (unset: BF16 as in the checkpoint)", vllm_name="VLLM_EXL3_EMBED_ONLINE_BITS"),
    Knob("ONLINE_BITS", None, "int", help="serve a BF16 / FP16 checkpoint under --quantization exl3 with its decoder "
         "linears encoded to EXL3 at this bitrate at load (uncalibrated, MCG; unset: BF16)",
         vllm_name="VLLM_EXL3_ONLINE_TRELLIS_BITS", maximum=8),
    Knob("ONLINE_MODULES", None, "regex", help="online encoding: only the linears whose SGLang prefix matches this "
         "regex (unset: every decoder linear); a regex that matches nothing stops the load"),
    Knob("ONLINE_FP8", None, "regex", help="serve the decoder linears of a BF16 / FP16 checkpoint whose SGLang prefix "
         "matches this regex with SGLang's FP8 linear method (weights quantized at load; never the lm_head or routers) "
         "instead of EXL3 or BF16"),
    Knob("ONLINE_CACHE", "readwrite", "choice", ("readwrite", "readonly", "off"),
         "online encoding cache: readwrite, readonly (a miss is encoded, never stored) or off",
         vllm_name="VLLM_EXL3_ONLINE_CACHE_MODE",
         refused={old: f"spell it {new}" for old, new in (("rw", "readwrite"), ("read-write", "readwrite"),
                                                          ("ro", "readonly"), ("read-only", "readonly"),
                                                          ("none", "off"))}),
    Knob("ONLINE_CACHE_DIR", None, "path", help="online encoding cache folder (unset: ~/.cache/sglang_exl3/online); "
         "must not be writable by group or others", vllm_name="VLLM_EXL3_ONLINE_CACHE_DIR"),
    Knob("CARTRIDGES", "off", "choice", ("off", "recapture", "resident"), "expert cartridges on an "
         "exl3-msrt-base/1 checkpoint and their HTTP endpoints (unauthenticated: trusted networks only): "
         "recapture = a swap recaptures CUDA graphs; resident = every base MoE layer serves from a preallocated "
         "dense slot (memory of the bf16 experts), so a swap copies in place and keeps the captured graphs",
         vllm_name="VLLM_ENABLE_EXL3_CARTRIDGE"),
    Knob("CHECK_OUTPUTS", False, "flag", help="debugging: recompute every eager EXL3 linear/MoE forward from its "
         "weights in fp32 and log the layer, rows and path where they disagree (slow)"),
)

MOE = _section(
    "moe",
    Knob("MOE_DECODE_MIN_M", 1, "int", help="fewest rows of the MoE decode plan; fewer take the eager parity path "
         "(refused under CUDA-graph capture)", vllm_name="VLLM_EXL3_TRELLIS_MIN_M", alias="TRELLIS_MIN_M"),
    Knob("MOE_DECODE_MAX_M", 32, "int", help="most rows of the MoE decode plan; more take the prefill plan (the "
         "parity path with MOE_PREFILL_PLAN=0)",
         vllm_name="VLLM_EXL3_TRELLIS_MAX_M", alias="TRELLIS_MAX_M"),
    Knob("MOE_PARITY_CHUNK", 128, "int", help="rows per chunk of the MoE parity path (its staging rows while the "
         "prefill plan is on); must cover the rows below MOE_DECODE_MIN_M", vllm_name="VLLM_EXL3_PREFILL_CHUNK",
         alias="PREFILL_CHUNK"),
    Knob("MOE_PREFILL_PLAN", True, "flag", help="the MoE prefill plan above MOE_DECODE_MAX_M rows; 0: those batches "
         "take the parity path (eager only)", vllm_name="VLLM_EXL3_PREFILL_TRELLIS", alias="PREFILL_TRELLIS"),
)

DEV = _section(
    "dev",
    Knob("DEV_FUSED_MAX_M", None, "auto_int", help="dense linears on our CUDA kernels: the most rows the fused decode "
         "GEMM serves; above, reconstruct + cuBLAS. auto (None): the kernels choose, 256 where the wgmma ring "
         "serves, else 128", maximum=256),
    Knob("DEV_ONE_LAUNCH_MAX_M", 1, "int", help="dense linears and fused q/k/v, gate/up layers (not the lm_head) on "
         "our CUDA kernels with at most this many rows run as one launch, the input and output rotations folded into "
         "the GEMM; 0: three launches at every m", minimum=0, maximum=16),
    Knob("DEV_ONE_LAUNCH_MAX_WEIGHTS", 4194304, "int", help="the one-launch form only for layers of at most this "
         "many weights per rank (K x N over the sources); larger layers run three launches. As CUDA-graph replays "
         "three launches beat one on large layers (4096 x 4096: 0.89x, 1536 x 8192: 0.79x) and lose on small ones "
         "(1536 x 2560: 1.12x); end to end on Llama-3-8B (every linear above 4194304) three programmatic launches "
         "decode 1.046x faster at batch 1 (H100)", maximum=1 << 40),
    Knob("DEV_ROTATION_FORM", "auto", "choice", ("auto", "warp", "octet"), "our CUDA kernels: the form of the "
         "Hadamard rotation launches, one warp or eight threads per 128-block (the same values); auto: eight threads "
         "from a measured size"),
    Knob("DEV_WGMMA", "auto", "choice", ("auto", "off"), "our CUDA kernels on Hopper: the x-ring GEMM as warpgroup "
         "MMAs (wgmma) fed by the weight decode in registers; auto: where the kernel build has them (sm_90a); off: "
         "the mma.sync ring"),
    Knob("DEV_WG_ROTATING", "one-split", "choice", ("one-split", "off"), "our CUDA kernels on Hopper: a same-input "
         "group or single linear on the wgmma ring (33-64 rows) whose rows run at one K split (Llama-3-8B gate/up) "
         "rotates its output in the GEMM launch, with no split-K partials in global memory (the same values; batch "
         "64 +1.9% decode tok/s, H100); off: the partials and an output rotation launch",
         refused={"1": "the cluster form at every split count was removed because it measured 0.90x the decode "
                       "tok/s at batch 64 (H100, docs/decisions.md); use one-split or off",
                  "0": "spell it off"}),
    Knob("DEV_PDL", True, "flag", help="our CUDA kernels: the one-launch linears and the MoE decode forward launch as "
         "programmatic dependents of the kernel before them (their first weight loads overlap its end); 0: plain "
         "launches, the same values"),
    Knob("DEV_PDL_THREE_LAUNCH", True, "flag", help="our CUDA kernels: the three-launch path's input and output "
         "rotations and its x-slice GEMM (up to 64 rows) launch as programmatic dependents, each waiting only where "
         "it reads the launch before it; the same values. Batch 1 step 4,066 against 4,294 µs with plain launches "
         "(H100); 0: plain launches"),
)

TEST = _section(
    "test",
    Knob("TEST_CARTRIDGE_FAULTS", False, "flag", help="testing: cartridge requests may inject a failure "
         "(inject_fault: prepare, commit or recapture) to exercise the rollback"),
)

KNOBS: dict[str, Knob] = {k.name: k for k in (*USER, *MOE, *DEV, *TEST)}
ALIASES: dict[str, str] = {k.alias: k.name for k in KNOBS.values() if k.alias}  # alias -> knob

# Old names kept as errors, so that a deployment still setting one learns why and what to set instead.
RENAMED: dict[str, str] = {
    **{old: "DEV_" + old for old in ("FUSED_MAX_M", "ONE_LAUNCH_MAX_M", "ONE_LAUNCH_MAX_WEIGHTS", "ROTATION_FORM",
                                     "WGMMA", "PDL", "PDL_THREE_LAUNCH")},
    "WG_CLUSTER": "DEV_WG_ROTATING",
    "CARTRIDGE_FAULTS": "TEST_CARTRIDGE_FAULTS",
}
_UNREAD = "was removed: no kernel read it; unset it"
REMOVED: dict[str, str] = {  # name -> the whole message
    "TRELLIS_BLOCK_M": f"{PREFIX}TRELLIS_BLOCK_M {_UNREAD}",
    "PREFILL_BLOCK_M": f"{PREFIX}PREFILL_BLOCK_M {_UNREAD}",
    "TWO_LAUNCH_MAX_M": f"{PREFIX}TWO_LAUNCH_MAX_M was removed with the two-launch form, which lost to three "
                        "launches (docs/decisions.md); unset it",
    **{old: f"{PREFIX}{old} is now {PREFIX}{new} (a "
            f"{'developer knob, docs/kernels.md' if new.startswith('DEV_') else 'test knob, docs/cartridges.md'})"
       for old, new in RENAMED.items()},
}


def get(name: str, environ: dict[str, str] | None = None):
    """Current value of knob `name` (without the SGLANG_EXL3_ prefix); a removed name raises KnobError."""
    if name in REMOVED:
        raise KnobError(REMOVED[name])
    return KNOBS[name].read(environ)


def validate_all(environ: dict[str, str] | None = None) -> dict[str, object]:
    """Parse every knob; refuse removed and unknown SGLANG_EXL3_* variables. Returns the values by knob name."""
    env = os.environ if environ is None else environ
    names = {k[len(PREFIX):]: v for k, v in env.items() if k.startswith(PREFIX)}
    removed = [REMOVED[n] for n in sorted(names) if n in REMOVED and names[n].strip()]
    if removed:
        raise KnobError("; ".join(removed))
    unknown = sorted(PREFIX + n for n in names if n not in KNOBS and n not in ALIASES and n not in REMOVED)
    if unknown:
        every = [k.env for k in KNOBS.values()] + [PREFIX + a for a in ALIASES]
        hints = [f"{close[0]} for {u}" for u in unknown if (close := difflib.get_close_matches(u, every, 1, 0.8))]
        raise KnobError(f"unknown variable(s) {', '.join(unknown)}" + (f" (did you mean {', '.join(hints)}?)"
                                                                       if hints else "") +
                        f"; the knobs: {', '.join(k.env for k in USER)} (README.md), MoE plan knobs in docs/moe.md, "
                        "developer knobs in docs/kernels.md")
    values = {name: knob.read(env) for name, knob in KNOBS.items()}
    if values["MOE_DECODE_MIN_M"] > values["MOE_DECODE_MAX_M"]:
        raise KnobError(f"SGLANG_EXL3_MOE_DECODE_MIN_M ({values['MOE_DECODE_MIN_M']}) exceeds "
                        f"SGLANG_EXL3_MOE_DECODE_MAX_M ({values['MOE_DECODE_MAX_M']})")
    return values
