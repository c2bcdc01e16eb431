"""How rank 0 learns that a worker is stuck, orphaned or failed before it could say why.

- ``Heartbeats``: one shared-memory counter per worker. A thread in each worker bumps its counter
  every ``interval`` seconds; rank 0's watchdog calls ``stale()`` and kills a worker whose counter
  has not moved for ``timeout`` seconds (a SIGSTOPped or wedged process: no thread of it runs).
  Counters, not timestamps, so the two processes' clocks never need to agree.
- ``StderrTail``: a worker's stderr goes through a pipe that rank 0 copies to its own stderr and
  keeps the last few KiB of. A worker that dies before it can report (an error while spawn
  imports the main module, a crash in native code) still gives rank 0 its last words.
- ``set_parent_death_signal``: Linux ``PR_SET_PDEATHSIG``, so the kernel kills a worker whose
  parent died.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import struct
import threading
import time
from multiprocessing.shared_memory import SharedMemory

_SLOT = struct.Struct("<Q")
_TAIL_BYTES = 8192
_stderr_lock = threading.Lock()  # the stderr swap in ``StderrTail.start_child`` vs forwarding


class Heartbeats:
    """Rank 0's side: ``num_workers`` counters in a 0600 segment named ``hfp_hb_<24 hex>``.

    Args:
        num_workers: one counter each (worker i beats slot i).
        timeout: seconds without a beat after which ``stale`` names the worker; None = never.
    """

    def __init__(self, num_workers: int, timeout: float | None):
        name = f"hfp_hb_{secrets.token_hex(12)}"
        self._shm = SharedMemory(name=name, create=True, size=_SLOT.size * max(1, num_workers))
        if getattr(self._shm, "_fd", -1) >= 0:
            os.fchmod(self._shm._fd, 0o600)
        self.name = name
        self.timeout = timeout
        self._seen = [(0, time.monotonic())] * num_workers  # (count, when it last changed)

    def stale(self) -> list[tuple[int, float]]:
        """``(worker index, seconds since its last beat)`` for each worker past ``timeout``.

        A worker that has not beaten yet (still importing) is not counted.
        """
        if self.timeout is None or self._shm is None:
            return []
        now, out = time.monotonic(), []
        for i, (count, since) in enumerate(self._seen):
            (new,) = _SLOT.unpack_from(self._shm.buf, i * _SLOT.size)
            if new != count:
                self._seen[i] = (new, now)
            elif count > 0 and now - since > self.timeout:
                out.append((i, now - since))
        return out

    def close(self) -> None:
        if self._shm is None:
            return
        with contextlib.suppress(BufferError):
            self._shm.close()
        with contextlib.suppress(FileNotFoundError):
            self._shm.unlink()
        self._shm = None


def start_beating(name: str, index: int, interval: float) -> None:
    """Worker side: a daemon thread that bumps slot ``index`` of segment ``name`` forever."""
    shm = SharedMemory(name=name)

    def beat() -> None:
        count = 0
        while True:
            count += 1
            _SLOT.pack_into(shm.buf, index * _SLOT.size, count)
            time.sleep(interval)

    threading.Thread(target=beat, name="hf_paged-heartbeat", daemon=True).start()


class StderrTail:
    """Copies one child's stderr to ours and keeps its last ``_TAIL_BYTES``.

    Call ``start_child(proc.start)``: the child inherits a pipe as its fd 2 (swapped in only for
    the ``start`` call); a daemon thread forwards what arrives.
    """

    def __init__(self):
        self._chunks = bytearray()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start_child(self, start) -> None:
        read_fd, write_fd = os.pipe()
        with _stderr_lock:
            saved = os.dup(2)
            try:
                os.dup2(write_fd, 2)
                start()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                os.close(write_fd)
        self._thread = threading.Thread(
            target=self._forward, args=(read_fd,), name="hf_paged-stderr", daemon=True
        )
        self._thread.start()

    def text(self, wait: float = 0.0) -> str:
        """The tail so far; ``wait`` seconds for the child's last output to arrive."""
        if wait and self._thread is not None:
            self._thread.join(wait)
        with self._lock:
            return self._chunks.decode("utf-8", "replace").strip()

    def _forward(self, fd: int) -> None:
        try:
            while data := os.read(fd, 65536):
                with _stderr_lock, contextlib.suppress(OSError):
                    os.write(2, data)
                with self._lock:
                    self._chunks += data
                    del self._chunks[:-_TAIL_BYTES]
        except OSError:
            pass
        finally:
            os.close(fd)


def set_parent_death_signal() -> None:
    """Have the kernel SIGKILL this process when the thread that spawned it exits (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)


class EngineDeadError(RuntimeError):
    """A tensor-parallel worker died or raised; the engine cannot continue.

    Attributes:
        rank: the worker that failed first.
        worker_traceback: the worker's formatted traceback, or None (e.g. killed by a signal).
    """

    def __init__(self, rank: int, worker_traceback: str | None = None, detail: str = "died"):
        self.rank = rank
        self.worker_traceback = worker_traceback
        self.detail = detail
        message = f"tensor-parallel worker rank {rank} {detail}"
        last = known_cause(worker_traceback) or _last_line(worker_traceback)
        if last:  # the worker's own error first: a one-line report shows it
            message = f"tensor-parallel worker rank {rank} {detail}: {last}"
        if worker_traceback:
            message += f"\n\nTraceback from worker rank {rank}:\n{worker_traceback}"
        super().__init__(message)

    def __reduce__(self):
        return type(self), (self.rank, self.worker_traceback, self.detail)


# what multiprocessing's spawn says when the main module starts processes again as the worker
# imports it; its last line is only a link to Python's docs
_NO_MAIN_GUARD = ("_check_not_importing_main", "finished its bootstrapping phase")


def known_cause(text: str | None) -> str | None:
    """A worker failure whose traceback's last line does not say what to do, told in one line
    with the fix; None for any other."""
    if text and any(marker in text for marker in _NO_MAIN_GUARD):
        return (
            'the script has no `if __name__ == "__main__":` guard: a spawned worker imports '
            "the main module, which started the engine again. Fix: put the code that builds "
            'the LLM (and everything after it) under `if __name__ == "__main__":`'
        )
    return None


def _last_line(text: str | None) -> str | None:
    """The last non-empty line of a traceback (``ValueError: ...``), or None."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines and not lines[-1].startswith("(no report") else None
