"""benchmarks/encode.py's quality measures on the CPU: a model against itself has zero KL and the perplexity of its
own next-token loss; a perturbed copy has a positive KL; the parameter count comes from the safetensors headers."""

from __future__ import annotations

import math
import shutil

import torch
from safetensors.torch import load_file, save_file

from benchmarks.encode import _params, quality, token_logprobs


def test_quality_measures(tmp_path):
    from sglang_exl3.synth.hf_models import make_random_hf_model

    ref = make_random_hf_model("llama", tmp_path / "ref", seed=1)
    x = torch.randint(3, 1000, (2, 17), generator=torch.Generator().manual_seed(0))
    lp = token_logprobs(ref, x)
    kl, ppl = quality(lp, lp, x)
    nll = -lp.gather(-1, x[:, 1:].unsqueeze(-1)).mean()
    assert abs(kl) < 1e-6 and math.isclose(ppl, float(nll.exp()), rel_tol=1e-6)
    other = shutil.copytree(ref, tmp_path / "other")
    weights = load_file(str(other / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.weight"
    weights[key] = (weights[key].float() * 1.5).to(weights[key].dtype)
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    assert quality(lp, token_logprobs(other, x), x)[0] > 1e-5
    assert _params(ref) == sum(t.numel() for t in load_file(str(ref / "model.safetensors")).values())


def test_served_agreement_counts_prompts_and_compares_logprobs_up_to_the_first_difference():
    from benchmarks.encode import _agreement

    def out(pairs):
        return {"meta_info": {"output_token_logprobs": [[lp, t, None] for lp, t in pairs]}}

    ref = [out([(-0.5, 7), (-1.0, 8)]), out([(-0.2, 3), (-0.3, 4)])]
    got = [out([(-0.5, 7), (-1.25, 8)]), out([(-0.7, 3), (-9.0, 5)])]
    assert _agreement(ref, got, "same") == {"same": "1/2", "same_max_logprob_diff": 0.5}
    assert _agreement(ref, ref, "same") == {"same": "2/2", "same_max_logprob_diff": 0.0}
