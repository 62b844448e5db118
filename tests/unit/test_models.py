"""The model pre-flight check: a folder lacking config, tokenizer or weights, or no such model, is one line."""

from __future__ import annotations

import pytest

from nemo_disco import cli
from nemo_disco.models import check_model


def test_models_that_cannot_be_loaded_give_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["eval", "--model", "/nonexistent/model", "--benchmarks", "aime"]) == 2
    err = capsys.readouterr().err
    assert err == "nemo-disco eval: error: model folder not found: /nonexistent/model (and not an owner/name hub id)\n"
    folder = tmp_path / "half"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"model folder .*half has no tokenizer files \(looked for tokenizer.json"):
        check_model(folder)
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"has no weights \(looked for \*.safetensors"):
        check_model(folder)
    with pytest.raises(ValueError, match="has no config.json"):
        check_model(tmp_path)
    assert cli.main(["eval", "--model", "nemo-disco-test/no-such-model", "--benchmarks", "aime"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("nemo-disco eval: error: cannot load model 'nemo-disco-test/no-such-model': no folder ")
    assert "tried the Hugging Face hub through the local Hugging Face cache only (HF_HUB_OFFLINE is set)" in err


@pytest.mark.parametrize("model", ["runs/nope", "./nope", "../nope", "~/nope", "runs/disco/step_5", "a\\b", "a b/c"])
def test_a_local_looking_model_that_does_not_exist_fails_at_once_without_the_hub(model, monkeypatch):
    """A mistyped local folder used to wait for the hub's retries (49 s) before its line."""
    import transformers

    def asked(*args: object, **kwargs: object) -> None:
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", asked)
    with pytest.raises(FileNotFoundError, match=r"^model folder not found: "):
        check_model(model)
