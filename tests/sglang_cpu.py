"""Helpers to build SGLang's real model classes and layers on a machine without a GPU.

One process-wide setup: plugins loaded, server args published, a 1-rank gloo process group.
The only patch: SGLang's rotary-embedding module decides "not CUDA and not CPU-engine mode" means
"import vLLM's rotary kernel" (absent here, never called by these tests); it is told it runs on
the CPU, which it does.
"""

from __future__ import annotations

import glob
from functools import cache
from pathlib import Path

import torch

from sglang_exl3.integration.server import free_port


@cache
def _runtime() -> None:
    from conftest import DENSE_CKPTS

    model_path = str(DENSE_CKPTS[0])
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.srt.layers.rotary_embedding.base as rope_base
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    rope_base._is_cpu = True
    args = ServerArgs(model_path=model_path, device="cpu", attention_backend="torch_native",
                      sampling_backend="pytorch")
    set_global_server_args_for_scheduler(args)
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    initialize_model_parallel(tensor_model_parallel_size=1)
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.dp_attention import initialize_dp_attention

    initialize_dp_attention(args, ModelConfig(model_path))


def sglang_runtime(model_path: str | None = None) -> None:
    """Process-wide SGLang setup (once; the model path only seeds the published server args)."""
    _runtime()


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


def load_model(path: Path):
    """SGLang's own model class for the checkpoint, weights loaded (and processed after loading) by SGLang's
    default loader, as in a server."""
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.models.registry import ModelRegistry

    hf, cfg = exl3_config(path)
    model_cls, _ = ModelRegistry.resolve_model_cls(hf.architectures)
    model = model_cls(hf, quant_config=cfg)
    # through the loader SGLang's server uses, so the plugin's hooks around it run as they would there
    DefaultModelLoader.load_weights_and_postprocess(
        model, safetensors_weights_iterator(sorted(glob.glob(str(path / "*.safetensors")))), torch.device("cpu"))
    return model, cfg
