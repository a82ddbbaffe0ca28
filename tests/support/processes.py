"""Waiting on processes the test does not own, without sleeping: pidfd readiness."""

from __future__ import annotations

import os
import select


def wait_gone(pid: int, timeout: float) -> bool:
    """True once `pid` has exited (or never existed), False if still alive after `timeout`."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], timeout)
        return bool(readable) or is_zombie(pid)
    finally:
        os.close(fd)


def is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def is_alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}") and not is_zombie(pid)
