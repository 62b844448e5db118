"""Output files: checked before long work starts, written atomically, readable by the user's group.

- :func:`check_writable`: an output folder (or a file's folder) that cannot be written fails in one line
  naming the path, before a model is loaded or a step is run;
- :func:`save_safetensors` / :func:`honour_umask`: the safetensors library creates its files ``-rw-------``
  whatever the umask; every weight file this project writes gets the mode the umask gives an ordinary file
  (``-rw-r--r--`` under umask 022), so teammates on a shared file system can read an export;
- :func:`naming_failed_write` / :func:`free_space`: a write that fails later (a full disk, a quota, a vanished
  mount) is one line naming the file and its file system's free space (:class:`WriteError`), not a bare
  ``[Errno 28] No space left on device``; a checkpoint save names the free space the same way;
- :data:`TOKENIZER_FILES`: the files a Hugging Face folder's tokenizer may consist of.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
)


class OutputError(ValueError):
    """An output path that cannot be written (one line naming it)."""


class WriteError(OSError):
    """A file that could not be written after the start-up checks: one line naming it and the free space."""


def free_space(path: str | os.PathLike, needed: int | None = None, what: str = "the file") -> str:
    """Free space on ``path``'s file system; says it is full when it cannot hold ``needed`` bytes (``what``)."""
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return "free space unknown"
    text = f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB on {path}"
    if needed is not None and usage.free < needed:
        text = f"the file system is full: {text}, {what} takes {needed / 2**20:.1f} MiB"
    return text


@contextlib.contextmanager
def naming_failed_write(path: str | os.PathLike) -> Iterator[None]:
    """An ``OSError`` inside (ENOSPC, EDQUOT, EIO, a vanished folder) becomes a :class:`WriteError` naming ``path``.

    ``write`` and ``fsync`` fail without a file name (``[Errno 28] No space left on device``): the message says
    ``cannot write PATH: No space left on device (0.0 MiB free of 1.0 MiB on FOLDER)``.
    """
    try:
        yield
    except WriteError:
        raise
    except OSError as err:
        reason = err.strerror or str(err) or type(err).__name__
        folder = Path(path).parent
        raise WriteError(f"cannot write {path}: {reason} ({free_space(folder)})") from err


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def honour_umask(path: str | os.PathLike) -> None:
    """Give a file the mode an ordinary new file gets under the current umask (0o666 & ~umask)."""
    os.chmod(path, 0o666 & ~_umask())


def honour_umask_tree(folder: str | os.PathLike, pattern: str = "*.safetensors") -> None:
    """:func:`honour_umask` for every file of ``folder`` matching ``pattern`` (``save_pretrained``'s output)."""
    for f in Path(folder).glob(pattern):
        if f.is_file():
            honour_umask(f)


def save_safetensors(
    state: Mapping[str, torch.Tensor], path: str | os.PathLike, metadata: Mapping[str, str] | None = None
) -> Path:
    """``safetensors.torch.save_file`` atomically (a temporary file renamed into place), mode from the umask."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(dict(state), str(tmp), metadata=dict(metadata) if metadata else None)
    honour_umask(tmp)
    os.replace(tmp, path)
    return path


def check_writable(path: str | os.PathLike, what: str = "output folder", *, create: bool = True) -> Path:
    """Fail now, in one line naming ``path``, if a folder cannot be created and written.

    Creates the folder (and its parents) when ``create``, then creates and removes a probe file in it: the
    test that also fails for root (a read-only file system, a parent that is a regular file, a full disk's
    inode table), where permission bits alone would not.

    Raises:
        OutputError: the folder cannot be made or written; the message names the path and the cause.
    """
    path = Path(path)
    try:
        if path.exists() and not path.is_dir():
            raise OutputError(f"{what} {path} is a file, not a folder")
        if create:
            path.mkdir(parents=True, exist_ok=True)
            probe_dir = path
        else:  # the nearest existing ancestor must be a writable folder
            probe_dir = path
            while not probe_dir.exists():
                probe_dir = probe_dir.parent
            if not probe_dir.is_dir():
                raise OutputError(f"cannot write {what} {path}: {probe_dir} is a file, not a folder")
        with tempfile.NamedTemporaryFile(dir=probe_dir, prefix=".nemo-disco-probe-"):
            pass
    except OutputError:
        raise
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise OutputError(f"cannot write {what} {path}: {reason}" + _which(path)) from None
    return path


def check_writable_file(path: str | os.PathLike, what: str = "output file") -> Path:
    """:func:`check_writable` for the folder a file will be written in (not created here); not a folder itself."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{what} {path} is a folder, not a file")
    try:
        check_writable(path.parent, what, create=False)
    except OutputError as err:
        raise OutputError(str(err).replace(f"{what} {path.parent}", f"{what} {path}", 1)) from None
    return path


def _which(path: Path) -> str:
    """`` (PARENT is a file)`` when an ancestor of ``path`` is a regular file: the usual cause of ENOTDIR."""
    for parent in path.parents:
        if parent.exists():
            return f" ({parent} is a file)" if not parent.is_dir() else ""
    return ""


def replace_folder(tmp: Path, final: Path) -> None:
    """Move a finished folder into place; an older ``final`` is removed only once ``tmp`` is complete."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def check_fresh_output(path: str | os.PathLike, overwrite: bool, flag: str = "--overwrite") -> Path:
    """An output folder that holds files is refused (one line) unless ``overwrite``; checked writable."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"output folder {path} is a file")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise OutputError(f"{path} is not empty: pass {flag} to replace it, or choose another --out")
    return check_writable(path, "output folder", create=False)
