import pytest
import torch
from generation_checks import (
    check_bad_refit_names_the_tensor,
    check_greedy_equals_transformers,
    check_refit_changes_outputs_and_logprobs_match,
)

from nemo_disco.generation.base import SamplingParams
from nemo_disco.generation.hf import HFGenerator, _top_k_top_p, trim_at_stop

torch.set_num_threads(1)


def _make(model_dir):
    return HFGenerator(model_dir, batch_size=5)  # not a multiple of n: batches split a prompt's rollouts


def test_refit_changes_outputs_and_logprobs_match_policy(tiny_qwen2):
    check_refit_changes_outputs_and_logprobs_match(_make, tiny_qwen2)


def test_greedy_equals_transformers_greedy(tiny_qwen2):
    check_greedy_equals_transformers(_make, tiny_qwen2)


def test_refit_with_a_wrong_name_or_shape_fails_clearly(tiny_qwen2):
    check_bad_refit_names_the_tensor(_make, tiny_qwen2)
    gen = _make(tiny_qwen2)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape \[3\]"):
        gen.update_weights([("model.norm.weight", torch.zeros(3))])


def test_seeded_sampling_is_reproducible_and_ignore_eos_fills(tiny_qwen2):
    gen = _make(tiny_qwen2)
    sp = SamplingParams(temperature=1.0, max_tokens=6, stop_token_ids=(1,), seed=11)
    a = gen.generate([[5, 6, 7]], 3, sp)
    b = gen.generate([[5, 6, 7]], 3, sp)
    assert [r.token_ids for r in a[0]] == [r.token_ids for r in b[0]]
    full = gen.generate([[5, 6, 7]], 2, SamplingParams(max_tokens=6, stop_token_ids=(1,), seed=1, ignore_eos=True))
    assert all(len(r.token_ids) == 6 and r.finish_reason == "length" for r in full[0])


def test_trim_at_stop_and_nucleus():
    assert trim_at_stop([4, 1, 5], [0.1, 0.2, 0.3], [1]) == ([4, 1], [0.1, 0.2], "stop")
    assert trim_at_stop([4, 5], [0.1, 0.2], [1]) == ([4, 5], [0.1, 0.2], "length")
    # probabilities 0.5, 0.3, 0.2: top_p=0.7 keeps the first two (0.5 < 0.7 <= 0.8), top_k=1 keeps one.
    logp = torch.tensor([[0.5, 0.3, 0.2]]).log()
    assert torch.isinf(_top_k_top_p(logp, -1, 0.7)).tolist() == [[False, False, True]]
    assert torch.isinf(_top_k_top_p(logp, 1, 1.0)).tolist() == [[False, True, True]]
