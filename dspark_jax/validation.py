"""Validation and file helpers shared by every config class (draft families, backbones, run configs).

A config is a frozen dataclass validated once in `__post_init__`; each check names the field, the value
it got and the value it expected (`check_field`), so a user can fix a file from the message alone.
"""

from __future__ import annotations

import difflib
import json
import math
from pathlib import Path
from typing import Any

from dspark_jax.errors import UserError


# The MoE router's score functions (`nn.moe.gate_scores`), a value the draft and backbone configs check.
SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


# The Markov head types (`drafts.markov`, SPEC 4.1); configs compare them case-insensitively.
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


def is_markov_head_type(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() in MARKOV_HEAD_TYPES


class ConfigError(UserError):
    """A config value is missing, unknown or out of range; the message names the field."""


def did_you_mean(key: str, valid) -> str:
    close = difflib.get_close_matches(key, sorted(valid), 1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def check_known_keys(obj, valid, where: str | None = None) -> None:
    """Every key of the JSON object `obj` is one of `valid`; an unknown or misspelt one is a UserError
    naming the closest valid key (prefixed by `where`, e.g. the file)."""
    for key in obj:
        if key not in valid:
            prefix = f"{where}: " if where else ""
            raise UserError(f"{prefix}unknown key {key!r}{did_you_mean(key, valid)}; expected some of "
                            f"{', '.join(valid)}")


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """A finite int or float (bool excluded: JSON `true` is not a number here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_field(ok: bool, field: str, expected: str, got: Any) -> None:
    if not ok:
        raise ConfigError(f"config field '{field}': expected {expected}, got {got!r}")


def read_json_config(path: str | Path, parse):
    """`parse(dict)` of a JSON config file (a folder means its config.json); every error names the file."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object at top level")
    try:
        return parse(raw)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


# Command-line flags. Each subcommand checks its numeric flags first thing in run(), before any model
# load or compile: a bad count or a NaN would otherwise surface minutes later, or not at all (a table of
# zeros, exit 0). An argparse `type=` check would print a usage block, not the one line a UserError gets.

def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _flag_values(args, dest: str) -> list:
    # None is an absent optional flag (its default means "off" / "all"); nargs flags hold lists.
    value = getattr(args, dest)
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def check_int_flags(args, *dests: str, minimum: int = 1) -> None:
    """Each flag in `dests` an integer >= minimum (counts: minimum 1), else UserError naming it."""
    for dest in dests:
        for v in _flag_values(args, dest):
            if not is_int(v) or v < minimum:
                raise UserError(f"{flag_name(dest)}: expected an integer >= {minimum}, got {v!r}")


def check_number_flags(args, *dests: str, minimum: float = 0.0, above: bool = False,
                       maximum: float | None = None) -> None:
    """Each flag in `dests` a finite number >= minimum (> minimum with `above`; <= maximum when given)."""
    expected = f"a finite number {'>' if above else '>='} {minimum:g}" + (
        f" and <= {maximum:g}" if maximum is not None else "")
    for dest in dests:
        for v in _flag_values(args, dest):
            ok = is_number(v) and (v > minimum if above else v >= minimum) and (maximum is None or v <= maximum)
            if not ok:
                raise UserError(f"{flag_name(dest)}: expected {expected}, got {v!r}")


def int_list_flag(args, dest: str, minimum: int = 1) -> list[int]:
    """A comma-separated list flag ("1,8,32") as ints >= minimum, else UserError naming the flag."""
    text = getattr(args, dest)
    try:
        values = [int(x) for x in str(text).split(",")]
    except ValueError:
        values = None
    if not values or any(v < minimum for v in values):
        raise UserError(f"{flag_name(dest)}: expected comma-separated integers >= {minimum}, got {text!r}")
    return values


def check_output_flags(args, *dests: str) -> None:
    """Each given output-file flag names a file that can be written: its folder exists and it is not a
    folder itself. Checked first, so a benchmark or profile does not run for minutes and then lose its
    result to a typo in the path (an empty or absent value means "do not write")."""
    for dest in dests:
        value = getattr(args, dest)
        if not value or str(value) == "-":
            continue
        path = Path(value)
        folder = path.parent if str(path.parent) else Path(".")
        if path.is_dir():
            raise UserError(f"{flag_name(dest)}: {path} is a folder, expected a file to write")
        if not folder.is_dir():
            raise UserError(f"{flag_name(dest)}: the folder of {path} does not exist (create it first)")
