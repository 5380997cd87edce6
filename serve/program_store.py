"""An engine's compiled programs kept on disk under the engine's own key, so a second start loads them
without tracing them (issue 40: a server's second start).

JAX's persistent compilation cache is keyed by the LOWERED module: a second process still traces and
lowers every program before it can look the executable up. On this CPU that is ~1.3 s per program, over a
minute for the embedded default's 57 programs (the second start took 81 s). This store keys each
serialized executable by what decides the program without tracing it:
  * the code: the digest of the package's Python sources, jax's and jaxlib's versions, the jax options
    and XLA flags that change a compiled program;
  * where it runs: the device kind and platform version;
  * the call: the static arguments (the model's config, the program's options) and the tree, shapes,
    dtypes and shardings of the dynamic ones.
A hit is deserialized (`jax.experimental.serialize_executable`) and called directly as a
`jax.stages.Compiled`; a miss compiles as before (through JAX's own cache) and writes the executable.
A file that cannot be read back (truncated, from another build) is a miss: it is compiled and rewritten.

Single-device programs only: an executable is bound to the devices it was compiled for, and a mesh's
device set is the user's choice at each start (a mesh engine keeps JAX's persistent cache).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import pickle
import tempfile
import threading
import types
import zlib
from pathlib import Path

import jax
from jax.experimental import serialize_executable

# The packages whose sources make the programs (the dspark_jax tree and the top-level folders it maps).
_SOURCE_PACKAGES = ("dspark_jax", "dspark_jax.kernels", "dspark_jax.serve", "dspark_jax.train")
_SUFFIX = ".program"
FOLDER = "dspark-programs"  # inside the compilation cache folder (JAX reads only its *-cache files there)


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """A digest of every Python source the programs can come from (an edited file is another program)."""
    digest = hashlib.sha256()
    files = set()
    for name in _SOURCE_PACKAGES:
        spec = importlib.util.find_spec(name)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            files.update(Path(folder).rglob("*.py"))
    for f in sorted(files):
        digest.update(str(f.name).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def _jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _describe(x) -> str:
    """One dynamic argument leaf as the program sees it."""
    sharding = getattr(x, "sharding", None)
    committed = getattr(x, "committed", True)  # an uncommitted array's sharding is not part of the program
    return f"{tuple(x.shape)}:{x.dtype}:{getattr(x, 'weak_type', False)}:{sharding if committed else None}"


def stable_repr(obj, depth: int = 0) -> str:
    """`obj` described by its value, the same in every process: a static argument's default repr names its
    memory address (the backbone objects), which would make every start miss. Our own functions are named
    by module and name (their code is in `source_digest`); anything else keeps its repr, so a value this
    cannot describe makes the key miss, never collide."""
    if depth > 12:
        return repr(obj)
    sub = functools.partial(stable_repr, depth=depth + 1)
    if obj is None or isinstance(obj, (bool, int, float, str, bytes, enum.Enum)):
        return repr(obj)
    if isinstance(obj, (list, tuple)):
        return f"{type(obj).__name__}({','.join(map(sub, obj))})"
    if isinstance(obj, dict):
        return "{" + ",".join(f"{sub(k)}:{sub(v)}" for k, v in sorted(obj.items(), key=lambda kv: repr(kv[0]))) + "}"
    if isinstance(obj, (types.FunctionType, type)):
        ours = obj.__module__.startswith(_SOURCE_PACKAGES[0] + ".") and "<" not in obj.__qualname__
        closure = getattr(obj, "__closure__", None)
        return f"{obj.__module__}.{obj.__qualname__}" if ours and not closure else repr(obj)
    if dataclasses.is_dataclass(obj):
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return f"{type(obj).__module__}.{type(obj).__qualname__}{sub(fields)}"
    if type(obj).__repr__ is object.__repr__ and hasattr(obj, "__dict__"):
        return f"{type(obj).__module__}.{type(obj).__qualname__}{sub(vars(obj))}"
    return repr(obj)


def jax_settings() -> str:
    """The options that change what a traced function compiles to: jax's (the values jit's own cache keys
    on: matmul precision, x64, dtype promotion, ...; the axis environment, empty outside a trace, names an
    address and is left out) and XLA's flags."""
    from jax._src import config as jax_config  # noqa: PLC0415 (no public API lists them)

    values = [v for v in jax_config.trace_context() if " at 0x" not in repr(v)]
    return "\0".join([stable_repr(values), os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", "")])


def program_key(name: str, static: tuple, dynamic: tuple) -> str:
    """The digest naming one program: `name` (the jitted function), its static arguments and the avals of
    its dynamic ones, with the code and the device it compiles for."""
    leaves, tree = jax.tree.flatten(dynamic)
    device = jax.devices()[0]
    parts = [source_digest(), jax.__version__, _jaxlib_version(), jax_settings(),
             device.platform, device.device_kind, str(device.client.platform_version), name, stable_repr(static),
             str(tree), *map(_describe, leaves)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


class ProgramStore:
    """Serialized executables in one folder, one file per program key."""

    def __init__(self, directory: Path | str):
        self.directory = Path(directory)
        self.loaded = self.missed = self.unreadable = 0  # since this process enabled the store
        self._lock = threading.Lock()  # the engine loads in parallel threads

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}{_SUFFIX}"

    def load(self, key: str) -> jax.stages.Compiled | None:
        """The program stored under `key`, loaded on the default device; None when absent or unreadable."""
        try:
            payload, in_tree, out_tree = pickle.loads(zlib.decompress(self._path(key).read_bytes()))
            # On the default device (every program here is single-device; without it, a process with
            # several devices would bind the program to all of them).
            program = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                                execution_devices=jax.devices()[:1])
        except FileNotFoundError:
            self._count("missed")
            return None
        except Exception:  # noqa: BLE001 (a truncated or foreign file: compile it again and overwrite)
            self._count("unreadable")
            return None
        self._count("loaded")
        return program

    def _count(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)

    def summary(self) -> str:
        return (f"{self.loaded} programs loaded from {self.directory}, {self.missed} compiled and stored"
                + (f", {self.unreadable} unreadable files compiled again" if self.unreadable else ""))

    def save(self, key: str, compiled: jax.stages.Compiled) -> bool:
        """Write `compiled` under `key` (atomically: a reader never sees half a file). -> False when this
        executable cannot be serialized or the folder not written (the engine serves all the same)."""
        try:
            # zlib level 1: a sixth of the size (an XLA:CPU executable compresses well) for ~8 ms per MB
            blob = zlib.compress(pickle.dumps(serialize_executable.serialize(compiled)), 1)
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".partial")
            with os.fdopen(fd, "wb") as fh:
                fh.write(blob)
            os.replace(tmp, self._path(key))
            return True
        except Exception:  # noqa: BLE001 (no serialization on this backend, disk full: only the speed-up is lost)
            try:
                os.unlink(tmp)
            except (NameError, OSError):
                pass
            return False


_STORE: ProgramStore | None = None


def enable(directory: Path | str | None) -> None:
    """Engines made from now on (single-device) keep their programs in `directory` (None: no store)."""
    global _STORE
    _STORE = None if directory is None else ProgramStore(directory)


def current() -> ProgramStore | None:
    return _STORE
