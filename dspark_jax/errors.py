"""What counts as the user's mistake, and how the CLI says it.

A user error (a bad argument, file, field, line or request) is printed as ONE line naming the thing
that is wrong, and the command exits 2; `--debug` (or DSPARK_DEBUG=1) shows the traceback as well.
Anything else is our bug and keeps its traceback.

User errors are:
  * `UserError` (raise it, or a subclass, at an input boundary);
  * a ValueError raised by dspark_jax's own code (our validation raises ValueError with a message that
    names the field; a ValueError from inside JAX or NumPy is an internal error);
  * an OSError about a named file (missing, a directory, no permission, disk full), or one our code
    raised (it names the file in its message).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

class UserError(ValueError):
    """Bad input from the user; the message names the file / field / line and what was expected."""


def _raised_in_our_code(err: BaseException) -> bool:
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return str(tb.tb_frame.f_globals.get("__name__", "")).startswith("dspark_jax")


def is_user_error(err: BaseException) -> bool:
    if isinstance(err, UserError):
        return True
    if isinstance(err, OSError):
        return getattr(err, "filename", None) is not None or _raised_in_our_code(err)
    if isinstance(err, ValueError):
        return _raised_in_our_code(err)  # our own ValueError classes are all UserErrors
    return False


def one_line(err: BaseException) -> str:
    """The error as the single line the CLI prints."""
    if isinstance(err, OSError) and getattr(err, "filename", None) is not None and not isinstance(err, UserError):
        return f"{err.filename}: {err.strerror or err}"
    return " ".join(str(err).split()) or type(err).__name__


def debug_requested() -> bool:
    return os.environ.get("DSPARK_DEBUG", "") not in ("", "0")


def read_json_file(path: str | os.PathLike, what: str = "file") -> Any:
    """A JSON file's content, or UserError naming the file and what is wrong (missing, a directory, not
    UTF-8, not JSON: with the line and column)."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise UserError(f"{path}: expected a {what}, got a directory") from None
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text (byte {err.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None


def json_object_line(raw: bytes | str) -> dict | None:
    """One JSONL line -> its JSON object, None for a blank line, or UserError saying what is wrong with it
    (not UTF-8: the byte; not JSON: the reason and column; not an object); the caller names file and line.
    The one line parser of every JSONL input (prompts, calibration records, training data)."""
    try:
        line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as err:
        raise UserError(f"not UTF-8 text (byte {err.start})") from None
    if not line.strip():
        return None
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(rec, dict):
        raise UserError(f"expected a JSON object, got {type(rec).__name__}")
    return rec
