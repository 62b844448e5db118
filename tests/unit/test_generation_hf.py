import importlib.util

import pytest
import torch
from generation_checks import (
    PROMPTS,
    check_bad_refit_names_the_tensor,
    check_greedy_equals_transformers,
    check_refit_changes_outputs_and_logprobs_match,
    policy_for,
)

from nemo_disco.generation.base import SamplingParams
from nemo_disco.generation.hf import HFGenerator, WeightSpec, _top_k_top_p, trim_at_stop

torch.set_num_threads(1)
EOS = 1
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(EOS,))


def _make(model_dir):
    return HFGenerator(model_dir, batch_size=5)  # not a multiple of n: batches split a prompt's rollouts


def test_refit_changes_outputs_and_logprobs_match_policy(tiny_qwen2):
    check_refit_changes_outputs_and_logprobs_match(_make, tiny_qwen2)


def test_greedy_equals_transformers_greedy(tiny_qwen2):
    check_greedy_equals_transformers(_make, tiny_qwen2)


def test_refit_with_a_wrong_name_or_shape_fails_clearly(tiny_qwen2):
    check_bad_refit_names_the_tensor(_make, tiny_qwen2)
    gen = _make(tiny_qwen2)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \[3\], the model expects \[64\]"):
        gen.update_weights([("model.norm.weight", torch.zeros(3))])


def test_an_incomplete_or_repeated_refit_fails_and_blocks_generation_until_a_full_one(tiny_qwen2):
    gen = _make(tiny_qwen2)
    policy = policy_for(tiny_qwen2)
    before = gen.generate(PROMPTS, 1, GREEDY)
    weights = list(policy.export_weights())
    with pytest.raises(ValueError, match=r"left out 1 tensor\(s\) of the model, e.g. \['model\.norm\.weight'\]"):
        gen.update_weights([(n, t) for n, t in weights if n != "model.norm.weight"])
    with pytest.raises(RuntimeError, match="the last refit failed"):
        gen.generate(PROMPTS, 1, GREEDY)
    with pytest.raises(ValueError, match=r"'model\.embed_tokens\.weight' arrived twice"):
        gen.update_weights(weights + weights[:1])
    gen.update_weights(weights)
    assert gen.generate(PROMPTS, 1, GREEDY) == before


def test_a_tied_alias_may_be_sent_and_updates_the_shared_tensor(tiny_qwen2):
    gen = _make(tiny_qwen2)
    assert gen.model.config.tie_word_embeddings
    policy = policy_for(tiny_qwen2)
    new = {n: t.clone() for n, t in policy.export_weights()}
    new["model.embed_tokens.weight"] += 0.5
    # lm_head.weight is the embedding of a tied model: sent after it, it is what both end up holding.
    gen.update_weights([*new.items(), ("lm_head.weight", new["model.embed_tokens.weight"] + 0.25)])
    torch.testing.assert_close(gen.model.lm_head.weight, new["model.embed_tokens.weight"] + 0.25)
    assert gen.model.lm_head.weight.data_ptr() == gen.model.model.embed_tokens.weight.data_ptr()


def test_weight_spec_of_a_tied_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device("meta"):
        spec = WeightSpec.of_model(Qwen2ForCausalLM(config), "test")
    # 1 embedding + 12 per layer (q/k/v weight + bias, o, gate, up, down, 2 norms) + the final norm.
    assert len(spec.required) == 1 + 12 + 1 and "lm_head.weight" not in spec.required
    assert spec.optional == {"lm_head.weight": (10, 8)}
    assert spec.required["model.layers.0.self_attn.k_proj.weight"] == (4, 8)  # 1 KV head x head_dim 4


def test_seeded_sampling_is_reproducible_and_ignore_eos_fills(tiny_qwen2):
    gen = _make(tiny_qwen2)
    sp = SamplingParams(temperature=1.0, max_tokens=6, stop_token_ids=(EOS,), seed=11)
    a = gen.generate([[5, 6, 7]], 3, sp)
    b = gen.generate([[5, 6, 7]], 3, sp)
    assert [r.token_ids for r in a[0]] == [r.token_ids for r in b[0]]
    full = gen.generate([[5, 6, 7]], 2, SamplingParams(max_tokens=6, stop_token_ids=(EOS,), seed=1, ignore_eos=True))
    assert all(len(r.token_ids) == 6 and r.finish_reason == "length" for r in full[0])


def test_stop_tokens_are_the_listed_ones(tiny_qwen2):
    gen = _make(tiny_qwen2)
    first = gen.generate(PROMPTS, 1, GREEDY)[0][0].token_ids[0]
    # The first greedy token as the stop token: kept as the only token.
    (r,), *_ = gen.generate(PROMPTS, 1, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(first,)))
    assert (r.token_ids, r.finish_reason, len(r.logprobs)) == ([first], "stop", 1)
    # No stop tokens: the model's own EOS (its generation config's) is sampled, and ends nothing.
    free = gen.generate(PROMPTS, 16, SamplingParams(temperature=2.0, max_tokens=24, seed=0))
    assert all(len(r.token_ids) == 24 and r.finish_reason == "length" for rs in free for r in rs)
    assert any(EOS in r.token_ids[:-1] for rs in free for r in rs)


def test_truncated_sampling_logprobs_are_renormalised_over_the_kept_tokens(tiny_qwen2):
    gen = _make(tiny_qwen2)
    t, top_p, top_k = 0.7, 0.8, 20
    sp = SamplingParams(temperature=t, top_p=top_p, top_k=top_k, max_tokens=8, stop_token_ids=(EOS,), seed=1)
    for prompt, rs in zip(PROMPTS, gen.generate(PROMPTS, 3, sp), strict=True):
        for r in rs:
            with torch.no_grad():
                logits = gen.model(input_ids=torch.tensor([prompt + r.token_ids])).logits[0, len(prompt) - 1 : -1]
            kept = _top_k_top_p(torch.log_softmax(logits / t, -1), top_k, top_p)  # [R, V], -inf outside
            assert torch.isfinite(kept.gather(-1, torch.tensor(r.token_ids)[:, None])).all()
            # Renormalised: each token's log-prob minus the log of the kept mass, so above the untruncated one.
            ref = kept.gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0] - kept.logsumexp(-1)
            torch.testing.assert_close(torch.tensor(r.logprobs), ref, atol=1e-5, rtol=0)


def test_sleep_and_wake_keep_the_weights(tiny_qwen2):
    gen = _make(tiny_qwen2)
    before = gen.generate(PROMPTS, 1, GREEDY)
    gen.sleep()
    assert next(gen.model.parameters()).device.type == "cpu"
    gen.wake_up(["weights"])
    assert gen.generate(PROMPTS, 1, GREEDY) == before


def test_trim_at_stop_and_nucleus():
    assert trim_at_stop([4, 1, 5], [0.1, 0.2, 0.3], [1]) == ([4, 1], [0.1, 0.2], "stop")
    assert trim_at_stop([4, 5], [0.1, 0.2], [1]) == ([4, 5], [0.1, 0.2], "length")
    assert trim_at_stop([4, 1], [0.1, 0.2], []) == ([4, 1], [0.1, 0.2], "length")
    # probabilities 0.5, 0.3, 0.2: top_p=0.7 keeps the first two (mass before them 0 and 0.5 < 0.7; before
    # the third 0.8 >= 0.7), top_k=1 keeps one.
    logp = torch.tensor([[0.5, 0.3, 0.2]]).log()
    assert torch.isinf(_top_k_top_p(logp, -1, 0.7)).tolist() == [[False, False, True]]
    assert torch.isinf(_top_k_top_p(logp, 1, 1.0)).tolist() == [[False, True, True]]
    # vLLM's rule at the boundary: 0.5, 0.5 with top_p=0.5 keeps one (mass before the second 0.5 >= 0.5).
    assert torch.isinf(_top_k_top_p(torch.tensor([[0.5, 0.5]]).log(), -1, 0.5)).tolist() == [[False, True]]


# The parts of the vLLM generator that need no vLLM (its engine tests are in tests/vllm).


def test_request_seeds_never_share_a_random_stream():
    from nemo_disco.generation.vllm import request_seed

    # vLLM seeds rollout j of a request seeded s with s + j: the [s, s + 64) ranges of 10 calls x 200
    # prompts (consecutive call seeds, as the trainer's rounds use) must not overlap.
    seeds = sorted(request_seed(call, i) for call in range(10) for i in range(200))
    assert min(b - a for a, b in zip(seeds[:-1], seeds[1:], strict=True)) > 64
    assert all(0 <= s < 2**62 for s in seeds)


# tests/ is on sys.path, so a bare "vllm" would find the tests/vllm folder: look for a module of the real package.
@pytest.mark.skipif(importlib.util.find_spec("vllm.sampling_params") is not None, reason="vLLM is installed here")
def test_vllm_generator_without_vllm_says_how_to_install_it(tiny_qwen2):
    from nemo_disco.config import ConfigError
    from nemo_disco.generation.vllm import VLLMGenerator

    with pytest.raises(ConfigError, match="make setup-vllm"):
        VLLMGenerator(tiny_qwen2)


def test_moe_experts_refit_by_checkpoint_name_into_the_fused_tensors(tiny_qwen3_moe):
    """Policies export each expert (checkpoint names); the generator fuses them into transformers' tensors."""
    names = [n for n, _ in policy_for(tiny_qwen3_moe).export_weights()]
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in names
    assert not any(n.endswith("gate_up_proj") for n in names)
    check_refit_changes_outputs_and_logprobs_match(_make, tiny_qwen3_moe)
    check_greedy_equals_transformers(_make, tiny_qwen3_moe)
    gen = _make(tiny_qwen3_moe)
    weights = [(n, t) for n, t in policy_for(tiny_qwen3_moe).export_weights()]
    with pytest.raises(ValueError, match=r"left out expert tensors of 1 fused tensor\(s\)"):
        gen.update_weights([(n, t) for n, t in weights if n != "model.layers.0.mlp.experts.2.down_proj.weight"])


def test_the_transformers_policy_freezes_an_moe_router_by_default(tiny_qwen3_moe):
    frozen = policy_for(tiny_qwen3_moe)
    assert [n for n, p in frozen.model.named_parameters() if not p.requires_grad] == [
        "model.layers.0.mlp.gate.weight",
        "model.layers.1.mlp.gate.weight",
    ]
