"""One writer, N readers over shared memory: how rank 0 hands each step's call to its workers.

Layout of a segment: a header ``(sequence number, kind, payload bytes)`` then a pickled payload.
Each reader has a socketpair with the writer (a duplex ``multiprocessing.Pipe``). After writing a
message the writer sends each reader a one-byte "go"; a reader waits for it, reads the segment,
then sends a one-byte "taken", and the writer writes the next message only once every reader sent
"taken". So a message is never overwritten unread, however far ahead rank 0 runs.

Why sockets and not ``multiprocessing.Event``: an Event's ``set()`` waits, without a timeout, for
every sleeper to wake, so a reader killed inside ``wait()`` blocks the writer forever. Here no
operation can block on a dead peer: at most one byte is in flight each way (a send never waits
for buffer space), every wait is a ``poll`` with a timeout, and a dead peer's closed socket shows
as EOF / a broken pipe at once. Nothing is left in /dev/shm but the segments, unlinked by close.

Segments get a random 96-bit name (``hfp_<24 hex>``) and mode 0600, so two engines on one host
never collide and other users cannot read or guess them. A message larger than the segment goes
into a new segment twice as large (or larger): the old segment carries a RESIZE note naming the
new one, and is unlinked once every reader has read past it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection as mp_connection
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
_GO, _TAKEN = b"g", b"t"  # writer -> reader: a message is waiting; reader -> writer: taken
_CHECK_S = 0.05  # how often a waiting writer calls its ``check``


@dataclass(frozen=True)
class ShmReaderHandle:
    """What a worker needs to attach (picklable through ``Process`` args)."""

    name: str  # the segment current when the handle was made
    conn: Any  # the reader's end of its socketpair with the writer ("go" in, "taken" out)


class ShmBroadcaster:
    """Rank 0's writer: one message at a time to ``num_readers`` readers (protocol above).

    Args:
        num_readers: one socketpair each; hand ``reader_handle(i)`` to reader ``i``, then call
            ``release_reader_end(i)`` once the reader process holds its copy.
        capacity: initial payload bytes (the segment grows on demand, never truncates).
        mp_context: the multiprocessing context the readers are started with (spawn).

    Not thread-safe: one writer thread.
    """

    def __init__(self, num_readers: int, capacity: int = 1 << 20, mp_context=None):
        ctx = mp_context or mp.get_context("spawn")
        pairs = [ctx.Pipe(duplex=True) for _ in range(num_readers)]
        self._conns = [mine for mine, _ in pairs]
        self._reader_ends = [theirs for _, theirs in pairs]
        self._unacked: set[int] = set()  # readers that have not taken the last message
        self._shm = _create_segment(_HEADER.size + capacity)
        self._retired: list[SharedMemory] = []  # replaced by a resize, not yet unlinked
        self._seq = 0
        self._closed = False

    @property
    def name(self) -> str:
        return self._shm.name

    def reader_handle(self, index: int) -> ShmReaderHandle:
        return ShmReaderHandle(self._shm.name, self._reader_ends[index])

    def release_reader_end(self, index: int) -> None:
        """Close this process's copy of reader ``index``'s socket (after the reader started), so
        that the reader's death shows here as EOF."""
        end = self._reader_ends[index]
        if end is not None:
            end.close()
            self._reader_ends[index] = None

    def broadcast(self, obj: Any, check=None, timeout: float | None = None) -> None:
        """Pickle ``obj`` into shared memory and wake every reader.

        Args:
            obj: any picklable object.
            check: called about every 50 ms while waiting for a slow reader; raise to give up.
            timeout: seconds to wait for readers to take the previous message.

        Raises:
            TimeoutError: a reader did not take the previous message within ``timeout``.
            ConnectionError: a reader is gone (its socket closed).
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
        for index, conn in enumerate(self._conns):
            try:
                conn.send_bytes(_GO)  # one byte in flight at most: never waits for space
            except OSError as exc:
                raise ConnectionError(f"shm reader {index} is gone ({exc})") from exc
            self._unacked.add(index)

    def close(self) -> None:
        """Unlink every segment and close the sockets (idempotent); readers then see EOF."""
        self._closed = True
        for shm in [*self._retired, self._shm]:
            _unlink(shm)
        self._retired.clear()
        for conn in [*self._conns, *self._reader_ends]:
            if conn is not None:
                conn.close()
        self._conns, self._reader_ends = [], []

    def _wait_until_read(self, check, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._unacked:
            waiting = {self._conns[i]: i for i in self._unacked}
            left = _CHECK_S if deadline is None else min(_CHECK_S, deadline - time.monotonic())
            for conn in mp_connection.wait(list(waiting), timeout=max(0.0, left)):
                index = waiting[conn]
                try:
                    conn.recv_bytes()
                except (EOFError, OSError) as exc:
                    raise ConnectionError(f"shm reader {index} is gone") from exc
                self._unacked.discard(index)
            if not self._unacked:
                break
            if check is not None:
                check()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("a worker did not read the previous message")
        for shm in self._retired:  # every reader has read past the RESIZE note
            _unlink(shm)
        self._retired.clear()


class ShmReader:
    """A worker's reader of the writer in process ``parent_pid`` (default: this one's parent).

    ``read`` blocks for the next message, waking every ``poll_s`` to check the writer is alive.
    It raises EOFError once the writer died or closed, RuntimeError on an out-of-sequence message.
    """

    def __init__(self, handle: ShmReaderHandle, poll_s: float = 0.5, parent_pid: int | None = None):
        self._shm = SharedMemory(name=handle.name)
        self.conn = handle.conn
        self.poll_s = poll_s
        self._seq = 0
        self._parent = os.getppid() if parent_pid is None else parent_pid

    def read(self) -> Any:
        try:
            while not self.conn.poll(self.poll_s):
                if os.getppid() != self._parent:
                    raise EOFError("the writer process died")
            self.conn.recv_bytes()  # "go"; EOFError when the writer's socket closed
        except OSError as exc:
            raise EOFError(f"the writer is gone ({exc})") from exc
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
        try:
            self.conn.send_bytes(_TAKEN)  # only now may the writer overwrite the segment
        except OSError as exc:
            raise EOFError(f"the writer is gone ({exc})") from exc
        return obj

    def close(self) -> None:
        self._shm.close()
        self.conn.close()


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
