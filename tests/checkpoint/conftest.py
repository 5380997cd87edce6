"""A full disk for the checkpoint writers' tests: `full_disk(room)` leaves `room` bytes for what
SafetensorsWriter writes (it opens its files through safetensors_io's `open`)."""

from __future__ import annotations

import builtins
import errno
import os

import pytest

from dspark_jax.checkpoint import safetensors_io


class _Disk:
    """`room` bytes shared by every file opened for writing. As on a real disk the failure names no file:
    at="write" fails the write() that does not fit; at="close" accepts it (it sits in the buffer) and fails
    the close() that flushes it, after every write() returned."""

    def __init__(self, room: int, at: str):
        self.room, self.at, self.full = room, at, False

    def open(self, file, mode="r", *args, **kwargs):
        f = builtins.open(file, mode, *args, **kwargs)
        return _File(f, self) if "w" in mode else f


class _File:
    def __init__(self, f, disk: _Disk):
        self._f, self._disk = f, disk

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if n > self._disk.room:
            self._disk.full = True
            if self._disk.at == "write":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._disk.room = max(0, self._disk.room - n)
        return self._f.write(data)

    def close(self) -> None:
        self._f.close()
        if self._disk.full and self._disk.at == "close":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):  # seek, truncate, closed, ...
        return getattr(self._f, name)


@pytest.fixture
def full_disk(monkeypatch):
    def fill(room: int, at: str = "write") -> _Disk:
        disk = _Disk(room, at)
        monkeypatch.setattr(safetensors_io, "open", disk.open, raising=False)
        return disk

    return fill
