"""Helpers to build SGLang's real model classes and layers on a machine without a GPU (and, on the GPU machine,
on the GPU: `sglang_runtime(device="cuda")`).

One process-wide setup: plugins loaded, server args published, a 1-rank gloo process group.
The only patch, on the CPU: SGLang's rotary-embedding module decides "not CUDA and not CPU-engine mode" means
"import vLLM's rotary kernel" (absent here, never called by these tests); it is told it runs on
the CPU, which it does.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from sglang_exl3.integration.server import free_port


@cache
def _runtime(device: str) -> None:
    from conftest import DENSE_CKPTS

    model_path = str(DENSE_CKPTS[0])
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    if device == "cpu":
        import sglang.srt.layers.rotary_embedding.base as rope_base

        rope_base._is_cpu = True
    args = ServerArgs(model_path=model_path, device=device,
                      attention_backend="torch_native" if device == "cpu" else "triton", sampling_backend="pytorch")
    set_global_server_args_for_scheduler(args)
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    if not model_parallel_is_initialized():  # another helper (benchmarks.common, a GPU test) may have set it up
        initialize_model_parallel(tensor_model_parallel_size=1)
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.dp_attention import initialize_dp_attention

    initialize_dp_attention(args, ModelConfig(model_path))


def sglang_runtime(model_path: str | None = None, device: str = "cpu") -> None:
    """Process-wide SGLang setup (once per process, for one device; the model path only seeds the published server
    args)."""
    if _runtime.cache_info().currsize and device not in _DEVICES:
        raise RuntimeError(f"SGLang's runtime is set up for {_DEVICES} in this process, not {device}")
    _DEVICES.add(device)
    _runtime(device)


_DEVICES: set[str] = set()


def exl3_config(path: Path):
    """What SGLang's get_quant_config builds: config.json's quantization_config, the hf_config and the
    model class's own packed_modules_mapping (often none)."""
    from sglang.srt.models.registry import ModelRegistry
    from transformers import AutoConfig

    from sglang_exl3.layers import Exl3Config

    hf = AutoConfig.from_pretrained(path)
    model_cls, _ = ModelRegistry.resolve_model_cls(hf.architectures)
    qc = dict(hf.quantization_config)
    qc.update(hf_config=hf, packed_modules_mapping=dict(getattr(model_cls, "packed_modules_mapping", {})))
    return hf, Exl3Config.from_config(qc)


def process(module: torch.nn.Module) -> None:
    for _, m in module.named_modules():
        qm = getattr(m, "quant_method", None)
        if qm is not None and hasattr(qm, "process_weights_after_loading"):
            qm.process_weights_after_loading(m)


def load_as_server(path: Path, device: str = "cpu", dtype: torch.dtype | None = None, draft: bool = False,
                   quantization: str | None = None):
    """What a server does: ModelConfig (the plugin's hooks claim EXL3 and rank-sliced checkpoints; a plain one stays
    unquantized), the quantization config from its parsed quantization_config, the model class SGLang's loader
    picks (`get_model_architecture`, with the plugin's hooks) built on
    `device` (parameters in `dtype`, as `--dtype` gives), SGLang's default loader (the plugin's hook normalises
    rank-sliced names). `draft`: as the draft worker does (`is_draft_model`: SGLang swaps in the NextN / MTP class).
    `quantization`: what `--quantization` passes (`exl3` for a BF16 checkpoint encoded online).
    Returns (model, quantization config or None)."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader, _get_quantization_config
    from sglang.srt.model_loader.utils import get_model_architecture
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    from sglang_exl3.layers.exl3_config import deactivate

    config = ModelConfig(str(path), is_draft_model=draft, quantization=quantization)
    model_cls, _ = get_model_architecture(config)  # the loader's own choice (SGLang swaps some model classes)
    cfg = None
    if config.quantization == "exl3":  # the loader's own call (it reads hf_config.quantization_config)
        cfg = _get_quantization_config(config, LoadConfig())
    else:
        deactivate()  # a plain model must not pick up the last EXL3 model's lm_head config
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype or default)
    try:
        with torch.device(device):
            model = model_cls(config.hf_config, quant_config=cfg)
    finally:
        torch.set_default_dtype(default)
    files = sorted(str(f) for f in Path(path).glob("*.safetensors"))
    DefaultModelLoader.load_weights_and_postprocess(model, safetensors_weights_iterator(files), torch.device(device))
    return model, cfg


def expert_tensors(experts: torch.nn.Module) -> dict:
    """(expert, role, field) -> tensor of every decoded EXL3 expert an MoE layer serves."""
    return {(e, role, k): v for e, shards in enumerate(experts.exl3_experts) for role, shard in shards.items()
            for k, v in vars(shard).items() if isinstance(v, torch.Tensor)}


def load_model(path: Path):
    """An EXL3 checkpoint through SGLang's own model class and default loader, as in a server (load_as_server on the
    CPU)."""
    model, cfg = load_as_server(Path(path))
    if cfg is None:
        raise ValueError(f"{path} is not an EXL3 checkpoint")
    return model, cfg


def bf16_twin(path: Path, out: Path) -> Path:
    """`path` dequantized to BF16: a plain model of the same shape, as a BF16 EAGLE draft is built."""
    from sglang_exl3.tools.dequantize import dequantize_checkpoint

    dequantize_checkpoint(path, out, dtype="bfloat16", progress=False)
    return out


def draft_hand_over(target, draft, with_head: bool) -> None:
    """SGLang's draft-worker hand-over run through the plugin's hook on it: `draft.set_embed_and_head(*target
    .get_embed_and_head())` as EagleDraftWorker.init_lm_head does for EAGLE / NEXTN, or `draft.set_embed(...)` as
    for EAGLE3."""
    from types import SimpleNamespace

    from sglang_exl3.integration.hooks import draft_shares_target_modules

    def init_lm_head(worker):
        if with_head:
            worker.draft_runner.model.set_embed_and_head(*target.get_embed_and_head())
        else:
            worker.draft_runner.model.set_embed(target.get_embed())

    draft_shares_target_modules(init_lm_head, SimpleNamespace(draft_runner=SimpleNamespace(model=draft)))


def msrt_base(root: Path, seed: int, bits: int = 3) -> Path:
    """A tiny exl3-msrt-base/1 cartridge base (Qwen3-MoE layout, 2 layers of 4 experts) under `root`."""
    from sglang_exl3.synth.msrt_base_writer import write_msrt_base
    from sglang_exl3.synth.rank_sliced_writer import write_rank_sliced_checkpoint

    return write_msrt_base(write_rank_sliced_checkpoint(root / "rs", bits=bits, tp=1, seed=seed, with_tokenizer=True),
                           root / "base")


def small_bf16_llama(directory: Path, seed: int) -> Path:
    """A one-layer BF16 Llama of width 128 (two heads of 64, one KV head): the smallest model whose linears are
    whole 128-element blocks, for the encoder on the CPU (~6 s per 128x128 module)."""
    from sglang_exl3.synth.hf_models import make_random_hf_model

    return make_random_hf_model("llama", directory, seed=seed, hidden_size=128, intermediate_size=128,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_hidden_layers=1)
