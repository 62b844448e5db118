"""nemo_disco.files: output checks that fail for root too, atomic safetensors with the umask's mode."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from safetensors.torch import load_file

from nemo_disco import files


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_save_safetensors_honours_the_umask(tmp_path, umask_022):
    # The library itself creates -rw------- whatever the umask (the reason for the helper).
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2)}, str(tmp_path / "raw.safetensors"))
    assert _mode(tmp_path / "raw.safetensors") == 0o600
    path = files.save_safetensors({"a": torch.arange(3.0)}, tmp_path / "w.safetensors", {"format": "pt"})
    assert _mode(path) == 0o644  # 0o666 & ~0o022
    assert torch.equal(load_file(str(path))["a"], torch.arange(3.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw.safetensors", "w.safetensors"]  # no temporary left
    os.umask(0o027)
    files.honour_umask_tree(tmp_path)
    assert _mode(tmp_path / "raw.safetensors") == 0o640


def test_check_writable_fails_in_one_line_even_for_root(tmp_path):
    # chmod does not stop root: a parent that is a regular file stops everyone (ENOTDIR).
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    expected = rf"^cannot write --out folder {blocker}/out: .*\({blocker} is a file\)$"
    with pytest.raises(files.OutputError, match=expected):
        files.check_writable(blocker / "out", "--out folder")
    with pytest.raises(files.OutputError, match=rf"^cannot write plot {blocker}/a/p.png: {blocker} is a file"):
        files.check_writable_file(blocker / "a" / "p.png", "plot")
    with pytest.raises(files.OutputError, match=rf"^output folder {blocker} is a file$"):
        files.check_fresh_output(blocker, overwrite=False)
    assert files.check_writable(tmp_path / "new" / "deep") == tmp_path / "new" / "deep"
    assert list((tmp_path / "new" / "deep").iterdir()) == []  # the probe is removed


def test_check_fresh_output_refuses_to_merge(tmp_path):
    out = tmp_path / "out"
    files.check_fresh_output(out, overwrite=False)  # absent: fine, and not created
    assert not out.exists()
    out.mkdir()
    files.check_fresh_output(out, overwrite=False)  # empty: fine
    (out / "old.bin").write_text("x")
    with pytest.raises(files.OutputError, match=rf"^{out} is not empty: pass --overwrite"):
        files.check_fresh_output(out, overwrite=False)
    files.check_fresh_output(out, overwrite=True)
    new = tmp_path / ".out.partial"
    new.mkdir()
    (new / "model.bin").write_text("new")
    files.replace_folder(new, out)
    assert sorted(p.name for p in out.iterdir()) == ["model.bin"] and not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_write_that_fails_later_names_the_file_and_its_free_space(tmp_path):
    """``write`` / ``fsync`` fail without a file name: ``[Errno 28] No space left on device`` said nothing more."""
    import errno

    target = tmp_path / "part-0.jsonl"
    with pytest.raises(files.WriteError) as err, files.naming_failed_write(target):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert str(err.value).startswith(f"cannot write {target}: No space left on device (")
    assert str(err.value).endswith(f" MiB on {tmp_path})") and err.value.__cause__.errno == errno.ENOSPC
    assert files.free_space(tmp_path, needed=2**60, what="a checkpoint").startswith("the file system is full: ")
