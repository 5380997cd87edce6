"""Streaming safetensors I/O in plain numpy, including the fp8 / fp4 dtypes the `safetensors` package
cannot hand to numpy.

File format: 8-byte little-endian header length N, N bytes of UTF-8 JSON
`{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [begin, end]}, ...}`, then the
data buffer; offsets are relative to the start of the buffer.

Reading: `open_checkpoint(path)` takes a `.safetensors` file, a folder of them, a folder with
`model.safetensors.index.json` (or that index file itself) and returns a `CheckpointReader`; every
header is parsed and validated up front (cheap), tensors are then read one at a time through a
memory map of just that tensor's bytes, which is released when the returned array is dropped, so
touching a 100 GB checkpoint costs the memory of one tensor.

`F4` (torch `float4_e2m1fn_x2`) has a logical shape `[..., n]` but holds two values per byte; it is
returned as its packed bytes, uint8 `[..., n/2]`, i.e. exactly what the `I8 [out, in/2]` spelling of
the same weight holds.

Writing: `SafetensorsWriter(path, specs)` writes the header first (from the declared names, dtypes
and shapes) and then each tensor as it comes, so a converter holds one tensor at a time.
`save_file(path, tensors)` is the one-shot form.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import struct
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import ml_dtypes
import numpy as np

from dspark_jax.checkpoint.output_folder import naming_file
from dspark_jax.errors import UserError

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit the reference implementation uses


class CheckpointError(UserError):
    """A checkpoint file or tensor is malformed, missing, unexpected or mis-shaped; names it."""


# safetensors dtype name -> numpy dtype of one stored element (F4: one stored byte = two values).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "F4": np.dtype(np.uint8),  # packed pairs
}
_NAME_OF_DTYPE = {v: k for k, v in DTYPES.items() if k != "F4"}


def dtype_name(dtype) -> str:
    """numpy dtype -> safetensors dtype name (F4 is never inferred: pass it explicitly)."""
    try:
        return _NAME_OF_DTYPE[np.dtype(dtype)]
    except KeyError:
        raise CheckpointError(f"no safetensors dtype for numpy dtype {np.dtype(dtype)}; "
                              f"supported: {sorted(DTYPES)}") from None


def nbytes_of(dtype: str, shape: Iterable[int]) -> int:
    n = math.prod(shape)
    if dtype == "F4":
        return n // 2
    return n * DTYPES[dtype].itemsize


def stored_shape(dtype: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the numpy array that holds the bytes (F4: inner dimension halved)."""
    if dtype == "F4":
        return tuple(shape[:-1]) + (shape[-1] // 2,)
    return tuple(shape)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]  # logical shape as written in the header
    begin: int  # absolute byte offset in the file
    end: int
    file: Path

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------
def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


class SafetensorsFile:
    """One validated `.safetensors` file. `view(name)` maps just that tensor's bytes."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        if size < 8:
            raise CheckpointError(f"{self.path}: truncated file ({size} bytes); a safetensors file starts "
                                  "with an 8-byte header length")
        with open(self.path, "rb") as f:
            (hlen,) = struct.unpack("<Q", f.read(8))
            if hlen > MAX_HEADER_BYTES:
                raise CheckpointError(f"{self.path}: bad header: header length {hlen} exceeds "
                                      f"{MAX_HEADER_BYTES} bytes (not a safetensors file?)")
            if 8 + hlen > size:
                raise CheckpointError(f"{self.path}: truncated file: header says {hlen} header bytes, "
                                      f"file has {size - 8} after the length")
            raw = f.read(hlen)
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
        except (UnicodeDecodeError, ValueError) as err:
            raise CheckpointError(f"{self.path}: bad header: not valid JSON ({err})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: bad header: expected a JSON object, got {type(header).__name__}")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise CheckpointError(f"{self.path}: bad header: __metadata__ must map strings to strings")
        self.metadata: dict[str, str] = meta
        self.data_start = 8 + hlen
        data_len = size - self.data_start
        infos: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            infos[name] = self._parse_entry(name, entry, data_len)
        spans = sorted((i.begin, i.end, i.name) for i in infos.values() if i.end > i.begin)
        for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise CheckpointError(f"{self.path}: bad header: tensors '{n0}' and '{n1}' overlap "
                                      f"(bytes [{b0 - self.data_start}, {e0 - self.data_start}) and "
                                      f"[{b1 - self.data_start}, {e1 - self.data_start}))")
        self.infos = dict(sorted(infos.items(), key=lambda kv: kv[1].begin))

    def _parse_entry(self, name, entry, data_len) -> TensorInfo:
        where = f"{self.path}: tensor '{name}'"
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise CheckpointError(f"{where}: bad header entry {entry!r}; expected dtype, shape, data_offsets")
        dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            raise CheckpointError(f"{where}: unknown dtype {dtype!r}; supported: {sorted(DTYPES)}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape)):
            raise CheckpointError(f"{where}: bad shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) and not isinstance(o, bool)
                                                                  for o in offs)):
            raise CheckpointError(f"{where}: bad data_offsets {offs!r}")
        begin, end = offs
        if not 0 <= begin <= end:
            raise CheckpointError(f"{where}: bad data_offsets {offs} (need 0 <= begin <= end)")
        if dtype == "F4" and (not shape or shape[-1] % 2):
            raise CheckpointError(f"{where}: F4 tensor with odd inner dimension, shape {shape}; "
                                  "fp4 packs two values per byte")
        want = nbytes_of(dtype, shape)
        if end - begin != want:
            raise CheckpointError(f"{where}: byte span {end - begin} != {want} for dtype {dtype} shape {shape}")
        if end > data_len:
            raise CheckpointError(f"{where}: truncated file or offsets out of range: the tensor ends at data "
                                  f"byte {end}, the file holds {data_len} data bytes")
        return TensorInfo(name, dtype, tuple(shape), self.data_start + begin, self.data_start + end, self.path)

    @property
    def names(self) -> list[str]:
        return list(self.infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.infos[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor '{name}'") from None

    def view(self, name: str) -> np.ndarray:
        return _map_tensor(self.info(name))

    def read(self, name: str) -> np.ndarray:
        return np.array(self.view(name))


def _map_tensor(info: TensorInfo) -> np.ndarray:
    """Read-only array over the tensor's bytes; the mapping lives exactly as long as the array."""
    shape = stored_shape(info.dtype, info.shape)
    dtype = DTYPES[info.dtype]
    if info.nbytes == 0:
        return np.zeros(shape, dtype=dtype)
    start = info.begin - info.begin % mmap.ALLOCATIONGRANULARITY
    try:
        with open(info.file, "rb") as f:
            mm = mmap.mmap(f.fileno(), info.end - start, offset=start, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as err:  # file shrank since the header was read
        raise CheckpointError(f"{info.file}: tensor '{info.name}': cannot map bytes ({err})") from None
    arr = np.frombuffer(mm, dtype=dtype, count=math.prod(shape), offset=info.begin - start).reshape(shape)
    return arr


class CheckpointReader:
    """All tensors of a checkpoint (one file, a folder of shards, or an index json), by name."""

    def __init__(self, files: list[SafetensorsFile], weight_map: Mapping[str, Path] | None, root: Path):
        self.root = root
        self.files = files
        self._by_file = {f.path: f for f in files}
        self._infos: dict[str, TensorInfo] = {}
        if weight_map is None:
            for f in files:
                for name, info in f.infos.items():
                    if name in self._infos:
                        raise CheckpointError(f"tensor '{name}' appears in both {self._infos[name].file} and "
                                              f"{f.path}")
                    self._infos[name] = info
        else:
            for name, path in weight_map.items():
                sf = self._by_file[path]
                if name not in sf.infos:
                    raise CheckpointError(f"{root / INDEX_NAME}: tensor '{name}' is mapped to {path.name}, "
                                          "which does not contain it")
                self._infos[name] = sf.infos[name]

    @property
    def names(self) -> list[str]:
        return list(self._infos)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(f"{self.root}: checkpoint has no tensor '{name}'") from None

    def view(self, name: str) -> np.ndarray:
        return _map_tensor(self.info(name))

    def read(self, name: str) -> np.ndarray:
        return np.array(self.view(name))

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        """(name, view) one tensor at a time, in file order."""
        for name in self.names:
            yield name, self.view(name)

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self._infos.values())


def open_checkpoint(path: str | os.PathLike) -> CheckpointReader:
    path = Path(path)
    if path.is_file() and path.name.endswith(".json"):
        return _open_index(path)
    if path.is_file():
        return CheckpointReader([SafetensorsFile(path)], None, path.parent)
    if path.is_dir():
        if (path / INDEX_NAME).is_file():
            return _open_index(path / INDEX_NAME)
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{path}: no *.safetensors files and no {INDEX_NAME}")
        return CheckpointReader([SafetensorsFile(p) for p in shards], None, path)
    raise CheckpointError(f"{path}: no such file or directory")


def _open_index(index: Path) -> CheckpointReader:
    try:
        raw = json.loads(index.read_text())
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{index}: not valid JSON ({err})") from None
    wm = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointError(f"{index}: expected an object with a 'weight_map' of tensor name -> file name")
    root = index.parent
    files: dict[Path, SafetensorsFile] = {}
    weight_map: dict[str, Path] = {}
    for name, fname in wm.items():
        p = root / fname
        if p not in files:
            if not p.is_file():
                raise CheckpointError(f"{index}: tensor '{name}' is mapped to {fname}, which does not exist")
            files[p] = SafetensorsFile(p)
        weight_map[name] = p
    return CheckpointReader(list(files.values()), weight_map, root)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise CheckpointError(f"tensor '{self.name}': unknown dtype {self.dtype!r}; supported: {sorted(DTYPES)}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.dtype == "F4" and (not self.shape or self.shape[-1] % 2):
            raise CheckpointError(f"tensor '{self.name}': F4 needs an even inner dimension, shape {list(self.shape)}")

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)


class SafetensorsWriter:
    """Declare every tensor up front, then `write` each one (any order); `close` checks all arrived.

    Writes to `<path>.partial` and renames on success, so a failed export never leaves a file that
    looks complete; a failure (with `with`, or `abort`) removes the `.partial`, and an OSError names `path`.
    """

    def __init__(self, path: str | os.PathLike, specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None = None):
        self.path = Path(path)
        self.specs: dict[str, TensorSpec] = {}
        for s in specs:
            if s.name in self.specs:
                raise CheckpointError(f"{self.path}: tensor '{s.name}' declared twice")
            self.specs[s.name] = s
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        self._offsets: dict[str, int] = {}
        off = 0
        for s in self.specs.values():
            header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
            self._offsets[s.name] = off
            off += s.nbytes
        self.data_bytes = off
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        blob += b" " * (-len(blob) % 8)  # keeps the data buffer 8-byte aligned
        self._data_start = 8 + len(blob)
        self._tmp = self.path.with_name(self.path.name + ".partial")
        try:
            self._f = open(self._tmp, "wb")
        except OSError as err:
            raise self._failed(err) from err
        try:
            self._f.write(struct.pack("<Q", len(blob)))
            self._f.write(blob)
            self._f.truncate(self._data_start + self.data_bytes)
        except OSError as err:
            self.abort()  # the constructor raised, so no `with` block will
            raise self._failed(err) from err
        self._written: set[str] = set()

    def _failed(self, err: OSError) -> OSError:
        """`err` naming the file being written: a full disk's ENOSPC from write() or close() names none,
        and the `.partial` name it may carry is ours (removed by then); the user knows the final name."""
        return OSError(err.errno, err.strerror or str(err), str(self.path))

    def write(self, name: str, array: np.ndarray) -> None:
        spec = self.specs.get(name)
        if spec is None:
            raise CheckpointError(f"{self.path}: tensor '{name}' was not declared")
        if name in self._written:
            raise CheckpointError(f"{self.path}: tensor '{name}' written twice")
        a = np.asarray(array)
        want_dtype, want_shape = DTYPES[spec.dtype], stored_shape(spec.dtype, spec.shape)
        if spec.dtype in ("F4", "I8", "U8") and a.dtype in (np.int8, np.uint8):
            a = a.view(want_dtype)  # packed fp4 bytes come as either signedness
        if a.dtype != want_dtype or a.shape != want_shape:
            raise CheckpointError(f"{self.path}: tensor '{name}': got {a.dtype} {list(a.shape)}, declared "
                                  f"{spec.dtype} {list(spec.shape)} (stored as {want_dtype} {list(want_shape)})")
        a = np.ascontiguousarray(a)
        try:
            self._f.seek(self._data_start + self._offsets[name])
            if a.nbytes:
                self._f.write(a.reshape(-1).view(np.uint8).data)
        except OSError as err:
            raise self._failed(err) from err  # `with` (or the caller's abort) removes the .partial
        self._written.add(name)

    def close(self) -> None:
        if self._f.closed:
            return
        missing = [n for n in self.specs if n not in self._written]
        try:
            self._f.close()  # flushes the buffer: a full disk often shows here, after every write() returned
        except OSError as err:
            self._tmp.unlink(missing_ok=True)  # `with` calls close, not abort, when the block returned
            raise self._failed(err) from err
        if missing:
            self._tmp.unlink(missing_ok=True)
            raise CheckpointError(f"{self.path}: {len(missing)} declared tensors never written, e.g. '{missing[0]}'")
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()


def save_file(path: str | os.PathLike, tensors: Mapping[str, np.ndarray | tuple[str, np.ndarray]],
              metadata: Mapping[str, str] | None = None) -> None:
    """Write a dict of arrays. A value may be `(dtype_name, array)` to force a dtype such as `F4`
    (then the array holds the packed bytes `[..., n/2]`)."""
    items = []
    for name, v in tensors.items():
        if isinstance(v, tuple):
            dt, arr = v
            arr = np.asarray(arr)
            shape = arr.shape[:-1] + (arr.shape[-1] * 2,) if dt == "F4" else arr.shape
        else:
            arr = np.asarray(v)
            dt, shape = dtype_name(arr.dtype), arr.shape
        items.append((TensorSpec(name, dt, shape), arr))
    with SafetensorsWriter(path, [s for s, _ in items], metadata) as w:
        for s, arr in items:
            w.write(s.name, arr)


def write_index(out_dir: str | os.PathLike, weight_map: Mapping[str, str], total_size: int,
                metadata: Mapping[str, str] | None = None) -> Path:
    path = Path(out_dir) / INDEX_NAME
    body = {"metadata": {"total_size": int(total_size), **(metadata or {})}, "weight_map": dict(weight_map)}
    with naming_file(path):
        path.write_text(json.dumps(body, indent=2) + "\n")
    return path
