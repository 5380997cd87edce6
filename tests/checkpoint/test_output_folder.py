"""dspark_jax.checkpoint.output_folder: an output folder written in staging and moved into place at the end, so
that a failed run (a full disk, a bad tensor, Ctrl-C) leaves the folder as it was."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from dspark_jax.checkpoint.output_folder import (
    STAGING_PREFIX, leftover_staging, missing_folders, naming_file, staged_output, write_failure,
)
from dspark_jax.checkpoint.safetensors_io import CheckpointError
from dspark_jax.errors import UserError

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # what write() / close() raise: no file name


def _tree(folder):
    """Every path under `folder` with the bytes of each file: the state a failed run must not change."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def test_success_moves_the_output_into_the_folder_and_leaves_no_staging(tmp_path):
    dst = tmp_path / "a" / "b"
    with staged_output(dst) as work:
        assert work.parent == dst and work.name.startswith(STAGING_PREFIX)
        (work / "model.safetensors").write_bytes(b"new")
        (work / "sub").mkdir()
        (work / "sub" / "x").write_bytes(b"x")
    assert _tree(dst) == {"model.safetensors": b"new", "sub": None, "sub/x": b"x"}


@pytest.mark.parametrize("existed", ["absent", "empty", "full"])
def test_a_write_failure_names_the_file_and_leaves_the_folder_as_it_was(tmp_path, existed):
    dst = tmp_path / "new" / "out"
    if existed != "absent":
        dst.mkdir(parents=True)
    if existed == "full":
        (dst / "model.safetensors").write_bytes(b"old")
        (dst / "notes.txt").write_bytes(b"mine")
    before = _tree(tmp_path)
    with pytest.raises(UserError) as err:
        with staged_output(dst, lambda d: list(d.iterdir())) as work:  # replaces everything, at the commit only
            (work / "model-00001-of-00002.safetensors").write_bytes(b"done")
            with naming_file(work / "model-00002-of-00002.safetensors"):
                (work / "model-00002-of-00002.safetensors").write_bytes(b"half")
                raise ENOSPC
    assert str(err.value) == (f"cannot write {dst / 'model-00002-of-00002.safetensors'}: No space left on device; "
                              f"{dst} is left as it was before this run (the partial output was removed)")
    assert isinstance(err.value.__cause__, OSError) and err.value.__cause__.errno == errno.ENOSPC
    assert _tree(tmp_path) == before  # absent: the folder and its parent made for this run are gone again


def test_other_failures_keep_their_error_and_clean_up_too(tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        with staged_output(dst) as work:
            (work / "f").write_bytes(b"x")
            raise KeyboardInterrupt
    assert not dst.exists()
    # a UserError naming a staged file names it by its place in DST: the staging folder is gone
    with pytest.raises(CheckpointError, match=rf"^{dst / 'model.safetensors'}: tensor 'w' written twice$"):
        with staged_output(dst) as work:
            raise CheckpointError(f"{work / 'model.safetensors'}: tensor 'w' written twice")
    assert not dst.exists()


def test_write_failure_lines():
    work, dst = Path("out/.dspark-convert-x"), Path("out")
    tail = "; out is left as it was before this run (the partial output was removed)"
    assert write_failure(OSError(errno.EIO, "Input/output error", "out/.dspark-convert-x/c.json"), work, dst) == (
        "cannot write out/c.json: Input/output error" + tail)
    assert write_failure(ENOSPC, work, dst) == "cannot write into out: No space left on device" + tail
    # a file outside the output (a source that vanished mid-read) is named as it is, not as written
    assert write_failure(FileNotFoundError(errno.ENOENT, "No such file or directory", "src/a.safetensors"), work,
                         dst) == "src/a.safetensors: No such file or directory" + tail


def test_naming_file_adds_the_name_only_when_missing(tmp_path):
    with pytest.raises(OSError) as err:
        with naming_file(tmp_path / "a"):
            raise ENOSPC
    assert (err.value.errno, err.value.filename) == (errno.ENOSPC, str(tmp_path / "a"))
    with pytest.raises(PermissionError) as err:
        with naming_file(tmp_path / "a"):
            raise PermissionError(errno.EACCES, "Permission denied", "elsewhere")
    assert err.value.filename == "elsewhere"


def test_missing_folders_and_leftovers(tmp_path):
    assert missing_folders(tmp_path / "x" / "y") == [tmp_path / "x" / "y", tmp_path / "x"]
    assert missing_folders(tmp_path) == []
    assert leftover_staging([tmp_path / f"{STAGING_PREFIX}ab", tmp_path / "model.safetensors"]) == [
        f"{STAGING_PREFIX}ab"]


def test_an_output_folder_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    out = tmp_path / "file" / "out"
    with pytest.raises(UserError, match=rf"^cannot write the output folder {out}: Not a directory$"):
        with staged_output(out):
            pass
    assert _tree(tmp_path) == {"file": b""}
