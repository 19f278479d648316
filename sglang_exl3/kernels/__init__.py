"""EXL3 GEMM backends behind registered torch ops (`torch.ops.exl3.gemm`, `gemm_group` and the MoE ops).

Backends: `cuda` (our kernels: `csrc/` by kernel family; `build.py` and `library.py` build and load them, `abi.py`
declares their C ABI, `dispatch.py` is the policy, `dense.py`, `groups.py` and `moe_*.py` the ops), `torch` (the
reference codec: cached W_hat + matmul, runs anywhere) and `exllamav3` (a prebuilt exllamav3 extension's
`exl3_gemm`). `backends.resolve_backend` picks one per device (docs/architecture.md). No SGLang import here.
"""

from sglang_exl3.kernels.backends import Backend, resolve_backend
from sglang_exl3.kernels.ops import exl3_gemm

__all__ = ["Backend", "exl3_gemm", "resolve_backend"]
