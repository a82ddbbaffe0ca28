"""Where the per-user engine-manager lives: the rendezvous both sides compute the same way.

The lock, the log and the workers' directory sit beside the manager's socket.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def default_socket_path() -> Path:
    """`$LOOM_MANAGER_SOCKET`, else `$XDG_RUNTIME_DIR/loomllm/manager.sock`, else
    `~/.cache/loomllm/run/manager.sock`."""
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


def unlink_if_ours(path: Path, inode: int) -> None:
    """Remove our socket file, but never one that another daemon has bound since."""
    try:
        if os.stat(path).st_ino == inode:
            path.unlink()
    except FileNotFoundError:
        pass


def open_private_file(path: Path, flags: int) -> int:
    """os.open `path` (created if missing) readable by this user only: a manager's log and
    lock may sit in a directory that others can list (ensure_socket_dir)."""
    fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, 0o600)  # an older version of ours left it readable to others
    except BaseException:
        os.close(fd)
        raise
    return fd


def ensure_socket_dir(path: Path) -> None:
    """Create `path` (and parents) with mode 0700, or check the existing directory the
    user named: it must be ours, and others must not be able to write to it (they could
    plant or swap the socket). It is never chmodded: it may be a project directory, or
    /tmp. Others may list it: the socket (0600, and SO_PEERCRED in protocols/peer_auth.py),
    the log and the lock (open_private_file) keep them out."""
    _ensure_dir(
        path,
        0o022,
        "is writable by other users, who could replace the "
        "engine-manager's socket; put the socket (--socket or LOOM_MANAGER_SOCKET) "
        f"in a directory only you can write to, or `chmod go-w {path}`",
    )


def ensure_private_dir(path: Path) -> None:
    """Create `path` (and parents) with mode 0700, or check that the existing one is ours
    and closed to others: for directories only a manager makes (worker sockets, logs)."""
    _ensure_dir(
        path,
        0o077,
        "is open to other users; it holds the engine-manager's worker "
        f"sockets and logs: `chmod 700 {path}` or remove it",
    )


def _ensure_dir(path: Path, forbidden: int, why: str) -> None:
    """Make `path` private, or refuse (never change) an existing one with `forbidden` mode
    bits: PermissionError "PATH (mode M) `why`"."""
    if _make_private_dir(path):
        return
    _check_ours(path)
    mode = path.stat().st_mode
    if mode & forbidden:
        raise PermissionError(f"{path} (mode {stat.S_IMODE(mode):o}) {why}")


def _make_private_dir(path: Path) -> bool:
    """True if we created `path` (mode 0700), False if it already existed."""
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        return False  # it exists already: the caller checks it and never changes it
    os.chmod(path, 0o700)  # the umask may have narrowed mkdir's mode
    return True


def _check_ours(path: Path) -> None:
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{path} is not a directory; choose another manager socket path")
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user")
