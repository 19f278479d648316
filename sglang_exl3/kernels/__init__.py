"""EXL3 GEMM backends behind one registered torch op (`torch.ops.exl3.gemm`).

Backends: `torch` (the reference codec: cached W_hat + matmul, runs anywhere), `exllamav3`
(exllamav3's `exl3_gemm`, the GPU parity path) and `triton` (our trellis kernels, not yet measured).
No SGLang import here.
"""

from sglang_exl3.kernels.backends import Backend, resolve_backend
from sglang_exl3.kernels.ops import exl3_gemm

__all__ = ["Backend", "exl3_gemm", "resolve_backend"]
