"""Plugin hooks (SGLang's HookRegistry; no SGLang file is edited).

`rank_sliced_quant_config`: claims rank-sliced (`hybrid_tr3_tail`) and R7 EXL3 MoE checkpoints for `exl3`;
`rank_sliced_weights`: gives the model this rank's expert slices under their per-expert names (R7: the layers'
shared rotations under expert 0's).

`lm_head_quant_config`: some SGLang model classes (Mixtral, ...) build `ParallelLMHead` without
passing `quant_config`, so an EXL3 `lm_head` would be built unquantized and its `.trellis` tensors
skipped by the loader. While a model is being built from an EXL3 checkpoint whose `lm_head` is EXL3,
the head gets the EXL3 config. The "active" config is the one SGLang created last in this process:
SGLang builds each model (target, then draft) right after creating its quantization config.

`embedding_quant_config`: likewise for the input embedding when `SGLANG_EXL3_EMBED_ONLINE_BITS` is set, so that
every model's table is encoded, not only those of the classes that pass their config on (Mixtral does not).
`draft_shares_target_modules` gives EAGLE / MTP drafts the target's EXL3 lm_head and encoded embedding table;
`tied_head_refused` stops a head tied to an encoded table.

`mixtral_through_fused_moe`: SGLang swaps `MixtralForCausalLM` for `QuantMixtralForCausalLM` (a loop over
per-expert MLPs that runs every expert on every token, with its own fp16 routing) for every quantization
method outside a short list. EXL3 has a FusedMoE method, so its Mixtral keeps the real model class.

`moe_topk_layer_id`: SGLang 0.5.17's Mixtral builds its `TopK` without the layer id it was given, so
`--enable-return-routed-experts` crashes any Mixtral server (EXL3 or not) when the routed-expert capturer
indexes its buffer with None; the hook hands the block's layer id to its TopK when the model left it unset.
"""

from __future__ import annotations

from sglang_exl3 import knobs
from sglang_exl3.layers.exl3_config import Exl3Config, active_config


def lm_head_quant_config(original, self, *args, **kwargs):
    config = active_config()
    if kwargs.get("quant_config") is None and config is not None and config.checkpoint is not None:
        if config.record_for(kwargs.get("prefix") or "lm_head") is not None:
            kwargs["quant_config"] = config
    return original(self, *args, **kwargs)


def embedding_quant_config(original, self, *args, **kwargs):
    """AROUND `VocabParallelEmbedding.__init__`: with SGLANG_EXL3_EMBED_ONLINE_BITS set, an exact
    `VocabParallelEmbedding` of an EXL3 model built without a quantization config gets the model's (a
    `ParallelLMHead` runs this too, through super().__init__, and is left alone)."""
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    config = active_config()
    if (type(self) is VocabParallelEmbedding and kwargs.get("quant_config") is None and config is not None
            and config.checkpoint is not None and knobs.get("EMBED_ONLINE_BITS")):
        kwargs["quant_config"] = config
    return original(self, *args, **kwargs)


def _claimed_by_exl3(hf_config, user_quant: str | None) -> bool:
    """A rank-sliced (`hybrid_tr3_tail`, format exl3-trellis) or R7 (`quantization_config.r7_routed_experts`)
    checkpoint is EXL3 whatever its quant_method says, unless the user asked for another method."""
    from sglang_exl3.format import r7
    from sglang_exl3.format.rank_sliced import override_quantization_method

    tail = getattr(hf_config, "hybrid_tr3_tail", None)
    if override_quantization_method({"hybrid_tr3_tail": tail}, user_quant) == "exl3":
        return True
    quant = getattr(hf_config, "quantization_config", None)
    quant = quant if isinstance(quant, dict) else getattr(quant, "to_dict", lambda: None)()
    return isinstance(quant, dict) and r7.claims(quant) and user_quant in (None, "exl3")


def draft_shares_target_modules(original, self, *args, **kwargs):
    """AROUND the speculative draft workers' hand-over (`EagleDraftWorker.init_lm_head`,
    `MultiLayerEagleDraftWorker.init_lm_head`, `FrozenKVMTPDraftWorker.__init__`): SGLang gives each draft model the
    target's embedding and lm_head weights, which an EXL3 head and an int8 / int6 table leave as [0, H] stubs; the
    draft then uses the target's head module and looks up the target's encoded table (or keeps its own table where
    that is encoded differently)."""
    from sglang_exl3.layers.draft_sharing import share_with_draft

    result = original(self, *args, **kwargs)
    runners = [getattr(self, "draft_runner", None), getattr(self, "draft_model_runner", None),
               *(getattr(self, "draft_runner_list", None) or [])]
    for runner in runners:
        if getattr(runner, "model", None) is not None:
            share_with_draft(runner.model)
    return result


def tied_head_refused(original, self, embed_tokens, *args, **kwargs):
    """AROUND `ParallelLMHead.tie_weights`: a head tied to an int8 / int6 table would read its [0, H] stub."""
    source = getattr(getattr(embed_tokens, "weight", None), "exl3_source", None)
    if source is not None:
        from sglang_exl3.layers.embedding import tied_embeddings_error

        raise tied_embeddings_error(source.quant_method.bits)
    return original(self, embed_tokens, *args, **kwargs)


def rank_sliced_quant_config(original, self, *args, **kwargs):
    """AROUND `ModelConfig._parse_quant_hf_config`: a checkpoint with `hybrid_tr3_tail` (format exl3-trellis) or
    an R7 block is EXL3 even when its `quantization_config` names another method such as modelopt (the reference's
    rule; otherwise its experts would silently load as that method), unless the user asked for a different
    method. SGLang only shows `quantization_config` to the quantization classes, hence a hook on the parse."""
    parsed = original(self, *args, **kwargs)
    tail = getattr(self.hf_config, "hybrid_tr3_tail", None)
    if _claimed_by_exl3(self.hf_config, getattr(self, "quantization", None)):
        parsed = {**(parsed or {}), "quant_method": "exl3",
                  **({"hybrid_tr3_tail": tail} if tail is not None else {}),
                  "checkpoint_quant_method": (parsed or {}).get("checkpoint_quant_method",
                                                                (parsed or {}).get("quant_method"))}
        # The model loader builds the quantization config from hf_config.quantization_config, not from this
        # parse: without the claim there, a hybrid (no quantization_config) got a pass-through config and one
        # naming exl3 lost its tail, and either way the experts loaded as unquantized garbage.
        self.hf_config.quantization_config = dict(parsed)
    return parsed


def rank_sliced_weights(original, model, weights, target_device):
    """AROUND `DefaultModelLoader.load_weights_and_postprocess`: for a rank-sliced EXL3 checkpoint, the model sees
    this rank's `.rank{r}` expert slices under their plain per-expert names (shared-H rotations under expert 0's)
    and never the other ranks' tensors -- what the reference implementation's model loaders do before
    auto-loading. Every other checkpoint passes through untouched; once it has loaded, a BF16 model under the online
    knobs must have had some layer selected (`Exl3Config.check_online_claimed`)."""
    config = getattr(model, "quant_config", None)
    if getattr(config, "rank_sliced", None) is None and getattr(config, "r7", None) is None:
        config = active_config()
    if getattr(config, "r7", None) is not None:
        return original(model, _r7_normalized(weights, config.r7), target_device)
    if getattr(config, "rank_sliced", None) is None:
        result = original(model, weights, target_device)
        if hasattr(config, "check_online_claimed"):
            config.check_online_claimed()  # online encoding: the module pattern selected something
        return result
    result = original(model, _normalized(weights, config.rank_sliced, config.rank_sliced_rank or 0), target_device)
    config.check_rank_sliced_layers(model)  # SGLang's loader skips names no module takes: nothing may vanish
    return result


def _normalized(weights, spec, rank: int):
    from sglang_exl3.format.rank_sliced import normalize_weight_name

    for name, tensor in weights:
        local = normalize_weight_name(name, rank, spec)
        if local is not None:
            yield local, tensor


def _r7_normalized(weights, spec):
    """An R7 layer's shared hidden-side rotations under expert 0's names (gate_up_suh under gate's and up's)."""
    from sglang_exl3.format.r7 import normalize_weight_name

    for name, tensor in weights:
        for local in normalize_weight_name(name, spec):
            yield local, tensor


def is_exl3_checkpoint(server_args, hf_config) -> bool:
    """Whether SGLang will load this checkpoint with our method: `--quantization exl3`, or no other method asked for and
    an EXL3 `quantization_config`, a claimed `hybrid_tr3_tail` or an R7 block."""
    asked = getattr(server_args, "quantization", None)
    if asked == "exl3":
        return True
    if asked is not None:
        return False
    quant = getattr(hf_config, "quantization_config", None) or {}
    if isinstance(quant, dict) and quant.get("quant_method") == "exl3":
        return True
    return _claimed_by_exl3(hf_config, asked)


def keep_shared_experts_apart(server_args, hf_config) -> dict:
    """Model-override provider (every architecture): on CUDA SGLang folds a shared expert into the routed FusedMoE as
    one more expert (DeepSeek-V3 with 256 experts, GLM-4.5 MoE: `mlp.shared_experts.*` loaded as `mlp.experts.{E}`).
    EXL3 routed experts are per-expert checkpoint records that the MoE method loads by id, and the shared expert is not
    one of them (EXL3 linears of its own, or unquantized in the reference's hybrid checkpoints), so for an EXL3
    checkpoint the fusion is off, declared at startup like SGLang's own model overrides."""
    if is_exl3_checkpoint(server_args, hf_config):
        return {"disable_shared_experts_fusion": True}
    return {}


def register_model_overrides() -> None:
    from sglang.srt.arg_groups import overrides

    registered = getattr(overrides, "_PREDICATE_OVERRIDE_FNS", [])  # plugins may load twice in one process
    if not any(fn is keep_shared_experts_apart for _, fn in registered):
        overrides.register_model_override_predicate(lambda architecture: True)(keep_shared_experts_apart)


def mixtral_through_fused_moe(original, model_config, *args, **kwargs):
    """AROUND `model_loader.utils.get_model_architecture`: an EXL3 Mixtral resolves to `MixtralForCausalLM`
    (FusedMoE, so `Exl3MoEMethod` and SGLang's own TopK routing), not to the per-expert `QuantMixtralForCausalLM`
    that SGLang picks for quantization methods it does not list. Without this the EXL3 server ran all experts
    densely and routed differently from an fp16 Mixtral served by the same SGLang."""
    archs = getattr(getattr(model_config, "hf_config", None), "architectures", None) or []
    if getattr(model_config, "quantization", None) != "exl3" or "MixtralForCausalLM" not in archs:
        return original(model_config, *args, **kwargs)
    model_config.quantization = None  # the swap is keyed on a quantization method outside SGLang's list
    try:
        return original(model_config, *args, **kwargs)
    finally:
        model_config.quantization = "exl3"


def moe_topk_layer_id(original, self, *args, **kwargs):
    """AROUND a sparse-MoE block's `__init__` (Mixtral): its TopK gets the block's `layer_id` if it has none.
    (The two servers' captures can only agree because the EXL3 Mixtral keeps its real class and TopK:
    see `mixtral_through_fused_moe`.)"""
    import inspect

    result = original(self, *args, **kwargs)
    layer_id = inspect.signature(original).bind(self, *args, **kwargs).arguments.get("layer_id")
    topk = getattr(self, "topk", None)
    if topk is not None and getattr(topk, "layer_id", 0) is None and layer_id is not None:
        topk.layer_id = layer_id
    return result


def mtp_fc_quantized(original, self, *args, **kwargs):
    """AROUND `Qwen3_5ForCausalLMMTP.__init__`: an EXL3 `mtp.fc` (exllamav3's default `--mtp_bits 4` quantizes it) gets
    an EXL3 layer where the class builds a plain `nn.Linear` (layers/plain_linear.py)."""
    result = original(self, *args, **kwargs)
    config = getattr(self, "quant_config", None)
    if isinstance(config, Exl3Config):
        from sglang_exl3.layers.plain_linear import quantize_plain_linear

        quantize_plain_linear(self, "fc", config, "mtp.fc")
    return result


# NextN modules whose forward calls `eh_proj` as a ReplicatedLinear when it is one (deepseek_nextn.py); the others
# call it as an nn.Linear
_NEXTN_TUPLE_EH_PROJ = frozenset({"DeepseekModelNextN"})


def nextn_eh_proj_quantized(original, self, *args, **kwargs):
    """AROUND the DeepSeek / GLM NextN modules' `__init__`: an EXL3 `model.layers.{N}.eh_proj` (exllamav3 quantizes it
    at `--mtp_bits`, e.g. GLM-4.7-Flash) gets an EXL3 layer where the module builds a plain `nn.Linear`."""
    import inspect

    result = original(self, *args, **kwargs)
    config = inspect.signature(original).bind(self, *args, **kwargs).arguments.get("quant_config")
    if isinstance(config, Exl3Config) and config.nextn_layer is not None:
        from sglang_exl3.layers.plain_linear import quantize_plain_linear

        quantize_plain_linear(self, "eh_proj", config, f"model.layers.{config.nextn_layer}.eh_proj",
                              tuple_output=type(self).__name__ in _NEXTN_TUPLE_EH_PROJ)
    return result


def qwen3_5_text_weights(original, self, weights, *args, **kwargs):
    """AROUND the Qwen3.5 text classes' `load_weights` (qwen3_5_text.py), which drop two kinds of names an exllamav3
    checkpoint has: the trunk under `model.language_model.*` (exllamav3's only Qwen3.5 layout; these classes' rename
    expects the VL class's prefix), which reaches them as `model.*`, as the VL class loads it; and an EXL3 lm_head's
    tensors (`lm_head.trellis`, ...: they load `lm_head.weight` alone), which go to the head's own loader."""
    trunk = "model.language_model."
    params = dict(self.named_parameters())
    direct: set[str] = set()

    def routed():
        for name, tensor in weights:
            if name.startswith(trunk):
                name = "model." + name[len(trunk):]
            if name.startswith("lm_head.") and name != "lm_head.weight" and name in params:
                params[name].weight_loader(params[name], tensor)
                direct.add(name)
                continue
            yield name, tensor

    loaded = original(self, routed(), *args, **kwargs)
    return (loaded | direct) if isinstance(loaded, set) else loaded


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.layers.vocab_parallel_embedding.ParallelLMHead.__init__",
                          lm_head_quant_config, HookType.AROUND)
    HookRegistry.register("sglang.srt.layers.vocab_parallel_embedding.VocabParallelEmbedding.__init__",
                          embedding_quant_config, HookType.AROUND)
    HookRegistry.register("sglang.srt.layers.vocab_parallel_embedding.ParallelLMHead.tie_weights",
                          tied_head_refused, HookType.AROUND)
    for worker in ("eagle_worker_v2.EagleDraftWorker.init_lm_head",
                   "multi_layer_eagle_worker_v2.MultiLayerEagleDraftWorker.init_lm_head",
                   "frozen_kv_mtp_worker_v2.FrozenKVMTPDraftWorker.__init__"):
        HookRegistry.register(f"sglang.srt.speculative.{worker}", draft_shares_target_modules, HookType.AROUND)
    HookRegistry.register("sglang.srt.configs.model_config.ModelConfig._parse_quant_hf_config",
                          rank_sliced_quant_config, HookType.AROUND)
    HookRegistry.register("sglang.srt.model_loader.loader.DefaultModelLoader.load_weights_and_postprocess",
                          rank_sliced_weights, HookType.AROUND)
    HookRegistry.register("sglang.srt.model_loader.utils.get_model_architecture",
                          mixtral_through_fused_moe, HookType.AROUND)
    HookRegistry.register("sglang.srt.models.mixtral.MixtralMoE.__init__", moe_topk_layer_id, HookType.AROUND)
    HookRegistry.register("sglang.srt.models.qwen3_5_mtp.Qwen3_5ForCausalLMMTP.__init__", mtp_fc_quantized,
                          HookType.AROUND)
    for module in ("deepseek_nextn.DeepseekModelNextN", "glm4_moe_nextn.Glm4MoeModelNextN",
                   "glm4_moe_lite_nextn.Glm4MoeLiteModelNextN"):
        HookRegistry.register(f"sglang.srt.models.{module}.__init__", nextn_eh_proj_quantized, HookType.AROUND)
    HookRegistry.register("sglang.srt.models.qwen3_5_text.Qwen3_5ForCausalLM.load_weights", qwen3_5_text_weights,
                          HookType.AROUND)  # Qwen3_5MoeForCausalLM inherits it
    from sglang_exl3.integration import cartridge_server

    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.init_request_dispatcher",
                          cartridge_server.add_scheduler_handler, HookType.AFTER)
    HookRegistry.register("sglang.srt.entrypoints.http_server._setup_and_run_http_server",
                          cartridge_server.add_routes, HookType.BEFORE)
