"""The safetensors reader and writer (dspark_jax.checkpoint.safetensors_io): every dtype, the safetensors
package as an independent check, sharded indexes, and corrupt files that give clear errors."""

from __future__ import annotations

import errno
import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers.checkpoint import st_write

from dspark_jax.checkpoint.safetensors_io import (
    CheckpointError, SafetensorsWriter, TensorSpec, open_checkpoint, save_file,
)

# ---------------------------------------------------------------------------------------------
# safetensors reader / writer
# ---------------------------------------------------------------------------------------------
def test_writer_reader_all_dtypes_and_safetensors_package(tmp_path):
    rng = np.random.default_rng(4)
    tensors = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32), "f16": rng.standard_normal((4,)).astype(np.float16),
        "f64": rng.standard_normal((2, 2)), "i8": rng.integers(-128, 127, (7,), dtype=np.int8),
        "u8": rng.integers(0, 255, (2, 3), dtype=np.uint8), "i32": rng.integers(-9, 9, (5,), dtype=np.int32),
        "i64": rng.integers(-9, 9, (1, 3), dtype=np.int64), "bool": rng.random((4,)) < 0.5,
        "bf16": rng.standard_normal((6, 2)).astype(ml_dtypes.bfloat16),
        "e4m3": rng.standard_normal((32, 32)).astype(ml_dtypes.float8_e4m3fn),
        "e8m0": np.arange(120, 130, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu),
        "empty": np.zeros((0, 4), np.float32),
    }
    packed = rng.integers(0, 256, (3, 4), dtype=np.uint8)
    save_file(tmp_path / "t.safetensors", {**tensors, "fp4": ("F4", packed)}, metadata={"k": "v"})
    r = open_checkpoint(tmp_path / "t.safetensors")
    assert r.files[0].metadata == {"k": "v"}
    for k, v in tensors.items():
        got = r.read(k)
        assert got.dtype == v.dtype and got.shape == v.shape
        assert np.array_equal(got.view(np.uint8), np.ascontiguousarray(v).view(np.uint8))
    assert r.info("fp4").shape == (3, 8) and np.array_equal(r.read("fp4"), packed)

    from safetensors import safe_open  # independent check of the file format

    with safe_open(tmp_path / "t.safetensors", framework="numpy") as f:
        assert f.metadata() == {"k": "v"}
        for k in ("f32", "f16", "f64", "i8", "u8", "i32", "i64", "bool"):
            assert np.array_equal(f.get_tensor(k), tensors[k])
        expect = {"bf16": ("BF16", [6, 2]), "e4m3": ("F8_E4M3", [32, 32]), "e8m0": ("F8_E8M0", [10]),
                  "fp4": ("F4", [3, 8])}
        for k, (dt, shape) in expect.items():
            sl = f.get_slice(k)
            assert (sl.get_dtype(), sl.get_shape()) == (dt, shape)
    # and our reader agrees with a file written by the safetensors package
    from safetensors.numpy import save_file as st_save

    st_save({"a": tensors["f32"], "b": tensors["i64"]}, str(tmp_path / "ref.safetensors"))
    r2 = open_checkpoint(tmp_path / "ref.safetensors")
    assert np.array_equal(r2.read("a"), tensors["f32"]) and np.array_equal(r2.read("b"), tensors["i64"])


def test_writer_rejects_wrong_writes(tmp_path):
    specs = [TensorSpec("a", "F32", (2, 3)), TensorSpec("b", "F8_E4M3", (4,))]
    w = SafetensorsWriter(tmp_path / "w.safetensors", specs)
    with pytest.raises(CheckpointError, match="tensor 'a': got float64"):
        w.write("a", np.zeros((2, 3)))
    with pytest.raises(CheckpointError, match="'c' was not declared"):
        w.write("c", np.zeros(1, np.float32))
    w.write("a", np.zeros((2, 3), np.float32))
    with pytest.raises(CheckpointError, match="never written, e.g. 'b'"):
        w.close()
    assert not list(tmp_path.iterdir())  # no partial file left behind
    with pytest.raises(CheckpointError, match="unknown dtype 'F7'"):
        TensorSpec("x", "F7", (1,))


@pytest.mark.parametrize("at", ["header", "write", "close"])
def test_a_full_disk_names_the_file_and_leaves_no_partial(tmp_path, full_disk, at):
    """ENOSPC names no file: the writer names the one it writes (by its final name) and removes its
    `.partial`, whether the disk fills on the header, on a tensor, or only when close() flushes the buffer
    (after every write() returned: `with` then calls close, not abort)."""
    tensors = {"a": np.ones((64, 64), np.float32), "b": np.ones((64,), np.float32)}
    (tmp_path / "old.safetensors").write_bytes(b"kept")
    full_disk({"header": 10, "write": 1000}.get(at, 100), at="close" if at == "close" else "write")
    with pytest.raises(OSError) as err:
        save_file(tmp_path / "w.safetensors", tensors)
    assert (err.value.errno, err.value.filename) == (errno.ENOSPC, str(tmp_path / "w.safetensors"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.safetensors"]


def _good_file(path: Path):
    st_write(path, [("w", "F32", (4, 4), np.arange(16, dtype=np.float32).tobytes()),
                    ("v", "BF16", (3,), bytes(6))])


@pytest.mark.parametrize("corrupt,pattern", [
    ("short", r"short\.safetensors: truncated file \(5 bytes\)"),
    ("truncated", r"truncated\.safetensors: tensor '(w|v)': truncated file or offsets out of range"),
    ("header_len", r"header_len\.safetensors: truncated file: header says"),
    ("json", r"json\.safetensors: bad header: not valid JSON"),
    ("huge", r"huge\.safetensors: bad header: header length"),
    ("dtype", r"dtype\.safetensors: tensor 'w': unknown dtype 'F7'"),
    ("span", r"span\.safetensors: tensor 'w': byte span 64 != 32 for dtype F16 shape \[4, 4\]"),
    ("overlap", r"overlap\.safetensors: bad header: tensors '(w|v)' and '(w|v)' overlap"),
    ("range", r"range\.safetensors: tensor 'v': truncated file or offsets out of range"),
    ("negative", r"negative\.safetensors: tensor 'w': bad data_offsets \[8, 4\]"),
    ("dup", r"dup\.safetensors: bad header: not valid JSON \(duplicate key 'w'\)"),
    ("shape", r"shape\.safetensors: tensor 'w': bad shape \[4, -4\]"),
])
def test_corrupt_files_give_clear_errors(tmp_path, corrupt, pattern):
    path = tmp_path / f"{corrupt}.safetensors"
    _good_file(path)
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + hlen])
    data = raw[8 + hlen:]

    def rewrite(h, d=data):
        blob = json.dumps(h).encode()
        path.write_bytes(struct.pack("<Q", len(blob)) + blob + d)

    if corrupt == "short":
        path.write_bytes(raw[:5])
    elif corrupt == "truncated":
        path.write_bytes(raw[:-10])
    elif corrupt == "header_len":
        path.write_bytes(raw[:8 + hlen // 2])
    elif corrupt == "json":
        path.write_bytes(raw[:8] + b"{not json" + raw[17:])
    elif corrupt == "huge":
        path.write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])
    elif corrupt == "dtype":
        header["w"]["dtype"] = "F7"
        rewrite(header)
    elif corrupt == "span":
        header["w"]["dtype"] = "F16"
        rewrite(header)
    elif corrupt == "overlap":
        header["v"]["data_offsets"] = [60, 66]
        rewrite(header)
    elif corrupt == "range":
        header["v"]["data_offsets"] = [64, 70]
        rewrite(header, data[:-6])
    elif corrupt == "negative":
        header["w"]["data_offsets"] = [8, 4]
        rewrite(header)
    elif corrupt == "dup":
        blob = json.dumps(header).encode()[:-1] + b', "w": ' + json.dumps(header["w"]).encode() + b"}"
        path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    elif corrupt == "shape":
        header["w"]["shape"] = [4, -4]
        rewrite(header)
    with pytest.raises(CheckpointError, match=pattern):
        open_checkpoint(path)


def test_index_errors(tmp_path):
    _good_file(tmp_path / "a.safetensors")
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text(json.dumps({"weight_map": {"w": "a.safetensors", "x": "missing.safetensors"}}))
    with pytest.raises(CheckpointError, match="tensor 'x' is mapped to missing.safetensors, which does not exist"):
        open_checkpoint(tmp_path)
    idx.write_text(json.dumps({"weight_map": {"w": "a.safetensors", "x": "a.safetensors"}}))
    with pytest.raises(CheckpointError, match="tensor 'x' is mapped to a.safetensors, which does not contain it"):
        open_checkpoint(tmp_path)
    idx.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="weight_map"):
        open_checkpoint(idx)
    idx.unlink()
    _good_file(tmp_path / "b.safetensors")  # same names in two un-indexed shards
    with pytest.raises(CheckpointError, match="tensor '(w|v)' appears in both"):
        open_checkpoint(tmp_path)
