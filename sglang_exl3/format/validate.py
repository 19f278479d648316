"""Fail-closed validation of EXL3 checkpoints; every rule names the module, the tensor and the fix.

Rules follow exllamav3's loader (`LinearEXL3.__init__`, `get_codebook_marker`) and the reference
vLLM implementation's `_validate_storage_metadata`.
"""

from __future__ import annotations

from sglang_exl3.format import r7
from sglang_exl3.format.checkpoint import Exl3Checkpoint, Exl3ModuleRecord
from sglang_exl3.format.constants import (
    ALIGN,
    EMPTY_STORAGE_MESSAGE,
    EXL3_SUFFIXES,
    HALF_BITS,
    MARKER_VALUES,
    SIDECAR_NAME,
    Codebook,
)
from sglang_exl3.format.errors import Problem
from sglang_exl3.format.json_values import is_number
from sglang_exl3.format.rank_sliced import RANK_SLICED_WEIGHT_RE, claims
from sglang_exl3.format.safetensors_index import FLOAT_CODES, TensorInfo

REEXPORT = "re-export this module with exllamav3's converter"


# Names of another method's quantization scales (modelopt / compressed-tensors FP8, NVFP4): a rank-sliced hybrid
# checkpoint's non-expert layers must be plain weights, which sglang-exl3 serves unquantized.
_FOREIGN_SCALES = (".weight_scale", ".input_scale", ".weight_scale_2", ".weight_global_scale")


def _hybrid_problems(ckpt: Exl3Checkpoint) -> list[Problem]:
    """A rank-sliced (`hybrid_tr3_tail`) or R7 checkpoint: its quantization_config may name another method and the
    per-module sidecar may be absent (then everything but the routed experts is unquantized); but non-expert
    weights quantized in another format cannot be served as plain weights."""
    foreign = sorted(n for n, t in ckpt.tensors.items()
                     if (t.dtype.startswith("F8") or n.endswith(_FOREIGN_SCALES))
                     and not RANK_SLICED_WEIGHT_RE.match(n))
    if not foreign:
        return []
    return [Problem(f"{len(foreign)} non-expert tensor(s) are quantized in another format (e.g. {foreign[:3]}); "
                    "sglang-exl3 serves a rank-sliced checkpoint's non-expert layers unquantized only",
                    fix="use the checkpoint's BF16 variant of the non-expert layers")]


def _r7_spec(ckpt: Exl3Checkpoint):
    """The checkpoint's R7 spec, or None (no block, or a malformed one: _r7_problems reports it)."""
    if not ckpt.config or not r7.claims(ckpt.config):
        return None
    try:
        return r7.parse(r7.block_of(ckpt.config))
    except r7.R7Error:
        return None


def _r7_problems(ckpt: Exl3Checkpoint) -> list[Problem]:
    """The R7 block parses, and no R7 expert is also listed in tensor_storage (R7 experts live outside it)."""
    try:
        spec = r7.parse(r7.block_of(ckpt.config))
    except r7.R7Error as e:
        return [Problem(str(e), fix="re-export the checkpoint with the R7 producer")]
    listed = sorted(k for k in ckpt.tensor_storage if spec.covers_name(k + "."))
    out = [Problem(message, fix="re-export the layer with the R7 producer")
           for message in r7.check_layers(ckpt.tensors, spec, ckpt.config)]
    if listed:
        out.append(Problem(f"{len(listed)} routed expert module(s) of the R7 layers {list(spec.moe_layers)} are also "
                        f"listed in {SIDECAR_NAME} (e.g. {listed[:3]}); R7 experts are described by "
                        f"quantization_config.{r7.BLOCK} only", fix=f"remove them from {SIDECAR_NAME}"))
    return out


def _config_problems(ckpt: Exl3Checkpoint) -> list[Problem]:
    if ckpt.config and (claims(ckpt.config) or r7.claims(ckpt.config)):
        # quantization_config and the sidecar may name another method / be absent
        out = _hybrid_problems(ckpt) + (_r7_problems(ckpt) if r7.claims(ckpt.config) else [])
    else:
        out = _exl3_config_problems(ckpt)
    if not ckpt.tensors and ckpt.config:
        out.append(Problem("no safetensors files found", fix="copy the model's *.safetensors files"))
    return out


def _exl3_config_problems(ckpt: Exl3Checkpoint) -> list[Problem]:
    out = []
    qc = ckpt.config.get("quantization_config") if ckpt.config else None
    if ckpt.config and not isinstance(qc, dict):
        out.append(Problem("config.json has no quantization_config: this is not an EXL3 checkpoint",
                           fix="serve it without --quantization exl3, or convert it with exllamav3"))
    elif ckpt.config and qc.get("quant_method") != "exl3":
        out.append(Problem(f"config.json quantization_config.quant_method is {qc.get('quant_method')!r}, "
                           "not 'exl3'", fix="use the quantization method the checkpoint was made with"))
    if ckpt.sidecar is None or not isinstance(ckpt.sidecar.get("tensor_storage"), dict) \
            or not ckpt.sidecar["tensor_storage"]:
        missing = "missing" if ckpt.sidecar is None else "has no tensor_storage"
        out.append(Problem(f"{SIDECAR_NAME} {missing}. {EMPTY_STORAGE_MESSAGE}",
                           fix=f"copy {SIDECAR_NAME} from the exllamav3 output folder"))
    return out


def _well_formed(entry) -> bool:
    """A tensor_storage entry is an object whose stored_tensors (if any) is an object."""
    return isinstance(entry, dict) and isinstance(entry.get("stored_tensors", {}), dict)


def _storage_entries(ckpt: Exl3Checkpoint):
    """(key, entry, stored_tensors) of every well-formed tensor_storage entry (_storage_problems reports the rest)."""
    for key, entry in ckpt.tensor_storage.items():
        if _well_formed(entry):
            yield key, entry, entry.get("stored_tensors", {})


def _is_exl3_entry(key: str, entry: dict, stored: dict) -> bool:
    return entry.get("quant_format") == "exl3" or f"{key}.trellis" in stored


def _module_keys(ckpt: Exl3Checkpoint) -> list[str]:
    """Per-module EXL3 keys. A rank-sliced checkpoint's `.rank{r}` expert slices are not per-module EXL3: they
    follow `hybrid_tr3_tail` (format/rank_sliced.py) and are left out here."""
    keys = {n[: -len(".trellis")] for n in ckpt.tensors if n.endswith(".trellis")}
    if claims(ckpt.config):
        keys = {k for k in keys if not RANK_SLICED_WEIGHT_RE.match(f"{k}.trellis")}
    if (spec := _r7_spec(ckpt)) is not None:  # R7 experts: format/r7.py checks them, layer by layer
        keys = {k for k in keys if not spec.covers_name(f"{k}.trellis")}
    keys |= {key for key, entry, stored in _storage_entries(ckpt) if _is_exl3_entry(key, entry, stored)}
    return sorted(keys)


# What every EXL3 record of tensor_storage must list (the reference's rule): the trellis and both scales.
REQUIRED_STORED = (("trellis",), ("suh", "su"), ("svh", "sv"))


def _storage_problems(ckpt: Exl3Checkpoint) -> list[Problem]:
    """tensor_storage must describe the files: every listed tensor exists with that shape, and every EXL3 record
    lists its trellis and both scales."""
    out = []
    for key, entry in ckpt.tensor_storage.items():
        if not _well_formed(entry):
            out.append(Problem("tensor_storage entry is not an object with stored_tensors", module=key,
                               fix=f"regenerate {SIDECAR_NAME} with exllamav3"))
    for key, entry, stored in _storage_entries(ckpt):
        if _is_exl3_entry(key, entry, stored):
            for names in REQUIRED_STORED:
                if not any(f"{key}.{n}" in stored for n in names):
                    out.append(Problem(f"the EXL3 record in {SIDECAR_NAME} does not list {' or '.join(names)}",
                                       module=key, tensor=f"{key}.{names[0]}",
                                       fix=f"regenerate {SIDECAR_NAME} with exllamav3"))
        for name, meta in stored.items():
            info = ckpt.tensors.get(name)
            shape = meta.get("shape") if isinstance(meta, dict) else None
            if info is None:
                out.append(Problem(f"listed in {SIDECAR_NAME} but missing from the safetensors files",
                                   module=key, tensor=name, fix="copy every shard of the checkpoint"))
            elif shape is not None and (not isinstance(shape, list) or tuple(shape) != info.shape):
                out.append(Problem(f"shape {list(info.shape)} in the file but {shape!r} in "
                                   f"{SIDECAR_NAME}", module=key, tensor=name,
                                   fix="the sidecar and the shards come from different exports"))
    return out


def _marker_value(info: TensorInfo) -> int:
    return int.from_bytes(info.read_bytes(), "little")


def _check_vector(out: list[Problem], key: str, info: TensorInfo, length: int, what: str) -> None:
    if info.dtype != "F16" or len(info.shape) != 1 or info.shape[0] != length:
        out.append(Problem(f"must be fp16 [{length}] ({what}), got {info.torch_dtype_name} "
                           f"{list(info.shape)}", module=key, tensor=info.name, fix=REEXPORT))


def _check_signs(out: list[Problem], key: str, info: TensorInfo, length: int) -> None:
    if info.dtype != "I16" or len(info.shape) != 1 or info.shape[0] * 16 != length:
        out.append(Problem(f"legacy sign bitfield must be int16 [{length // 16}], got "
                           f"{info.torch_dtype_name} {list(info.shape)}", module=key, tensor=info.name,
                           fix=REEXPORT))


def _bits_of(words: int, mul1: bool, out: list[Problem], key: str, name: str) -> float | int | None:
    if words % 16 == 0 and 1 <= words // 16 <= 8:
        return words // 16
    if words % 16 == 8 and (words - 8) / 16 + 0.5 in HALF_BITS:
        bits = (words - 8) / 16 + 0.5
        if not mul1:
            out.append(Problem(f"half-bit rate {bits} needs the mul1 codebook (exllamav3 writes x.5 "
                               "rates with MUL1 only)", module=key, tensor=name, fix=REEXPORT))
            return None
        return bits
    out.append(Problem(f"last dimension {words} is not 16*bits for bits in 1..8 (or 16*KA+8 for "
                       "the MUL1 half rates 1.5/2.5/3.5)", module=key, tensor=name, fix=REEXPORT))
    return None


def check_module(ckpt: Exl3Checkpoint, key: str) -> tuple[Exl3ModuleRecord | None, list[Problem]]:
    out: list[Problem] = []
    prefix = key + "."
    parts = {n[len(prefix):]: i for n, i in ckpt.tensors.items()
             if n.startswith(prefix) and "." not in n[len(prefix):]}
    if "signs" in parts and not {"suh", "su"} & set(parts):
        return None, [Problem("quantized embedding table (exllamav3's --embed_bits ring codec: trellis + signs) "
                              "is not supported", module=key, tensor=prefix + "signs",
                              fix="re-export with --embed_bits 16 (exllamav3's default)")]
    for suffix in sorted(set(parts) - set(EXL3_SUFFIXES)):
        out.append(Problem(f"unexpected tensor '{suffix}' in an EXL3 module", module=key,
                           tensor=prefix + suffix, fix="remove it or re-export with exllamav3"))
    trellis = parts.get("trellis")
    if trellis is None:
        out.append(Problem("EXL3 module has no trellis tensor", module=key, tensor=prefix + "trellis",
                           fix="copy every shard of the checkpoint"))
        return None, out
    # Codebook markers: int32 scalars with fixed values; both at once is an error.
    present = {}
    for marker, value in MARKER_VALUES.items():
        info = parts.get(marker)
        if info is None:
            continue
        if info.dtype != "I32" or info.shape != ():
            out.append(Problem(f"codebook marker must be a scalar int32, got {info.torch_dtype_name} "
                               f"{list(info.shape)}", module=key, tensor=info.name, fix=REEXPORT))
        elif (stored := _marker_value(info)) != value:
            out.append(Problem(f"codebook marker holds {stored:#x}, expected {value:#x}", module=key,
                               tensor=info.name, fix="this codebook variant is not supported"))
        present[marker] = True
    if len(present) == 2:
        out.append(Problem("both mcg and mul1 markers present: the codebook is ambiguous", module=key,
                           tensor=prefix + "mcg", fix="keep exactly one marker (or none for 3INST)"))
    codebook = Codebook.from_markers(False, "mul1" in present) if len(present) == 2 else \
        Codebook.from_markers("mcg" in present, "mul1" in present)
    # Trellis: int16 [K/16, N/16, 16*bits]
    bits = None
    if trellis.dtype != "I16":
        out.append(Problem(f"trellis must be int16, got {trellis.torch_dtype_name}", module=key,
                           tensor=trellis.name, fix=REEXPORT))
    if len(trellis.shape) != 3:
        out.append(Problem(f"trellis must have rank 3 [K/16, N/16, 16*bits], got {list(trellis.shape)}",
                           module=key, tensor=trellis.name, fix=REEXPORT))
        return None, out
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    bits = _bits_of(trellis.shape[2], codebook == Codebook.MUL1, out, key, trellis.name)
    for dim, size in (("K (in features)", k), ("N (out features)", n)):
        if size % ALIGN:
            out.append(Problem(f"packed {dim} = {size} is not a multiple of {ALIGN}", module=key,
                               tensor=trellis.name, fix="exllamav3 pads to 128; re-export the module"))
    # Input / output scales: fp16 suh/svh, or legacy int16 sign bitfields su/sv.
    for new, old, length, what in (("suh", "su", k, "K"), ("svh", "sv", n, "N")):
        if new in parts and old in parts:
            out.append(Problem(f"both {new} and legacy {old} present", module=key,
                               tensor=prefix + old, fix=f"keep only {new}"))
        elif new in parts:
            _check_vector(out, key, parts[new], length, what)
        elif old in parts:
            _check_signs(out, key, parts[old], length)
        else:
            out.append(Problem(f"missing {new} (or legacy {old})", module=key, tensor=prefix + new,
                               fix="copy every shard of the checkpoint"))
    if (bias := parts.get("bias")) is not None and (
            bias.dtype not in FLOAT_CODES or len(bias.shape) != 1 or bias.shape[0] != n):
        out.append(Problem(f"bias must be a float vector of length N={n}, got {bias.torch_dtype_name} "
                           f"{list(bias.shape)}", module=key, tensor=bias.name, fix=REEXPORT))
    # The sidecar's per-module summary must agree with the tensors.
    entry = ckpt.tensor_storage.get(key)
    entry = entry if isinstance(entry, dict) else {}
    bpw = entry.get("bits_per_weight")
    if bpw is not None and not is_number(bpw):
        out.append(Problem(f"{SIDECAR_NAME} says bits_per_weight={bpw!r}, which is not a number", module=key,
                           fix="the sidecar and the shards disagree"))
    elif bpw is not None and bits is not None and float(bpw) != float(bits):
        out.append(Problem(f"{SIDECAR_NAME} says bits_per_weight={bpw} but the trellis holds {bits}",
                           module=key, tensor=trellis.name, fix="the sidecar and the shards disagree"))
    for marker in MARKER_VALUES:
        listed = f"{marker}_multiplier" in entry
        if entry and listed != (marker in present) and "quant_format" in entry:
            out.append(Problem(f"{SIDECAR_NAME} {'lists' if listed else 'omits'} {marker}_multiplier "
                               f"but the module {'lacks' if listed else 'has'} a .{marker} marker",
                               module=key, fix="the sidecar and the shards disagree"))
    if out:
        return None, out
    record = Exl3ModuleRecord(key=key, tensors=parts, bits=bits, codebook=codebook,
                              in_features=k, out_features=n)
    return record, out


def validate_checkpoint(ckpt: Exl3Checkpoint) -> None:
    """Fill ckpt.modules with valid records and append every problem to ckpt.problems."""
    ckpt.problems.extend(_config_problems(ckpt))
    ckpt.problems.extend(_storage_problems(ckpt))
    keys = _module_keys(ckpt)
    storage = ckpt.tensor_storage
    for key in keys:
        if storage and key not in storage:
            ckpt.problems.append(Problem(f"EXL3 tensors present but the module is not in {SIDECAR_NAME}",
                                         module=key, fix=f"regenerate {SIDECAR_NAME} with exllamav3"))
        record, problems = check_module(ckpt, key)
        ckpt.problems.extend(problems)
        if record is not None:
            ckpt.modules[key] = record
    if storage and not keys:
        ckpt.problems.append(Problem(f"{SIDECAR_NAME} has no EXL3 tensor records",
                                     fix="this checkpoint holds no EXL3 modules; serve it unquantized"))
