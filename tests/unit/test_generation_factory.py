"""One generator factory and one stop-token rule for training and evaluation."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nemo_disco import config
from nemo_disco.generation.factory import build_generator, build_run_generator, stop_token_ids
from nemo_disco.generation.hf import HFGenerator

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"


def test_evaluation_gets_the_backends_defaults_and_training_its_recipes_settings(tiny_qwen2, tmp_path):
    plain = build_generator(tiny_qwen2, "hf", seed=3, max_model_len=64, tensor_parallel_size=1)
    assert isinstance(plain, HFGenerator) and plain.batch_size == 64  # HFGenerator's defaults
    assert next(plain.model.parameters()).dtype == torch.float32
    cfg = config.load(RECIPE, [f"logging.run_dir={tmp_path}", "generation.hf_batch_size=7", "policy.dtype=bfloat16"])
    run = build_run_generator(cfg, tiny_qwen2)
    assert isinstance(run, HFGenerator) and run.batch_size == 7
    assert next(run.model.parameters()).dtype == torch.bfloat16


def test_an_unknown_backend_is_one_line():
    with pytest.raises(ValueError, match="backend='sglang': expected 'hf' or 'vllm'"):
        build_generator("any", "sglang", seed=0, max_model_len=1, tensor_parallel_size=1)


class _Tokenizer(SimpleNamespace):
    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.vocab[token]


def test_the_stop_set_is_eos_and_im_end_where_it_exists(tmp_path):
    from nemo_disco.tiny import build_tokenizer

    tok = build_tokenizer(tmp_path)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(tok) == tuple(sorted({tok.eos_token_id, im_end}))
    assert stop_token_ids(_Tokenizer(eos_token_id=5, vocab={"a": 1})) == (5,)  # no ChatML: EOS alone
    assert stop_token_ids(_Tokenizer(eos_token_id=None, vocab={"<|im_end|>": 9})) == (9,)  # no EOS: not listed
    assert stop_token_ids(_Tokenizer(eos_token_id=9, vocab={"<|im_end|>": 9})) == (9,)  # once when they agree
