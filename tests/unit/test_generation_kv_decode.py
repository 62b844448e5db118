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


@pytest.mark.parametrize("tiny_family", sorted(kv_decode.decodable()), indirect=True)
@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_kv_loop_equals_transformers_generate(tiny_family, name):
    model_dir = tiny_family
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


def _fallback_lines(caplog) -> list[str]:  # noqa: ANN001
    return [r.getMessage() for r in caplog.records if "not the KV-cached loop" in r.getMessage()]


def test_a_model_the_loop_does_not_know_uses_generate_with_one_log_line(tmp_path, caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=2, eos_token_id=EOS, pad_token_id=0)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    with caplog.at_level("INFO", logger="nemo_disco.generation.hf"):
        gen = HFGenerator(tmp_path, batch_size=4)
    assert gen.decode_path == "generate" and not kv_decode.supports(gen.model)
    assert _fallback_lines(caplog) == [
        "transformers generator: decoding with generate(), not the KV-cached loop: "
        f"model_type 'gpt2' is not one of {', '.join(kv_decode.decodable())}"
    ]
    (rs,) = gen.generate([[5, 6, 7]], 2, SAMPLINGS["ignore-eos"])
    assert [len(r.token_ids) for r in rs] == [40, 40]


def test_a_family_with_the_same_modules_but_not_registered_uses_generate(tmp_path, caplog):
    """Mistral has Llama's module names: the family, not the layout, keeps it off the loop."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=None,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    MistralForCausalLM(cfg).save_pretrained(tmp_path)
    with caplog.at_level("INFO", logger="nemo_disco.generation.hf"):
        gen = HFGenerator(tmp_path, batch_size=8)
    assert gen.decode_path == "generate"
    assert len(_fallback_lines(caplog)) == 1 and "model_type 'mistral'" in _fallback_lines(caplog)[0]
    assert kv_decode._layout(gen.model).startswith("model_type 'mistral'")
    ref = HFGenerator(tmp_path, batch_size=8, decode="generate")
    sp = SAMPLINGS["t1"]
    assert gen.generate(_prompts(), 2, sp) == ref.generate(_prompts(), 2, sp)


def _qwen2_model():  # noqa: ANN202
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return Qwen2ForCausalLM(cfg).eval()


def test_the_check_passes_a_model_it_runs_and_leaves_its_mode():
    model = _qwen2_model().train()
    assert kv_decode.unsupported(model) is None
    assert model.training


def test_an_attention_without_an_attribute_the_loop_reads_is_refused():
    """A release whose attention has no ``scaling`` (transformers before 4.48 had none): a reason, no crash."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

    class AttentionWithoutScaling(Qwen2Attention):
        def __init__(self, config, layer_idx) -> None:  # noqa: ANN001
            super().__init__(config, layer_idx)
            del self.scaling

    model = _qwen2_model()
    layer = model.model.layers[1]
    layer.self_attn = AttentionWithoutScaling(model.config, 1)
    assert kv_decode.unsupported(model) == (
        "Qwen2ForCausalLM.model.layers.1.self_attn (AttentionWithoutScaling) has no scaling"
    )


def test_a_body_without_the_shared_rotary_embedding_is_refused():
    """Older releases kept a rotary embedding per attention, none on the body."""
    model = _qwen2_model()
    del model.model.rotary_emb
    assert kv_decode.unsupported(model) == "Qwen2ForCausalLM has no model.rotary_emb"


def test_an_attention_that_computes_something_else_is_caught_by_the_probe():
    """Same modules and attributes, another function (an output gate, as later families add): the probe sees it."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

    class GatedAttention(Qwen2Attention):
        def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            out, weights = super().forward(*args, **kwargs)
            return torch.sigmoid(out) * out, weights

    model = _qwen2_model()
    for i, layer in enumerate(model.model.layers):
        gated = GatedAttention(model.config, i)
        gated.load_state_dict(layer.self_attn.state_dict())
        layer.self_attn = gated
    reason = kv_decode.unsupported(model)
    assert reason is not None and reason.startswith("the decode probe's logits differ from model(...)'s by")


def test_a_rotary_embedding_with_another_signature_is_caught_by_the_probe():
    """What the loop's calls raise on a release is a reason found at the check, not an error while decoding.

    Here a rotary embedding that takes a length, not positions (the model's own forward breaks too: a probe
    failure is a reason whichever side fails).
    """

    class RotaryBySeqLen(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor, *, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
            positions = torch.arange(seq_len, device=x.device).expand(x.shape[0], -1)
            return self.inner(x, positions)

    model = _qwen2_model()
    model.model.rotary_emb = RotaryBySeqLen(model.model.rotary_emb)
    reason = kv_decode.unsupported(model)
    assert reason is not None and reason.startswith("the decode probe raised TypeError: ")
    assert "\n" not in reason


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
