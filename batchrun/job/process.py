"""Who a process is, as a lock record or a part file's writer names it: a pid is only meaningful
within one process space (hostname, boot id, pid namespace), and only together with its start time
(a reused pid runs another process)."""
from __future__ import annotations

import os
import socket
from typing import Optional


def _read_first_line(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return None


def process_space() -> str:
    """Where a pid names the same process: hostname, boot id and pid namespace."""
    parts = [socket.gethostname(), _read_first_line("/proc/sys/kernel/random/boot_id") or ""]
    try:
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        parts.append("")
    return "|".join(parts)


def pid_start(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    line = _read_first_line(f"/proc/{pid}/stat")
    if not line or ")" not in line:
        return None
    fields = line.rsplit(")", 1)[1].split()
    return fields[19] if len(fields) > 19 else None     # field 22 of proc(5), counted after "(comm)"


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this machine (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # alive, another user's
        return True
    return True
