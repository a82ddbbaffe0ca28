"""Where the per-user engine-manager lives: the rendezvous both sides compute the same way.

`$LOOM_MANAGER_SOCKET`, else `$XDG_RUNTIME_DIR/loomllm/manager.sock`, else
`~/.cache/loomllm/run/manager.sock`. The lock and log files sit beside the socket.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_socket_path() -> Path:
    explicit = os.environ.get("LOOM_MANAGER_SOCKET")
    if explicit:
        return Path(explicit).expanduser()
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir and Path(runtime_dir).is_dir():
        return Path(runtime_dir) / "loomllm" / "manager.sock"
    return Path.home() / ".cache" / "loomllm" / "run" / "manager.sock"


def lock_path(socket_path: Path) -> Path:
    """Held (flock) by whoever is starting a manager for this socket."""
    return socket_path.with_name(socket_path.name + ".lock")


def log_path(socket_path: Path) -> Path:
    return socket_path.with_name(socket_path.name + ".log")


def workers_dir(socket_path: Path) -> Path:
    """Worker data sockets and worker logs of the manager at `socket_path`."""
    return socket_path.with_name(socket_path.name + ".workers")


def ensure_private_dir(path: Path) -> None:
    """Create `path` (and parents) with mode 0700 and refuse one that others can enter."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
