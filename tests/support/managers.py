"""Managers on temporary sockets, driven through the real `engine-manager` CLI, and the
processes they leave behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ManagerHandle:
    """A manager under a temporary socket, driven through the real `engine-manager` CLI."""

    socket: Path
    extra_env: dict[str, str] = field(default_factory=dict)  # the daemon's (HF_ENDPOINT, ...)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, **self.extra_env, "LOOM_MANAGER_SOCKET": str(self.socket)}

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "loomllm.workers.manager", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def start(self, *args: str) -> None:
        result = self.cli("start", *args)
        assert result.returncode == 0, result.stderr + result.stdout

    def pid(self) -> int:
        out = self.cli("status").stdout
        return int(out.split("pid ")[1].split(",")[0])

    def worker_states(self) -> dict[int, str]:
        """{pid: state} of every worker rank, from `engine-manager ps`."""
        lines = self.cli("ps").stdout.splitlines()[1:]
        return {int(line.split()[2]): line.split()[4] for line in lines}

    def processes(self) -> list[int]:
        """pids of every process whose command line names this manager's directory."""
        return pids_mentioning(str(self.socket.parent))

    def stop_and_check_clean(self) -> None:
        self.cli("stop")
        deadline = time.monotonic() + 10
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.processes()
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.socket.parent, ignore_errors=True)
        assert not left, f"processes left behind: {left}"


def pids_mentioning(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            pids.append(int(entry))
    return pids


def new_manager_handle(extra_env: dict[str, str] | None = None) -> ManagerHandle:
    socket = Path(tempfile.mkdtemp(prefix="loom-", dir="/tmp")) / "m.sock"
    return ManagerHandle(socket, extra_env or {})
