"""Which host a process is on, and whether a local process is still alive: what the liveness
checks of the workspaces, the quantized collectives and the TP communicator share."""

from __future__ import annotations

import socket

__all__ = ["boot_id", "host_id", "pid_alive"]


def boot_id() -> str:
    """This machine's boot id ("" where the kernel does not expose one)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def host_id() -> str:
    """Hostname and boot id: two processes with the same value share memory and pids."""
    return f"{socket.gethostname()}/{boot_id()}"


def pid_alive(pid: int) -> bool:
    """Whether local process ``pid`` is running (a zombie counts as dead)."""
    # os.kill(pid, 0) succeeds for zombies, so read the state from /proc instead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
