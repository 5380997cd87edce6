"""The user's cache folder: what a first run measures or compiles, kept for the next run (issue 40).

    $XDG_CACHE_HOME/dspark   (else ~/.cache/dspark)
        xla/                          JAX's persistent compilation cache (`dspark serve`, `dspark generate`)
        cost_tables/<bundle>/<machine>_<slots>x<max_len>.json   measured cost tables (serve.profile)

Nothing is written inside the installed package or a bundle folder: a pip-installed package lives in
site-packages, and a bundle may be read-only or shared between machines whose cost tables differ.
$DSPARK_COMPILE_CACHE overrides the compilation cache's default (a folder, or "off"; the test suite sets
"off": a process-wide cache would turn the compile counts that tests assert into cache loads).
This module does not import jax until a cache is enabled (the CLI parses its flags without jax).
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
from pathlib import Path

from dspark_jax.errors import UserError

OFF = "off"
_SAMPLE = 1 << 20  # bytes of a large file's head and tail that key it (hashing GBs of weights takes minutes)


def root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dspark"


def compile_cache_dir(flag: str | None) -> Path | None:
    """The compilation cache folder for `--compile-cache FLAG`: the folder named, None for "off", and with
    no flag $DSPARK_COMPILE_CACHE, else <root>/xla."""
    choice = flag if flag is not None else os.environ.get("DSPARK_COMPILE_CACHE")
    if choice is None:
        return root() / "xla"
    return None if choice == OFF else Path(choice)


def enable_compile_cache(directory: Path | str | None, flag: str = "--compile-cache") -> None:
    """Every program compiled from now on is written to and read from `directory` (None: nothing to do).
    A folder that cannot be made or written is refused now: JAX would only warn at each compile and serve
    without the cache."""
    if directory is None:
        return
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as err:
        raise UserError(f"{flag} {directory}: cannot make the folder ({err.strerror}); "
                        f"pass --compile-cache off to run without it") from None
    if not os.access(directory, os.W_OK):
        raise UserError(f"{flag} {directory}: the folder is not writable; pass --compile-cache off to run "
                        "without it")
    import jax  # noqa: PLC0415

    jax.config.update("jax_compilation_cache_dir", str(directory))
    # Every program, not only those that took over a second to compile (JAX's default): a server's
    # restart should compile nothing, and the many small programs add up on a slow machine.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def bundle_key(path: Path | str) -> str:
    """A digest of a bundle folder's content: each file's name and size, and its bytes (a large file's
    first and last MiB), so a changed model never reads the tables measured on another."""
    digest = hashlib.sha256()
    for f in sorted(p for p in Path(path).iterdir() if p.is_file()):
        size = f.stat().st_size
        digest.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if size <= 2 * _SAMPLE:
                digest.update(fh.read())
            else:
                digest.update(fh.read(_SAMPLE))
                fh.seek(size - _SAMPLE)
                digest.update(fh.read(_SAMPLE))
    return digest.hexdigest()[:16]


def machine_key(device) -> str:
    """What a cost table depends on besides the model: the device kind, and for a CPU its core count and
    processor (a table measured on 2 cores says nothing about 64)."""
    parts = [device.platform, device.device_kind]
    if device.platform == "cpu":
        parts += [f"{os.cpu_count()}cores", _cpu_model()]
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", "_".join(p for p in parts if p)).strip("-")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cost_table_path(bundle_path: Path | str, device, *, slots: int, max_len: int) -> Path:
    return root() / "cost_tables" / bundle_key(bundle_path) / f"{machine_key(device)}_{slots}x{max_len}.json"
