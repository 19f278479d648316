"""`python -m sglang_exl3.integration.bench {one_batch,offline_throughput,one_batch_server} [args]`.

SGLang's benchmark entry points parse `--quantization` before any plugin is loaded (and `one_batch`
never loads plugins), so `exl3` is rejected there. This thin wrapper loads the plugins first, at
module top level so that processes spawned for tensor parallelism (which re-import the main module
as `__mp_main__`) register EXL3 too, then hands over to SGLang's own `cli_main`.
"""

from __future__ import annotations

import importlib
import sys

from sglang.srt.plugins import load_plugins

load_plugins()

TARGETS = {
    "one_batch": "sglang.benchmark.one_batch",
    "offline_throughput": "sglang.benchmark.offline_throughput",
    "one_batch_server": "sglang.benchmark.one_batch_server",
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        raise SystemExit(f"usage: python -m sglang_exl3.integration.bench {{{','.join(TARGETS)}}} [SGLang args]")
    target = TARGETS[sys.argv.pop(1)]
    sys.argv[0] = target
    importlib.import_module(target).cli_main()


if __name__ == "__main__":
    main()
