"""Model pre-flight: a model that cannot be loaded fails in one line, before any engine or policy is built.

:func:`check_model` accepts a Hugging Face model folder (config, tokenizer and weights present; nothing is
loaded) or a hub id (its tokenizer is loaded, which caches it). Training checks ``policy.model_path`` with it
before building anything, and evaluation checks ``--model``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from nemo_disco.data import hub_tried, quiet_hub_logs

__all__ = ["check_model"]

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


def check_model(model: str | os.PathLike) -> str:
    """Check that a model can be loaded: a Hugging Face folder with config, tokenizer and weights, or a hub id.

    A hub id (``owner/name`` or ``name``, not a path that exists) is checked by loading its tokenizer (which
    caches it); a folder is checked for its files without loading anything.

    Returns:
        ``model`` as a string.

    Raises:
        FileNotFoundError: no such folder, and not a hub id.
        ValueError: the folder lacks config, tokenizer or weights; the hub id cannot be loaded. One line each,
            naming the model and what was tried.
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
        return text
    if path.exists():
        raise ValueError(f"model {path} is a file; expected a Hugging Face model folder")
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
