"""The TCP sockets a process listens on, as a stranger scanning the host would find them.

listeners(pid) -> {(address, port), ...}      # from /proc/net/tcp{,6} and /proc/<pid>/fd
WILDCARD                                      # the addresses meaning "every interface"
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

WILDCARD = {"0.0.0.0", "::"}


def _addr(hex_addr: str, v6: bool) -> str:
    raw = bytes.fromhex(hex_addr)
    if v6:  # four little-endian 32-bit words
        raw = b"".join(struct.pack("<I", w) for w in struct.unpack(">4I", raw))
        return str(ipaddress.IPv6Address(raw))
    return socket.inet_ntoa(struct.pack("<I", int(hex_addr, 16)))


def listeners(pid: int | None = None) -> set[tuple[str, int]]:
    pid = pid or os.getpid()
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table, v6 in (("tcp", False), ("tcp6", True)):
        try:
            lines = open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                host, port = f[1].split(":")
                out.add((_addr(host, v6), int(port, 16)))
    return out
