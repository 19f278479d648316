"""CPU tests of the benchmark scripts (CI runs them with the package's tests: pyproject.toml's testpaths).

The SGLang-on-CPU harness of the package's tests (tests/sglang_cpu.py) is shared, not copied: its folder is appended
to the import path here, after everything else, so nothing in it shadows a module of the package or the benchmarks.
"""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parents[2] / "tests")
if _TESTS not in sys.path:
    sys.path.append(_TESTS)
