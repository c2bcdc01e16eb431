"""One engine's tensor-parallel process group, built without the process-global default group.

Each engine gets its own ``TCPStore`` (rank 0 serves it on 127.0.0.1 at a free port, through a
socket it binds itself: ``TCPStore`` alone listens on every interface) and its own
backend object (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on CUDA), so two engines in one
process never share a group, a port or a store. Collectives are called on the returned object's
own methods (``pg.allreduce([t]).wait()``), which ``Communicator`` wraps; nothing is registered in
``torch.distributed``'s global tables.

Gloo and dead peers (torch 2.13, measured on CPU): when a peer that rank 0's pending collective
talks to dies, its sockets close and the call raises ``RuntimeError: Connection closed by peer``
within ~50 ms. It does not raise when the dead rank is not one rank 0 is waiting on at that moment
(3 ranks, rank 2 killed while rank 1 is alive but busy: rank 0 waited the full 60 s timeout), and
``pg.abort()`` / ``pg.shutdown()`` from another thread do NOT end a pending gloo wait. So the
worker watchdog in ``engine/worker/tp/workers.py`` kills the surviving workers once one dies: their sockets
close too and the blocked call raises (0.05 s in the same 3-rank case). NCCL is aborted instead
(``abort_process_group``; untested here, no GPU).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

_STORE_PREFIX = "hf_paged_tp"
_ARRIVAL_POLL_S = 0.05


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, close).

    Another process may take it before rank 0 binds it; ``reserve_port`` avoids that window.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A listening socket on a free port, to hand to rank 0's ``create_process_group``.

    Race-free alternative to ``find_free_port``: the port stays bound until the store takes the
    socket over (``TCPStore(master_listen_fd=...)``). Read the port with ``sock.getsockname()[1]``.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(128)
    return sock


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host.strip("[]"), port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def create_process_group(
    rank: int,
    world_size: int,
    init_address: str,
    device_type: str,
    timeout: timedelta = timedelta(minutes=10),
    abort_check: Callable[[], None] | None = None,
    listen_socket: socket.socket | None = None,
):
    """Build this rank's process group for one engine.

    Args:
        rank: this rank, 0..world_size-1. Rank 0 serves the store.
        world_size: number of ranks.
        init_address: ``"host:port"`` of rank 0's store, the same on every rank.
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (nccl; set the CUDA device first).
        timeout: store and collective timeout (a peer alive but absent is noticed only then).
        abort_check: rank 0 only; called while waiting for the other ranks to reach the store
            and expected to raise when they never will (e.g. ``WorkerGroup.check``).
        listen_socket: rank 0 only; a socket from ``reserve_port`` bound to ``init_address``'s
            port, handed to the store so the port never has to be re-bound. Without it rank 0
            binds ``init_address`` itself, so the store listens on that address only.

    Returns:
        A backend object (``ProcessGroupGloo`` / ``ProcessGroupNCCL``) with ``allreduce``,
        ``allgather``, ``gather``, ``broadcast`` methods; pass it to ``Communicator``.

    Raises:
        ValueError: bad rank, world size, address or device type.
        Whatever ``abort_check`` raises; TimeoutError / DistStoreError on store timeout.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type={device_type!r}: expected 'cpu' or 'cuda'")
    host, sep, port_text = init_address.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"init_address={init_address!r}: expected 'host:port'")
    port = int(port_text)
    is_server = rank == 0
    extra = {}
    if is_server and listen_socket is None:
        # Bind it ourselves: TCPStore given a host still listens on every interface (::).
        listen_socket = _listen(host, port)
    if is_server:
        extra["master_listen_fd"] = listen_socket.fileno()
    store = dist.TCPStore(
        host, port, world_size, is_server, timeout=timeout, wait_for_workers=False, **extra
    )
    if is_server:
        listen_socket.detach()  # the store now owns (and later closes) the fd; it does not dup it
    store = dist.PrefixStore(_STORE_PREFIX, store)
    store.set(f"arrived/{rank}", "1")
    if is_server:
        _wait_for_ranks(store, world_size, timeout, abort_check)
    if device_type == "cpu":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [_gloo_device(host)]
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, opts)


def destroy_process_group(pg) -> None:
    """Release a group from ``create_process_group`` (no collective; safe if peers are gone)."""
    if pg is None:
        return
    if hasattr(pg, "shutdown"):
        pg.shutdown()


def abort_process_group(pg) -> None:
    """Make pending collectives on ``pg`` fail now (NCCL); a no-op for backends without abort.

    Called from the worker watchdog when a peer died. Gloo's abort does not end a pending wait
    (see the module docstring), so it is skipped there.
    """
    if pg is None or _backend_name(pg) == "gloo":
        return
    if hasattr(pg, "abort"):
        pg.abort()
    elif hasattr(dist.distributed_c10d, "_abort_process_group"):
        dist.distributed_c10d._abort_process_group(pg)


def group_device(pg) -> torch.device:
    """Where scratch tensors for collectives on ``pg`` must live."""
    if _backend_name(pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _backend_name(pg) -> str:
    try:
        return pg.name().lower()
    except (AttributeError, RuntimeError):
        return ""


def _gloo_device(host: str):
    if host in ("127.0.0.1", "localhost"):
        # Loopback explicitly: the default device resolves the hostname, which fails in some
        # containers, and every rank is on this host anyway.
        return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return dist.ProcessGroupGloo.create_default_device()


def _wait_for_ranks(store, world_size: int, timeout: timedelta, abort_check) -> None:
    # Poll (store.check returns at once) so that a worker that died before reaching the store ends
    # rank 0's wait through abort_check instead of after the full store timeout.
    keys = [f"arrived/{r}" for r in range(1, world_size)]
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(keys):
        if abort_check is not None:
            abort_check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks 1..{world_size - 1} did not reach the store in {timeout}")
        time.sleep(_ARRIVAL_POLL_S)
