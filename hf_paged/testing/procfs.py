"""What a process holds, read from /proc (Linux): listening TCP sockets, /dev/shm files, fds,
whether it still runs; and the engine's shared-memory segments. The leak checks of the
tensor-parallel and reliability tests read these."""

from __future__ import annotations

import os
import socket
import struct


def fd_targets(pid: int) -> list[str]:
    """``readlink`` of each open descriptor of ``pid`` (``socket:[inode]``, paths, pipes)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed meanwhile
            pass
    return out


def listening_sockets(pid: int) -> list[str]:
    """``"address:port"`` of every TCP socket of ``pid`` in LISTEN state (IPv4 and IPv6)."""
    inodes = {t[8:-1] for t in fd_targets(pid) if t.startswith("socket:[")}
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = open(f"/proc/net/{table}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A = TCP_LISTEN
                found.append(_address(fields[1], family))
    return found


def shm_files(pid: int) -> set[str]:
    """Existing paths under /dev/shm that ``pid`` has open or mapped (shm, named semaphores)."""
    paths = {t for t in fd_targets(pid) if t.startswith("/dev/shm/")}
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                if not fields[5].rstrip().endswith("(deleted)"):  # unlinked: no name left
                    paths.add(fields[5].strip())
    return paths


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:  # gone, or going while it is read
        return False


def shm_segments() -> set[str]:
    """The names of the engines' shared-memory segments (``hfp_*``) now in /dev/shm."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("hfp_")}


def _address(hex_addr: str, family: int) -> str:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if family == socket.AF_INET6:  # four little-endian 32-bit words
        raw = b"".join(struct.pack("<I", w) for w in struct.unpack(">4I", raw))
    else:
        raw = raw[::-1]
    return f"{socket.inet_ntop(family, raw)}:{int(port, 16)}"
