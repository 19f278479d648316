"""Write the tiny random-weight HF models that exllamav3's converter quantizes for the oracles.

python tests/oracle/make_source_models.py OUT_DIR   (CPU; a few seconds)
"""

import sys
from pathlib import Path

from sglang_exl3.synth.hf_models import TINY_ARCHS, make_random_hf_model

if __name__ == "__main__":
    out = Path(sys.argv[1])
    for seed, arch in enumerate(TINY_ARCHS):
        make_random_hf_model(arch, out / arch, seed=seed)
        print(arch, sorted(p.name for p in (out / arch).iterdir()))
