"""The model pre-flight check: a folder lacking config, tokenizer or weights, a damaged file in it, or no such
model, is one line."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from nemo_disco import cli
from nemo_disco.models import check_model, check_model_folder

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"


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


def _damaged_copies(tiny: Path, tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Copies of a tiny model folder with one damaged file each, and the line each must give (after ``error: ``)."""
    badtok = tmp_path / "badtok"
    shutil.copytree(tiny, badtok)
    (badtok / "tokenizer.json").write_text('{"version": "1.0", "x": "a\x01b"}')  # a raw control character
    nottok = tmp_path / "nottok"
    shutil.copytree(tiny, nottok)
    (nottok / "tokenizer.json").write_text('{"version": "1.0", "model": 3}')  # JSON, but no tokenizer
    trunc = tmp_path / "trunc"
    shutil.copytree(tiny, trunc)
    weights = trunc / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(size - 1000)  # a copy cut short
    (n,) = struct.unpack("<Q", weights.read_bytes()[:8])
    data = size - 8 - n
    return {
        "tokenizer": (
            badtok,
            f"model folder {badtok}: tokenizer.json is not valid JSON: Invalid control character at line 1 column 27",
        ),
        "not a tokenizer": (
            nottok,
            f"model folder {nottok}: tokenizer.json is valid JSON but not a tokenizer: ",  # + the library's reason
        ),
        "weights": (
            trunc,
            f"{weights} is truncated or damaged: its header describes {data} bytes of tensor data, "
            f"the file holds {data - 1000}",
        ),
    }


def test_a_damaged_model_file_is_named_in_one_line_by_eval_train_and_convert(tiny_qwen2, tmp_path, capsys, monkeypatch):
    """A damaged tokenizer.json used to say only "Invalid control character at: line 1 column 27"; a truncated
    model.safetensors gave a 25-42 line traceback (exit code 1) from the loader, and convert copied the damaged
    tokenizer.json into its output."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for what, (folder, line) in _damaged_copies(tiny_qwen2, tmp_path).items():
        out = tmp_path / f"out-{what}"
        commands = {
            "eval": ["eval", "--model", str(folder), "--backend", "hf", "--benchmarks", "aime", "--out", str(out)],
            "convert": ["convert", "--from-hf", str(folder), "--out", str(out)],
            "train": ["train", "--config", str(RECIPE), f"policy.model_path={folder}", f"logging.run_dir={out}"],
        }
        for name, argv in commands.items():
            assert cli.main(argv) == 2, (what, name)
            err = capsys.readouterr().err
            if line.endswith(": "):  # the rest is the tokenizers library's own words
                assert err.startswith(f"nemo-disco {name}: error: {line}") and err.count("\n") == 1, (what, name, err)
            else:
                assert err == f"nemo-disco {name}: error: {line}\n", (what, name)
            assert not out.exists() or not any(out.iterdir()), (what, name)


def test_check_model_folder_names_each_kind_of_damage(tiny_qwen2, tmp_path):
    check_model_folder(tiny_qwen2)  # a whole folder: nothing to say
    folder = tmp_path / "m"
    shutil.copytree(tiny_qwen2, folder)
    weights = folder / "model.safetensors"
    whole = weights.read_bytes()
    (n,) = struct.unpack("<Q", whole[:8])
    cases = [
        (whole[:5], r"m/model.safetensors is truncated or damaged: 5 bytes, shorter than the 8-byte header length$"),
        (whole[: n // 2], rf"is truncated or damaged: {n // 2} bytes, but its header length says the header alone"),
        (whole[:8] + b"x" * n, rf"truncated or damaged: its {n}-byte header is not valid JSON \(Expecting value"),
        (whole + b"\0", r"its header describes \d+ bytes of tensor data, the file holds \d+$"),
    ]
    for data, message in cases:
        weights.write_bytes(data)
        with pytest.raises(ValueError, match=message):
            check_model(folder)
    weights.write_bytes(whole)
    (folder / "config.json").write_text("")
    with pytest.raises(ValueError, match=r"m: config.json is not valid JSON: Expecting value at line 1 column 1$"):
        check_model(folder)
    shutil.copy(tiny_qwen2 / "config.json", folder / "config.json")
    index = {"metadata": {}, "weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"names model-00002-of-00002.safetensors, which is not in the folder$"):
        check_model(folder)


def test_convert_takes_a_folder_only(tmp_path, capsys):
    assert cli.main(["convert", "--from-hf", "owner/no-such-model", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == "nemo-disco convert: error: model folder not found: owner/no-such-model\n"
