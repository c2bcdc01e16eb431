"""One writer, N readers over shared memory: how rank 0 hands each step's call to its workers.

Layout of a segment: a header ``(sequence number, kind, payload bytes)`` then a pickled payload.
The writer sets one ``multiprocessing.Event`` per reader after writing; a reader waits on its
event, reads, then clears it, and the writer writes the next message only once every event is
clear. So a message is never overwritten unread, however far ahead rank 0 runs.

Segments get a random 96-bit name (``hfp_<24 hex>``) and mode 0600, so two engines on one host
never collide and other users cannot read or guess them. A message larger than the segment goes
into a new segment twice as large (or larger): the old segment carries a RESIZE note naming the
new one, and is unlinked once every reader has read past it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import secrets
import struct
import time
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import Any

_HEADER = struct.Struct("<QQQ")  # sequence number, kind, payload bytes
_MSG, _RESIZE = 0, 1  # kinds: a pickled message / "read on in segment <pickled name>"


@dataclass(frozen=True)
class ShmReaderHandle:
    """What a worker needs to attach (picklable through ``Process`` args)."""

    name: str  # the segment current when the handle was made
    event: Any  # this reader's multiprocessing.Event: set = "a message is waiting"


class ShmBroadcaster:
    """Rank 0's writer: one message at a time to ``num_readers`` readers (protocol above).

    Args:
        num_readers: one event each; hand ``reader_handle(i)`` to reader ``i``.
        capacity: initial payload bytes (the segment grows on demand, never truncates).
        mp_context: the multiprocessing context the readers are started with (spawn).

    Not thread-safe: one writer thread.
    """

    def __init__(self, num_readers: int, capacity: int = 1 << 20, mp_context=None):
        ctx = mp_context or mp.get_context("spawn")
        self.events = [ctx.Event() for _ in range(num_readers)]
        self._shm = _create_segment(_HEADER.size + capacity)
        self._retired: list[SharedMemory] = []  # replaced by a resize, not yet unlinked
        self._seq = 0
        self._closed = False

    @property
    def name(self) -> str:
        return self._shm.name

    def reader_handle(self, index: int) -> ShmReaderHandle:
        return ShmReaderHandle(self._shm.name, self.events[index])

    def broadcast(self, obj: Any, check=None, timeout: float | None = None) -> None:
        """Pickle ``obj`` into shared memory and wake every reader.

        Args:
            obj: any picklable object.
            check: called while waiting for a slow reader; raise from it to give up.
            timeout: seconds to wait for readers to take the previous message.

        Raises:
            TimeoutError: a reader did not take the previous message within ``timeout``.
            RuntimeError: the broadcaster is closed.
        """
        if self._closed:
            raise RuntimeError("ShmBroadcaster is closed")
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self._wait_until_read(check, timeout)
        seq = self._seq + 1
        if _HEADER.size + len(data) > self._shm.size:
            size = max(2 * self._shm.size, _HEADER.size + len(data))
            new = _create_segment(size)
            _write(new, seq, _MSG, data)
            _write(self._shm, seq, _RESIZE, pickle.dumps(new.name))
            self._retired.append(self._shm)
            self._shm = new
        else:
            _write(self._shm, seq, _MSG, data)
        self._seq = seq
        for event in self.events:
            event.set()

    def close(self) -> None:
        """Unlink every segment (idempotent); readers keep their mappings until they close."""
        self._closed = True
        for shm in [*self._retired, self._shm]:
            _unlink(shm)
        self._retired.clear()
        self.events = []  # their named semaphores (/dev/shm/sem.mp-*) go when collected

    def _wait_until_read(self, check, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0
        while any(event.is_set() for event in self.events):
            if check is not None:
                check()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("a worker did not read the previous message")
            time.sleep(delay)
            delay = min(max(2 * delay, 1e-5), 1e-3)
        for shm in self._retired:  # every reader has read past the RESIZE note
            _unlink(shm)
        self._retired.clear()


class ShmReader:
    """A worker's reader; the writer must be this process's parent.

    ``read`` blocks for the next message, waking every ``poll_s`` to check the parent is alive.
    It raises EOFError once the parent died, RuntimeError on an out-of-sequence message.
    """

    def __init__(self, handle: ShmReaderHandle, poll_s: float = 0.5):
        self._shm = SharedMemory(name=handle.name)
        self.event = handle.event
        self.poll_s = poll_s
        self._seq = 0
        self._parent = os.getppid()

    def read(self) -> Any:
        while not self.event.wait(self.poll_s):
            if os.getppid() != self._parent:
                raise EOFError("the writer process died")
        seq, kind, size = _HEADER.unpack_from(self._shm.buf)
        if kind == _RESIZE:
            name = pickle.loads(self._shm.buf[_HEADER.size : _HEADER.size + size])
            self._shm.close()
            self._shm = SharedMemory(name=name)
            seq, kind, size = _HEADER.unpack_from(self._shm.buf)
        if seq != self._seq + 1 or kind != _MSG:
            raise RuntimeError(f"shm message {seq} (kind {kind}) after {self._seq}: protocol error")
        obj = pickle.loads(self._shm.buf[_HEADER.size : _HEADER.size + size])
        self._seq = seq
        self.event.clear()  # only now may the writer overwrite the segment
        return obj

    def close(self) -> None:
        self._shm.close()


def _create_segment(size: int) -> SharedMemory:
    shm = SharedMemory(name=f"hfp_{secrets.token_hex(12)}", create=True, size=size)
    fd = getattr(shm, "_fd", -1)  # created 0600 by CPython already; make sure, whatever umask
    if fd >= 0:
        os.fchmod(fd, 0o600)
    return shm


def _write(shm: SharedMemory, seq: int, kind: int, data: bytes) -> None:
    shm.buf[_HEADER.size : _HEADER.size + len(data)] = data
    _HEADER.pack_into(shm.buf, 0, seq, kind, len(data))  # header last


def _unlink(shm: SharedMemory) -> None:
    with contextlib.suppress(BufferError):
        shm.close()
    with contextlib.suppress(FileNotFoundError):
        shm.unlink()
