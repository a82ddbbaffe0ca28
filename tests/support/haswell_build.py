"""The CPU's C++ ops built as an AVX2-only CPU (Haswell) builds them, run in a fresh process.

Each machine builds the library for its own CPU (-march=native): tests hold the build for a
CPU without AVX-512 to the same references as the native one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from loomllm.workers.models.sources import cache_root

# One process holds one build of the ops, so the Haswell build runs in its own, at one thread
# (so that the decode attention's items depend on the rows alone); its build key differs from
# the native build's by the flags, so both live in the one cache.
RUN = """
import sys
from pathlib import Path
import torch
from loomllm.workers.kernels import cpu_native
cpu_native.CFLAGS = tuple(
    "-march=haswell" if flag == "-march=native" else flag for flag in cpu_native.CFLAGS
)
ops = cpu_native.load(Path(sys.argv[1]))
assert ops is not None, "the library did not build for Haswell"
torch.set_num_threads(1)
calls = torch.load(sys.argv[2])
torch.save([getattr(ops, name)(*args) for name, args in calls], sys.argv[3])
"""


def run_built_for_haswell(calls: list[tuple[str, tuple[Any, ...]]], workdir: Path) -> list[Any]:
    """Each (op name, arguments) called on torch.ops.loom_cpu as built for Haswell."""
    torch.save(calls, workdir / "calls.pt")
    argv = [str(cache_root()), str(workdir / "calls.pt"), str(workdir / "outs.pt")]
    run = subprocess.run(
        [sys.executable, "-c", RUN, *argv], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(workdir / "outs.pt")
