"""Writing a converter's output folder so that a failed run leaves it as it was.

`with staged_output(DST) as work:` writes everything into `work`, a hidden folder inside DST
(`.dspark-convert-XXXXXXXX`); only when the block returns are its entries moved into DST. Inside DST,
so that every move is a rename on DST's own file system (no copy, no extra space, also when DST is a
mount point). When the block raises (a full disk, a bad tensor, Ctrl-C), `work` is removed with all the
partial files in it, and so are DST and its parent folders if this run created them and they are empty:
nothing that existed before is touched, so a rerun finds DST as it was. An OSError becomes one line
naming the file (by its name in DST) and the reason.

With `replaces` (--overwrite), the old entries it names are deleted only at the commit, once the new
files are complete: a failed run keeps them, at the cost of room for old and new together.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Iterator

from dspark_jax.errors import UserError

STAGING_PREFIX = ".dspark-convert-"


def leftover_staging(entries: Iterable[Path]) -> list[str]:
    """The names among `entries` that are staging folders of an earlier, killed run (a run that fails
    removes its own; only SIGKILL or a power cut leave one)."""
    return sorted(p.name for p in entries if p.name.startswith(STAGING_PREFIX))


def missing_folders(path: Path) -> list[Path]:
    """`path` and its ancestors that do not exist yet, deepest first: what `mkdir(parents=True)` creates
    and a failed run must remove again."""
    missing = []
    for p in (path, *path.absolute().parents):
        if p.exists():
            break
        missing.append(p)
    return missing


def shown_path(path: str | os.PathLike, work: Path, dst: Path) -> str | None:
    """A path inside the staging folder as the user will know it (by its place in DST); None for a path
    outside it."""
    try:
        return str(dst / Path(path).relative_to(work))
    except ValueError:
        return None


def write_failure(err: OSError, work: Path, dst: Path) -> str:
    """The one line for an OSError raised while the output was being written: the file and the OS reason.
    A full disk's ENOSPC from write() or close() names no file; our writers add the name (see
    `naming_file`), so an unnamed one came from code that does not, and the line names the folder."""
    reason = err.strerror or str(err) or type(err).__name__
    if err.filename is None:
        what = f"cannot write into {dst}: {reason}"
    else:
        ours = shown_path(err.filename, work, dst)
        what = f"cannot write {ours}: {reason}" if ours else f"{err.filename}: {reason}"  # e.g. a source read
    return f"{what}; {dst} is left as it was before this run (the partial output was removed)"


@contextlib.contextmanager
def naming_file(path: str | os.PathLike) -> Iterator[None]:
    """An OSError that names no file, raised while writing `path`, names it: write() and close() report a
    full disk (ENOSPC) or an I/O error without a file name."""
    try:
        yield
    except OSError as err:
        if err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror or str(err), str(path)) from err


def _remove_empty(folders: list[Path]) -> None:
    for p in folders:  # deepest first; a folder someone else has filled meanwhile stays
        try:
            p.rmdir()
        except OSError:
            return


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)


def _renamed_error(err: UserError, work: Path, dst: Path) -> UserError:
    """A UserError whose message names a staged file gets DST's name for it (the staging folder is gone
    by the time the user reads the line)."""
    msg = str(err)
    if len(err.args) != 1 or str(work) not in msg:
        return err
    return type(err)(msg.replace(str(work), str(dst)))


@contextlib.contextmanager
def staged_output(dst: str | os.PathLike,
                  replaces: Callable[[Path], Iterable[Path]] = lambda dst: ()) -> Iterator[Path]:
    """Yield an empty folder to write DST's content into; see the module docstring. `replaces(dst)`
    names the old entries of DST that the new output replaces (deleted at the commit only)."""
    dst = Path(dst)
    created = missing_folders(dst)
    try:
        dst.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=dst))
    except OSError as err:
        _remove_empty(created)
        raise UserError(f"cannot write the output folder {dst}: {err.strerror or err}") from None
    try:
        yield work
    except BaseException as err:
        shutil.rmtree(work, ignore_errors=True)
        _remove_empty(created)
        if isinstance(err, UserError):
            renamed = _renamed_error(err, work, dst)
            if renamed is not err:
                raise renamed from err
        elif isinstance(err, OSError):
            raise UserError(write_failure(err, work, dst)) from err
        raise
    # The commit: deletes and renames within DST only, so it needs no space and cannot half-write a file.
    try:
        for old in replaces(dst):
            if old != work:
                _remove(old)
        for entry in sorted(work.iterdir()):
            os.replace(entry, dst / entry.name)
        work.rmdir()
    except OSError as err:
        raise UserError(f"cannot move the finished output into {dst}: {err.strerror or err} "
                        f"({err.filename or work}); what is not yet moved is in "
                        f"{work}") from err
