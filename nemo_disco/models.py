"""Model pre-flight: a model that cannot be loaded fails in one line, before any engine or policy is built.

:func:`check_model` accepts a Hugging Face model folder or a hub id (its tokenizer is loaded, which caches it).
A folder is checked without loading a model: config, tokenizer and weights present, every ``*.json`` in it valid
JSON, and every ``*.safetensors`` file as long as its header says (a truncated or damaged file is named, not
met as a traceback deep in transformers). Training checks ``policy.model_path`` with it before building
anything, evaluation checks ``--model`` and ``convert`` checks ``--from-hf``.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

from nemo_disco.data import hub_tried, quiet_hub_logs

__all__ = ["check_model", "check_model_folder"]

_CONFIG_FILE = "config.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_WEIGHT_GLOBS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")


#: A hub id: ``name`` or ``owner/name``, letters, digits, ``-``, ``_`` and ``.`` (the hub's own rule, in short).
_HUB_ID = re.compile(r"^[\w.-]{1,96}(/[\w.-]{1,96})?$")
#: Folders a model path starts with that no hub owner is meant by: a run's own folder, and relative paths.
_LOCAL_PREFIXES = ("./", "../", "~", "runs/", os.sep)


def _looks_local(text: str) -> bool:
    """Whether a model that is no folder here was meant as a local path: then no hub is asked (no retries).

    A path-looking value (``./``, ``../``, ``/``, ``~`` or ``runs/`` at the start) or one that cannot be a hub id
    (more than one ``/``, a backslash, other characters).
    """
    return text.startswith(_LOCAL_PREFIXES) or text in (".", "..") or not _HUB_ID.match(text) or ".." in text


def check_model(model: str | os.PathLike, hub: bool = True) -> str:
    """Check that a model can be loaded: a Hugging Face folder with config, tokenizer and weights, or a hub id.

    A hub id (``owner/name`` or ``name``, not a path that exists) is checked by loading its tokenizer (which
    caches it); a folder is checked by :func:`check_model_folder`, without loading a model.

    Args:
        model: a model folder or a hub id.
        hub: whether a hub id is accepted (False: only a folder is, as ``convert --from-hf`` needs).

    Returns:
        ``model`` as a string.

    Raises:
        FileNotFoundError: no such folder, and not a hub id.
        ValueError: the folder lacks config, tokenizer or weights, or one of its files is damaged; the hub id
            cannot be loaded. One line each, naming the model (and the file) and what was tried or is wrong.
    """
    text = str(model)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / _CONFIG_FILE).is_file():
            raise ValueError(f"model folder {path} has no {_CONFIG_FILE}: not a Hugging Face model folder")
        if not any((path / f).is_file() for f in _TOKENIZER_FILES):
            raise ValueError(f"model folder {path} has no tokenizer files (looked for {', '.join(_TOKENIZER_FILES)})")
        if not any(any(path.glob(g)) for g in _WEIGHT_GLOBS):
            raise ValueError(f"model folder {path} has no weights (looked for {', '.join(_WEIGHT_GLOBS)})")
        check_model_folder(path)
        return text
    if path.exists():
        raise ValueError(f"model {path} is a file; expected a Hugging Face model folder")
    if not hub:
        raise FileNotFoundError(f"model folder not found: {path}")
    if _looks_local(text):
        raise FileNotFoundError(f"model folder not found: {path} (and not an owner/name hub id)")
    from transformers import AutoTokenizer

    try:
        with quiet_hub_logs():
            AutoTokenizer.from_pretrained(text)
    except Exception as err:  # missing repo, no network, no tokenizer: one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"cannot load model {text!r}: no folder {path.resolve()}; tried the Hugging Face hub through "
            f"{hub_tried()}: {type(err).__name__}: {first}"
        ) from None
    return text


def check_model_folder(folder: str | os.PathLike) -> None:
    """Check that the files of a model folder are whole, reading no tensor: one line naming a damaged one.

    Every ``*.json`` (config, tokenizer, generation config, shard index) must parse, and ``tokenizer.json`` must be
    one the tokenizers library reads; every ``*.safetensors`` must
    have a readable header and exactly the length its header describes (a copy or download cut short is caught
    here, not as a traceback from the loader); every shard a ``*.safetensors.index.json`` names must be there.

    Raises:
        ValueError: ``model folder FOLDER: FILE is not valid JSON: ... at line L column C``, ``FOLDER/FILE is
            truncated or damaged: ...`` or ``... names SHARD, which is not in the folder``.
    """
    folder = Path(folder)
    for path in sorted(folder.glob("*.json")):
        try:
            value = json.loads(path.read_bytes())
        except json.JSONDecodeError as err:
            what = err.msg if err.msg.endswith(" at") else f"{err.msg} at"  # "Invalid control character at"
            raise ValueError(
                f"model folder {folder}: {path.name} is not valid JSON: {what} line {err.lineno} column {err.colno}"
            ) from None
        except UnicodeDecodeError as err:
            raise ValueError(
                f"model folder {folder}: {path.name} is not valid JSON (not UTF-8 text: {err.reason})"
            ) from None
        if path.name.endswith(".safetensors.index.json"):
            weight_map = value.get("weight_map") if isinstance(value, dict) else None
            shards = weight_map.values() if isinstance(weight_map, dict) else ()
            for shard in sorted(set(map(str, shards))):
                if not (folder / shard).is_file():
                    raise ValueError(f"model folder {folder}: {path.name} names {shard}, which is not in the folder")
    tokenizer = folder / "tokenizer.json"
    if tokenizer.is_file():
        problem = _tokenizer_problem(tokenizer)
        if problem:
            raise ValueError(f"model folder {folder}: tokenizer.json is valid JSON but not a tokenizer: {problem}")
    for path in sorted(folder.glob("*.safetensors")):
        problem = _safetensors_problem(path)
        if problem:
            raise ValueError(f"{path} is truncated or damaged: {problem}")


def _tokenizer_problem(path: Path) -> str | None:
    """Why the tokenizers library cannot read the ``tokenizer.json`` at ``path`` (its first line), or None."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - the library's own error (a serde message) is the reason
        text = str(err).strip()
        return text.splitlines()[0] if text else type(err).__name__
    return None


def _safetensors_problem(path: Path) -> str | None:
    """What is wrong with a ``.safetensors`` file's header or length (None: nothing), reading only the header.

    The format: an 8-byte little-endian header length ``N``, ``N`` bytes of JSON (tensor name -> dtype, shape,
    ``data_offsets`` [begin, end) into the data that follows), then the data, which ends where the last tensor does.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than the 8-byte header length"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return f"{size} bytes, but its header length says the header alone is {n} bytes"
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return f"its {n}-byte header is not valid JSON ({err})"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    ends = [
        t["data_offsets"][1]
        for name, t in header.items()
        if name != "__metadata__" and isinstance(t, dict) and isinstance(t.get("data_offsets"), list)
    ]
    if len(ends) != len(header) - ("__metadata__" in header) or not all(isinstance(e, int) for e in ends):
        return "its header has a tensor without data_offsets"
    data = size - 8 - n
    expected = max(ends, default=0)
    if data != expected:
        return f"its header describes {expected} bytes of tensor data, the file holds {data}"
    return None
