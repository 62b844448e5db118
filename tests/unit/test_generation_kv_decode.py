"""The transformers generator's KV-cached decode loop against transformers' own generate()."""

from __future__ import annotations

import random

import pytest
import torch

from nemo_disco.generation import kv_decode
from nemo_disco.generation.base import SamplingParams
from nemo_disco.generation.hf import HFGenerator

torch.set_num_threads(1)
EOS = 1
SAMPLINGS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=(EOS,)),
    "t1": SamplingParams(temperature=1.0, max_tokens=24, stop_token_ids=(EOS,), seed=5),
    "topk-topp": SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=24, stop_token_ids=(EOS,), seed=7),
    "ignore-eos": SamplingParams(temperature=1.0, max_tokens=40, stop_token_ids=(EOS,), ignore_eos=True, seed=3),
}


def _prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)  # unequal lengths: the batch is left-padded
    return [[rng.randint(3, 120) for _ in range(rng.randint(2, 13))] for _ in range(n)]


def test_rms_norm_is_the_modules_own_bit_for_bit_and_the_module_outside_float32(tiny_qwen2):
    from transformers import AutoModelForCausalLM

    norm = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2)).model.norm
    norm.weight.data.normal_()
    x = torch.randn(3, 4, norm.weight.shape[0]) * 3
    assert torch.equal(kv_decode.rms_norm(norm, x), norm(x))
    norm = norm.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    assert torch.equal(kv_decode.rms_norm(norm, xb), norm(xb))  # the reference path: casts back before the weight


def test_plain_linear_layers_and_silu_run_as_functions_and_anything_else_as_its_module():
    from transformers.activations import SiLUActivation

    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    assert torch.equal(kv_decode._linear(lin)(x), lin(x))

    class Scaled(torch.nn.Linear):  # a subclass may change forward: kept as a module call
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(t)

    scaled = Scaled(4, 3)
    assert kv_decode._linear(scaled) is scaled
    assert kv_decode._activation(SiLUActivation()) is torch.nn.functional.silu
    gelu = torch.nn.GELU()
    assert kv_decode._activation(gelu) is gelu


@pytest.mark.parametrize("arch", ["tiny_qwen2", "tiny_llama", "tiny_qwen3", "tiny_qwen3_moe"])
@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_kv_loop_equals_transformers_generate(arch, name, request):
    model_dir = request.getfixturevalue(arch)
    kv, ref = HFGenerator(model_dir, batch_size=8), HFGenerator(model_dir, batch_size=8, decode="generate")
    assert (kv.decode_path, ref.decode_path) == ("kv", "generate")
    sp = SAMPLINGS[name]
    ours, theirs = kv.generate(_prompts(), 3, sp), ref.generate(_prompts(), 3, sp)
    stopped = 0
    for a_rs, b_rs in zip(ours, theirs, strict=True):
        for a, b in zip(a_rs, b_rs, strict=True):
            assert a.token_ids == b.token_ids  # same seeded draws from the same distribution
            assert a.finish_reason == b.finish_reason
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
            stopped += a.finish_reason == "stop"
    if name == "ignore-eos":
        assert stopped == 0 and all(len(r.token_ids) == sp.max_tokens for rs in ours for r in rs)


def test_a_model_the_loop_does_not_know_uses_generate(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=2, eos_token_id=EOS, pad_token_id=0)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    gen = HFGenerator(tmp_path, batch_size=4)
    assert gen.decode_path == "generate" and not kv_decode.supports(gen.model)
    (rs,) = gen.generate([[5, 6, 7]], 2, SAMPLINGS["ignore-eos"])
    assert [len(r.token_ids) for r in rs] == [40, 40]


def test_decode_option_is_checked(tiny_qwen2):
    with pytest.raises(ValueError, match="decode='fast'"):
        HFGenerator(tiny_qwen2, decode="fast")


def test_padding_queries_stay_finite_and_padding_keys_are_ignored(tiny_qwen2):
    """A prompt's continuation does not depend on how much left padding its batch gives it."""
    gen = HFGenerator(tiny_qwen2, batch_size=8)
    short, long_ = [7, 8], [9] * 12
    alone = gen.generate([short], 1, SAMPLINGS["greedy"])[0][0]
    padded = gen.generate([short, long_], 1, SAMPLINGS["greedy"])[0][0]
    assert padded.token_ids == alone.token_ids
    assert all(torch.isfinite(torch.tensor(padded.logprobs)))
    assert torch.allclose(torch.tensor(padded.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("choice", "path"), [("auto", "kv"), ("generate", "generate")])
def test_the_recipe_key_chooses_the_decoder(choice, path, tiny_qwen2, tmp_path):
    from pathlib import Path

    from nemo_disco import config
    from nemo_disco.generation.factory import build_run_generator

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"
    cfg = config.load(recipe, [f"generation.hf_decode={choice}", f"logging.run_dir={tmp_path}"])
    assert build_run_generator(cfg, tiny_qwen2).decode_path == path
