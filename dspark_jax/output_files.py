"""Writing a command's output file so that no earlier file is ever lost.

A command that writes `--out F` writes a temporary file beside F and renames it over F only once the
command has finished (a rename within one folder is atomic): until then F keeps what it held, whatever
fails on the way (a bad bundle, a crash, Ctrl-C). An output path that is one of the command's inputs is
refused before any work, since the results would replace the input.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import IO, Iterable, Iterator

from dspark_jax.errors import UserError

PARTIAL_SUFFIX = ".partial"


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_not_an_input(out: str | os.PathLike, inputs: Iterable[tuple[str, str | os.PathLike | None]],
                       out_flag: str = "--out") -> None:
    """Refuse `out` when it is one of `inputs` ((flag, path) pairs; None paths skipped): the same path or
    the same file (a link)."""
    out_path = Path(out)
    for flag, path in inputs:
        if path is None:
            continue
        path = Path(path)
        if out_path.resolve() == path.resolve() or _same_file(out_path, path):
            raise UserError(f"{out_flag} {out}: is the input {flag} {path}; the results would replace it "
                            f"(write them to another file)")


@contextlib.contextmanager
def replaced_on_success(path: str | os.PathLike, *, keep_partial: bool = False) -> Iterator[IO]:
    """with replaced_on_success("F") as f: write to f  ->  F is replaced only if the block returns.

    The temporary file is created now, beside F, so an unwritable folder fails before any work. When the
    block raises, the temporary file is removed; with `keep_partial` (results written as they finish), a
    non-empty one is kept as F.partial instead, and stderr says so."""
    target = Path(path)
    if target.is_dir():
        raise UserError(f"{target}: is a directory; expected a file to write")
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except FileNotFoundError:
        raise UserError(f"{target}: its folder {target.parent} does not exist") from None
    except PermissionError:
        raise UserError(f"{target}: cannot write in {target.parent} (permission denied)") from None
    tmp = Path(tmp_name)
    f = os.fdopen(fd, "w")
    try:
        yield f
        f.close()
        _keep_mode(target, tmp)
        os.replace(tmp, target)
    except BaseException:
        f.close()
        if keep_partial and tmp.exists() and tmp.stat().st_size > 0:
            partial = target.with_name(target.name + PARTIAL_SUFFIX)
            os.replace(tmp, partial)
            print(f"dspark: {target} left as it was; what was written before the failure is in {partial}",
                  file=sys.stderr)
        else:
            tmp.unlink(missing_ok=True)
        raise


def _keep_mode(target: Path, tmp: Path) -> None:
    """The new file gets the old one's permissions (mkstemp makes 0600), else the usual 0666 - umask."""
    if target.exists():
        os.chmod(tmp, target.stat().st_mode & 0o7777)
    else:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path`, replacing it only once all of it is written."""
    with replaced_on_success(path) as f:
        f.write(text)
