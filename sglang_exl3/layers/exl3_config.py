"""`Exl3Config`: SGLang's QuantizationConfig for EXL3 checkpoints (`--quantization exl3`).

SGLang hands `from_config` only config.json's `quantization_config` (plus `hf_config` and the
model's `packed_modules_mapping`); the per-module records live in the sidecar
`quantization_config.json`, so the checkpoint folder is found through `hf_config._name_or_path`
and validated in full at startup (every problem listed; nothing fails mid-serve). The no-argument
constructor is the pass-through config SGLang builds for a bf16 draft model served under
`--quantization exl3`: everything stays unquantized.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from typing import Any

import torch
from sglang.srt.layers.linear import LinearBase
from sglang.srt.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

from sglang_exl3 import knobs
from sglang_exl3.format import Exl3Checkpoint, Exl3ModuleRecord, load_checkpoint
from sglang_exl3.layers import nextn, qwen3_5_mtp
from sglang_exl3.layers.embedding import Exl3EmbeddingMethod, tied_embeddings_error
from sglang_exl3.layers.linear import Exl3LinearMethod

logger = logging.getLogger(__name__)

_QKV_IDS = ("q", "k", "v")
# Fused SGLang layers and their checkpoint sources. Many SGLang model classes (llama, qwen3, ...)
# declare no packed_modules_mapping, so these standard ones are always known; a model's own
# mapping is added on top.
DEFAULT_PACKED_MODULES = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
_LAYER_ID = re.compile(r"\.layers\.(\d+)\.")
_ONLINE_DEFAULT = re.compile(r"(^|\.)layers\.\d+\.")  # online encoding: the decoder layers' linears
_FP8_ALIGN = 16  # SGLang's per-tensor FP8 linear: K and N in multiples of this
_ROUTER = re.compile(r"\.(gate|shared_expert_gate)$")  # ... except MoE routers, which stay BF16 as exllamav3 keeps them


def _candidates(key: str) -> list[str]:
    """Spellings of a module key to try against the checkpoint (exact first): with/without a leading
    `model.`, and with one `model` / `language_model` segment collapsed anywhere."""
    out = [key]
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part in ("model", "language_model"):
            out.append(".".join(parts[:i] + parts[i + 1:]))
    out += [c[len("model."):] for c in list(out) if c.startswith("model.")]
    out += ["model." + c for c in list(out) if not c.startswith("model.")]
    return list(dict.fromkeys(out))


class Exl3Config(QuantizationConfig):
    def __init__(self, checkpoint: Exl3Checkpoint | None = None):
        super().__init__()
        self.checkpoint = checkpoint
        if checkpoint is None:
            _activate(self)  # a pass-through (bf16 draft) config: hooks must not inject the target's
        self.packed_modules_mapping = dict(DEFAULT_PACKED_MODULES)
        self.claimed: set[str] = set()  # checkpoint modules some SGLang layer will load
        self.rank_sliced = None  # RankSlicedSpec of a hybrid_tr3_tail checkpoint
        self.rank_sliced_rank: int | None = None  # the .rank{r} slices this process loads
        self.r7 = None  # R7Spec of a checkpoint with quantization_config.r7_routed_experts
        self.nextn_layer: int | None = None  # the checkpoint layer a NextN draft builds as `model.decoder`
        self.mtp_draft = False  # a Qwen3.5 MTP draft: its `mtp.*` block is served, its lm_head is the target's
        self._plain_index: dict[str, Exl3ModuleRecord] | None = None
        self._checked_claims = False
        self.online_bits = knobs.get("ONLINE_BITS") if checkpoint is None else None  # BF16 encoded at load
        self.online = checkpoint is None and bool(self.online_bits or knobs.get("ONLINE_FP8"))
        self.online_claimed: list[str] = []

    def __repr__(self) -> str:
        where = self.checkpoint.path if self.checkpoint else "pass-through (unquantized)"
        return f"Exl3Config({where}, {len(self.checkpoint.modules) if self.checkpoint else 0} EXL3 modules)"

    def get_name(self) -> str:
        return "exl3"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # SGLang then builds Exl3Config() for a draft without quantization_config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Exl3Config:
        knobs.validate_all()  # a bad SGLANG_EXL3_* value stops the model load, naming the variable
        hf_config = config.get("hf_config")
        path = getattr(hf_config, "_name_or_path", None) or config.get("model_path")
        if not path or not os.path.isdir(path):
            raise ValueError(f"EXL3 needs the checkpoint folder to read quantization_config.json, but the model "
                             f"path is {path!r}; pass a local folder to --model-path")
        from sglang_exl3.format.rank_sliced import RANK_SLICED_WEIGHT_RE, RankSlicedError
        from sglang_exl3.format.tail import parse_tail

        rank_sliced = None
        tail = config.get("hybrid_tr3_tail") or getattr(hf_config, "hybrid_tr3_tail", None)
        if tail is not None:
            rank_sliced = parse_tail({"hybrid_tr3_tail": tail}, path)  # RankSlicedError naming the offending key
        from sglang_exl3.format import r7

        r7_spec = r7.parse(r7.block_of(config)) if r7.claims(config) else None  # R7Error naming the key
        _check_embedding_knob(hf_config)
        ckpt = load_checkpoint(path)  # raises Exl3FormatError listing every problem
        sliced = next((n for n in ckpt.tensors if RANK_SLICED_WEIGHT_RE.match(n)), None)
        if rank_sliced is None and sliced is not None:
            raise RankSlicedError(f"{path} holds rank-sliced EXL3 tensors ({sliced}, ...) but the EXL3 quantization "
                                  "config received no hybrid_tr3_tail, so its experts would load as garbage; "
                                  "config.json needs the hybrid_tr3_tail block the checkpoint was written with")
        logger.info("EXL3 checkpoint %s: %d EXL3 modules, codebooks %s%s", path, len(ckpt.modules),
                    sorted({m.codebook.label for m in ckpt.modules.values()}),
                    f", rank-sliced experts ({rank_sliced.bits} bits, tp={rank_sliced.tp}, "
                    f"{rank_sliced.rotation_layout})" if rank_sliced else
                    f", R7 experts (layers {list(r7_spec.moe_layers)}, K {list(r7_spec.k_values)})" if r7_spec else "")
        _check_vision_unquantized(ckpt)
        out = cls(ckpt)
        out.rank_sliced = rank_sliced
        out.r7 = r7_spec
        out.nextn_layer = nextn.nextn_layer(hf_config)
        if out.nextn_layer is not None:  # NextNError naming the missing or wrongly quantized MTP tensors
            nextn.check_stored(ckpt.tensors, ckpt.modules, out.nextn_layer, path, hf_config.architectures[0])
        out.mtp_draft = qwen3_5_mtp.is_mtp_draft(hf_config)
        if out.mtp_draft:  # MtpError naming the missing `mtp.*` tensors
            text = getattr(hf_config, "text_config", hf_config)
            qwen3_5_mtp.check_stored(ckpt.tensors, path, hf_config.architectures[0],
                                     int(getattr(text, "mtp_num_hidden_layers", 1) or 1))
        out.packed_modules_mapping.update(config.get("packed_modules_mapping") or {})
        _activate(out)
        return out

    def update_packed_modules_mapping(self, mapping: dict) -> None:
        self.packed_modules_mapping = {**DEFAULT_PACKED_MODULES, **mapping}

    def check_all_claimed(self) -> None:
        """Once the model is built: every EXL3 module of the checkpoint must belong to an EXL3 layer.

        SGLang's weight loaders skip names they do not know, so an EXL3 matrix whose SGLang layer
        was built unquantized (a name mismatch) would vanish silently and leave garbage weights.
        Layers this model does not build are not required, each stack of layers counted on its own: other pipeline
        stages, and MTP / next-token layers when speculation is off (`mtp.layers.0.*` beside `model.layers.0.*`, or
        `model.layers.{num_hidden_layers}.*`); those are logged.
        """
        if self._checked_claims or self.checkpoint is None:
            return
        self._checked_claims = True
        built = {_stack_layer(k) for k in self.claimed} - {None}
        unclaimed = {k: _stack_layer(k) for k in self.checkpoint.modules if k not in self.claimed}
        lost = sorted(k for k, stack in unclaimed.items() if stack is None or stack in built)
        unbuilt = sorted({".".join(stack) for stack in unclaimed.values() if stack not in (None, *built)})
        if unbuilt:
            logger.info("EXL3: the checkpoint's layers %s are not built by this model (other pipeline stages, or MTP "
                        "layers without speculative decoding); their EXL3 modules are not loaded", unbuilt)
        if lost:
            raise ValueError(f"{len(lost)} EXL3 module(s) of {self.checkpoint.path} have no EXL3 layer in the SGLang "
                             f"model, so their weights would be dropped: {lost[:8]}{' ...' if len(lost) > 8 else ''}. "
                             "The model's layer names differ from the checkpoint's; add the fused layer to the "
                             "model's packed_modules_mapping")

    def check_rank_sliced_layers(self, model: torch.nn.Module) -> None:
        """After loading: every built layer whose rank-sliced experts the checkpoint holds runs them as EXL3. A layer
        SGLang built without our MoE method (a dense MLP where the checkpoint has experts, an MoE class the config
        does not recognise) would have its `.rank{r}` tensors skipped by the loader and serve garbage."""
        from sglang_exl3.format.rank_sliced import RANK_SLICED_WEIGHT_RE, RankSlicedError

        if self.rank_sliced is None or self.checkpoint is None:
            return
        stored = {int(m.group(1)) for n in self.checkpoint.tensors
                  if RANK_SLICED_WEIGHT_RE.match(n) and (m := _LAYER_ID.search(n))}
        built, served = set(), set()  # built: the layer has its MLP here (pipeline parallelism builds a stand-in)
        for name, module in model.named_modules():
            name = nextn.checkpoint_prefix(name, self.nextn_layer)
            if (m := _LAYER_ID.search(f".{name}.")) is not None:
                if name.endswith(f"layers.{m.group(1)}.mlp"):
                    built.add(int(m.group(1)))
                if hasattr(module, "exl3_experts"):
                    served.add(int(m.group(1)))
        lost = sorted((stored & built) - served)
        if lost:
            raise RankSlicedError(f"{self.checkpoint.path}: layers {lost} hold rank-sliced EXL3 experts, but SGLang "
                                  "built them without the EXL3 MoE method (a dense MLP, or an MoE layer class this "
                                  "plugin does not know), so their expert weights would be dropped; check the "
                                  "model config against hybrid_tr3_tail.moe_layers")

    def get_scaled_act_names(self) -> list[str]:
        return []

    # -- which layers are EXL3 ------------------------------------------------------------------
    def record_for(self, key: str) -> Exl3ModuleRecord | None:
        if self.checkpoint is None:
            return None
        for cand in _candidates(key):
            if cand in self.checkpoint.modules:
                return self.checkpoint.modules[cand]
        if self._plain_index is None:  # exllamav3 keeps `model.language_model.` where SGLang's text classes drop it
            plain = {k: _plain(k) for k in self.checkpoint.modules}
            counts = Counter(plain.values())
            self._plain_index = {p: self.checkpoint.modules[k] for k, p in plain.items() if counts[p] == 1}
        return self._plain_index.get(_plain(key))

    def _source_records(self, prefix: str) -> dict[object, Exl3ModuleRecord | None]:
        """Shard id -> record of each checkpoint matrix behind the SGLang layer at `prefix`."""
        head, _, last = prefix.rpartition(".")
        sources = self.packed_modules_mapping.get(last)
        if not sources:
            return {None: self.record_for(prefix)}
        ids = _QKV_IDS if last == "qkv_proj" and len(sources) == 3 else range(len(sources))
        return {sid: self.record_for(f"{head}.{src}" if head else src) for sid, src in zip(ids, sources, strict=True)}

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        prefix = nextn.checkpoint_prefix(prefix, self.nextn_layer)  # a NextN draft's `model.decoder` layer
        if isinstance(layer, ParallelLMHead):
            record = self.record_for(prefix or "lm_head")
            if record is None:
                return None
            _check_token_map(record.key)
            self.claimed.add(record.key)
            if self.mtp_draft:  # served by the target's head, which SGLang's draft worker hands over
                return qwen3_5_mtp.TargetHeadMethod(record.key)
            return Exl3LinearMethod({None: record}, prefix or "lm_head", self)
        if isinstance(layer, VocabParallelEmbedding):  # BF16 in EXL3 checkpoints; int8/int6 at load on request
            bits = knobs.get("EMBED_ONLINE_BITS")
            if bits and type(layer) is VocabParallelEmbedding and self.checkpoint is not None:
                return Exl3EmbeddingMethod(int(bits), prefix)
            return None
        if isinstance(layer, LinearBase):
            if self.online:
                return self._online_method(prefix, layer)
            records = self._source_records(prefix)
            found = {sid: r for sid, r in records.items() if r is not None}
            if not found:
                return UnquantizedLinearMethod()
            if len(found) != len(records):
                missing = [sid for sid, r in records.items() if r is None]
                raise ValueError(f"Packed EXL3 projection {prefix} mixes EXL3 and unquantized source shards "
                                 f"(not EXL3: {missing}); a fused module must use one quantization scheme")
            self.claimed |= {r.key for r in found.values()}
            return Exl3LinearMethod(found, prefix, self)
        if _is_moe(layer):
            return self._moe_method(layer, prefix)
        return None

    def _online_method(self, prefix: str, layer: torch.nn.Module, moe: bool = False):
        """A BF16 checkpoint under --quantization exl3 with online knobs: the decoder's linears (never routers or the
        lm_head) whose prefix matches SGLANG_EXL3_ONLINE_FP8 run SGLang's FP8 (weights quantized at load) where
        their per-rank sizes suit its GEMMs; the linears and routed experts matching SGLANG_EXL3_ONLINE_MODULES
        (default: all) are encoded to EXL3 when SGLANG_EXL3_ONLINE_BITS is set (layers/online_linear.py,
        online_moe.py; any size: shards are padded); the rest stay BF16."""
        from sglang_exl3.layers.online_linear import Exl3OnlineLinearMethod, OnlineProgress

        decoder = _ONLINE_DEFAULT.search(prefix) and not _ROUTER.search(prefix)
        fp8 = knobs.get("ONLINE_FP8")
        if decoder and not moe and fp8 is not None and self._selects(fp8, prefix, "SGLANG_EXL3_ONLINE_FP8"):
            unaligned = _fp8_unaligned(layer)
            if unaligned is None:
                from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod

                self.online_claimed.append(prefix)
                return Fp8LinearMethod(Fp8Config(is_checkpoint_fp8_serialized=False,
                                                 packed_modules_mapping=self.packed_modules_mapping))
            logger.warning("SGLANG_EXL3_ONLINE_FP8 selects %s, but FP8 GEMMs need whole multiples of %d and its %s; "
                           "it falls back to %s", prefix, _FP8_ALIGN, unaligned,
                           "EXL3 if SGLANG_EXL3_ONLINE_MODULES selects it, else BF16" if self.online_bits else "BF16")
        pattern = knobs.get("ONLINE_MODULES")
        if not (decoder and self.online_bits
                and (pattern is None or self._selects(pattern, prefix, "SGLANG_EXL3_ONLINE_MODULES"))):
            return None if moe else UnquantizedLinearMethod()
        self.online_claimed.append(prefix)
        self.online_progress = getattr(self, "online_progress", None) or OnlineProgress()
        self.online_progress.total += 1
        if moe:
            from sglang_exl3.layers.online_moe import Exl3OnlineMoEMethod

            return Exl3OnlineMoEMethod(prefix, self.online_bits, self, self.online_progress)
        return Exl3OnlineLinearMethod(prefix, self.online_bits, self.online_progress, self._part_names(prefix))

    def _selects(self, pattern: str, prefix: str, knob: str) -> bool:
        """Whether `pattern` selects the layer at `prefix`: by its own name, or by the names of the checkpoint modules
        fused into it (q_proj / k_proj / v_proj in qkv_proj), all of them or none: a fused layer has one scheme."""
        if re.search(pattern, prefix):
            return True
        parts = self._part_names(prefix)
        matched = [p for p in parts if re.search(pattern, p)]
        if matched and len(matched) != len(parts):
            raise ValueError(f"{knob}={pattern!r} selects {matched} but not {sorted(set(parts) - set(matched))}, which "
                             f"SGLang fuses into {prefix}: a fused module runs one quantization scheme; select all "
                             "of its parts or none")
        return bool(matched)

    def _part_names(self, prefix: str) -> list[str]:
        """The checkpoint modules fused into the layer at `prefix` (model.layers.0.self_attn.q_proj, ... for its
        qkv_proj); empty for a layer that fuses nothing."""
        head, _, last = prefix.rpartition(".")
        return [f"{head}.{src}" if head else src for src in self.packed_modules_mapping.get(last, ())]

    def check_online_claimed(self) -> None:
        """After loading: SGLANG_EXL3_ONLINE_MODULES must have matched a linear (a typo must not serve BF16)."""
        if self.checkpoint is None and self.online and not self.online_claimed:
            raise ValueError(f"online quantization is on (SGLANG_EXL3_ONLINE_BITS={self.online_bits}, "
                             f"SGLANG_EXL3_ONLINE_FP8={knobs.get('ONLINE_FP8')!r}) but no linear of the model was "
                             f"selected (SGLANG_EXL3_ONLINE_MODULES={knobs.get('ONLINE_MODULES')!r}); fix the patterns "
                             "or unset the knobs")

    def _moe_method(self, layer: torch.nn.Module, prefix: str):
        """Exl3MoEMethod when the layer's experts are EXL3 in the checkpoint, None when none is."""
        from sglang_exl3.layers.moe import Exl3MoEMethod

        n = getattr(layer, "num_experts", None)
        if self.online and n is not None:
            return self._online_method(prefix, layer, moe=True)
        if self.checkpoint is None or n is None:
            return None
        layer_id = _LAYER_ID.search(f".{prefix}.")
        if self.rank_sliced is not None and layer_id and self.rank_sliced.covers(int(layer_id.group(1))):
            return self._rank_sliced_moe_method(layer, prefix, int(layer_id.group(1)))
        if self.r7 is not None and layer_id and self.r7.covers(int(layer_id.group(1))):
            return self._r7_moe_method(layer, prefix, int(layer_id.group(1)))
        for names in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
            records = {(e, role): self.record_for(f"{prefix}.{e}.{name}")
                       for e in range(n) for role, name in zip(("w1", "w3", "w2"), names, strict=True)}
            found = {k: r for k, r in records.items() if r is not None}
            if not found:
                continue
            if len(found) != len(records):
                missing = sorted({f"{e}.{role}" for (e, role), r in records.items() if r is None})[:6]
                raise ValueError(f"EXL3 MoE {prefix}: some experts are not EXL3 in the checkpoint ({missing} ...); "
                                 "all routed experts of a layer must use one quantization scheme")
            self.claimed |= {r.key for r in found.values()}
            return Exl3MoEMethod(found, prefix, self)
        return None

    def _r7_moe_method(self, layer: torch.nn.Module, prefix: str, layer_id: int):
        """R7 experts: whole per-expert tensors at per-projection bitrates (sliced for MoE tensor parallelism at load,
        like exllamav3's), the layer's shared hidden-side rotations loaded into expert 0's slot
        (`integration.hooks.rank_sliced_weights` renames them)."""
        from sglang_exl3.format.r7 import R7Error, expert_records, packed_bytes
        from sglang_exl3.layers.moe import Exl3MoEMethod

        if getattr(layer, "moe_ep_size", 1) > 1:
            raise R7Error(f"{prefix}: R7 experts share one hidden-side rotation per layer, loaded with expert 0, so "
                          "expert parallelism cannot split them; drop --ep-size (MoE tensor parallelism slices them)")
        inter = getattr(layer, "intermediate_size_per_partition", 0) * getattr(layer, "moe_tp_size", 1)
        records = expert_records(self.checkpoint.tensors, self.r7, prefix, layer_id, layer.num_experts,
                                 layer.hidden_size, inter)
        tight, padded = packed_bytes(records)
        logger.info("EXL3 R7 layer %d: %.1f MiB of trellis at per-projection K (%.1f MiB padded to the widest K)",
                    layer_id, tight / 2**20, padded / 2**20)
        self.claimed |= {r.key for r in records.values()}
        return Exl3MoEMethod(records, prefix, self, shared_h=True)

    def _rank_sliced_moe_method(self, layer: torch.nn.Module, prefix: str, layer_id: int):
        """Experts stored per tensor-parallel rank: this rank's slices, already cut, loaded under their
        normalised names (`integration.hooks.rank_sliced_weights` drops the other ranks' tensors)."""
        from sglang_exl3.format.rank_sliced import RankSlicedError, check_runtime, expert_records
        from sglang_exl3.layers.moe import Exl3MoEMethod

        spec = self.rank_sliced
        if getattr(layer, "moe_ep_size", 1) > 1:
            raise RankSlicedError(f"{prefix}: a rank-sliced EXL3 checkpoint holds each expert cut across tp={spec.tp} "
                                  "ranks; expert parallelism cannot serve it. Drop --ep-size")
        rank, size = getattr(layer, "moe_tp_rank", 0), getattr(layer, "moe_tp_size", 1)
        check_runtime(spec, size, layer.num_experts)
        if spec.profile is not None:  # a cartridge base: every rank reads the full-rank experts and slices them
            self.rank_sliced_rank = 0
            return Exl3MoEMethod(expert_records(self.checkpoint.tensors, spec, prefix, layer_id, 0), prefix, self,
                                 base_digest=spec.compatibility_by_layer[layer_id])
        self.rank_sliced_rank = rank
        records = expert_records(self.checkpoint.tensors, spec, prefix, layer_id, rank)
        return Exl3MoEMethod(records, prefix, self, pre_sliced=True,
                             shared_h=spec.rotation_layout == "shared_h_v1")


def _stack_layer(key: str) -> tuple[str, str] | None:
    """(the layer stack, the layer index) of a module key: `mtp.layers.0.mlp.down_proj` -> ("mtp.layers", "0"); an MTP
    block's own modules (`mtp.fc`) form the stack ("mtp", "")."""
    m = _LAYER_ID.search(f".{key}.")
    if m is None:
        return ("mtp", "") if key.startswith(qwen3_5_mtp.PREFIX) else None
    return (key[: m.start()] + "layers", m.group(1))


def _plain(key: str) -> str:
    """A module key without `language_model` segments or a leading `model.`: the spelling both sides share."""
    parts = [p for p in key.split(".") if p != "language_model"]
    return ".".join(parts[1:] if parts[:1] == ["model"] else parts)


_ACTIVE: Exl3Config | None = None  # the Exl3Config most recently created in this process


def _activate(config: Exl3Config | None) -> None:
    """Record the EXL3 config of the model about to be built. SGLang builds each model (target, then draft) right
    after creating its quantization config, and some of its model classes build their `ParallelLMHead` without
    passing it on: the plugin's hooks read this to hand them the config (integration/hooks.py)."""
    global _ACTIVE
    _ACTIVE = config


def active_config() -> Exl3Config | None:
    """The EXL3 config of the model being built (None when the last model built was not EXL3)."""
    return _ACTIVE


def deactivate() -> None:
    """A model that is not EXL3 is about to be built: no hook may hand it the last EXL3 model's config."""
    _activate(None)


def _check_embedding_knob(hf_config) -> None:
    """SGLANG_EXL3_EMBED_ONLINE_BITS replaces the embedding table's weight; refuse a tied lm_head, which would read
    it (a draft that shares the table is handed the encoded one: layers/draft_sharing.py)."""
    bits = knobs.get("EMBED_ONLINE_BITS")
    if not bits:
        return
    if getattr(hf_config, "tie_word_embeddings", False) or getattr(getattr(hf_config, "text_config", None),
                                                                    "tie_word_embeddings", False):
        raise tied_embeddings_error(bits)


_VISION = re.compile(r"(^|\.)(visual|vision_tower|vision_model)\.")


def _check_vision_unquantized(ckpt: Exl3Checkpoint) -> None:
    """SGLang's vision towers take unquantized weights (their fused projections are built from single checkpoint
    matrices that no EXL3 record describes); a tower exllamav3 quantized (`--vision_bits` 1-8) is refused at startup,
    naming the modules, rather than stopping later on modules no layer claimed."""
    vision = sorted(k for k in ckpt.modules if _VISION.search(k))
    if vision:
        raise ValueError(f"{ckpt.path} stores {len(vision)} vision-tower module(s) as EXL3 ({vision[:3]}"
                         f"{' ...' if len(vision) > 3 else ''}); SGLang's vision layers take unquantized weights. "
                         "Convert with exllamav3's --vision_bits 16 (its default for Qwen3-VL-style towers)")


def _fp8_unaligned(layer: torch.nn.Module) -> str | None:
    """What keeps a linear off SGLang's FP8 GEMMs (per-tensor FP8 runs CUTLASS / torch scaled-mm kernels that take
    whole multiples of 16 in K and N): None when this rank's input and output sizes both are multiples."""
    from sglang.srt.layers.linear import ColumnParallelLinear, RowParallelLinear
    from sglang.srt.runtime_context import get_parallel

    tp = get_parallel().tp_size
    k, n = layer.input_size, layer.output_size
    if isinstance(layer, RowParallelLinear):
        k //= tp
    elif isinstance(layer, ColumnParallelLinear):
        n //= tp
    bad = [f"{side} size {size} per rank" for side, size in (("input", k), ("output", n)) if size % _FP8_ALIGN]
    return " and ".join(bad) or None


def _check_token_map(key: str) -> None:
    """`--speculative-token-map` gives an EAGLE draft the target head's rows of its hot tokens (`head[hot_ids]`); an
    EXL3 head has no dense rows to take (the draft shares the whole head module instead)."""
    from sglang.srt.server_args import get_global_server_args

    try:
        token_map = get_global_server_args().speculative_token_map
    except (AttributeError, ValueError):  # no server (a tool or a test that built no ServerArgs)
        return
    if token_map:
        raise ValueError(f"--speculative-token-map {token_map}: the EAGLE draft would take rows of the target's "
                         f"lm_head, but {key} is EXL3 (no dense rows); drop the token map (the draft then shares the "
                         "whole EXL3 head), or serve a checkpoint whose lm_head is unquantized (exllamav3 -hb 16)")


def _is_moe(layer: torch.nn.Module) -> bool:
    return type(layer).__name__ in ("FusedMoE", "EPMoE", "DeepEPMoE", "FlashInferFusedMoE")
