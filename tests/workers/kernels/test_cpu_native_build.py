"""The CPU's C++ ops (kernels/cpu_native.py) compile once per build key: processes started
from two checkouts of the same sources, one cache dir, one compile."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loomllm.workers.kernels import cpu_native

pytestmark = pytest.mark.compute

# Loads the ops as a worker does, from the checkout whose cpu_native.py it is given.
RUN = """
import importlib.util, json, logging, sys
from pathlib import Path
import torch
logging.basicConfig(level=logging.INFO)
spec = importlib.util.spec_from_file_location("checkout_cpu_native", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
ops = module.load(Path(sys.argv[2]))
print(json.dumps([module.build_key(), ops.silu_mul(torch.zeros(1, 2)).tolist()]))
"""


def checkout(root: Path) -> Path:
    """A copy of the C++ kernels' module and files, in their folders, at `root`: its
    cpu_native.py."""
    workers = Path(cpu_native.__file__).parents[1]
    for path in (Path(cpu_native.__file__), *cpu_native.SOURCES, *cpu_native.HEADERS):
        copy = root / "workers" / path.relative_to(workers)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, copy)
    return root / "workers" / "kernels" / "cpu_native.py"


def start(module: Path, cache_dir: Path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-c", RUN, str(module), str(cache_dir)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen[str]) -> tuple[str, str]:
    """The key the process loaded and its log; fails unless its ops ran."""
    out, err = process.communicate(timeout=900)
    assert process.returncode == 0, err[-4000:]
    key, silu = json.loads(out.strip().splitlines()[-1])
    assert silu == [[0.0]]
    return key, err


def ninja_runs(build_dir: Path) -> dict[str, int]:
    """How many times ninja built each output in `build_dir`, from its log."""
    counts: dict[str, int] = {}
    for line in (build_dir / ".ninja_log").read_text().splitlines():
        if not line.startswith("#"):
            output = line.split("\t")[3]
            counts[output] = counts.get(output, 0) + 1
    return counts


@pytest.mark.skipif(shutil.which("c++") is None, reason="the ops are built with the system's c++")
@pytest.mark.timeout(1200)  # one compile from nothing, on one core of a busy host
def test_two_checkouts_and_three_processes_compile_the_ops_once(tmp_path):
    """Each checkout's torch loader wrote build.ninja with its own source paths, so ninja
    compiled everything again whenever the other checkout had built last; a fresh clone's
    sources, newer than the objects, did the same."""
    first, second = checkout(tmp_path / "a"), checkout(tmp_path / "b")
    cache_dir = tmp_path / "cache"
    # At once: one builds, the other waits on the build lock, then loads.
    results = [finish(process) for process in (start(first, cache_dir), start(second, cache_dir))]
    # A fresh clone: the same sources, newer than everything in the build dir.
    later = time.time() + 3600
    for path in second.parent.iterdir():
        os.utime(path, (later, later))
    results.append(finish(start(second, cache_dir)))
    keys = {key for key, _ in results}
    assert len(keys) == 1
    key = keys.pop()
    assert sum("compiling them" in log for _, log in results) == 1
    built = ninja_runs(cache_dir / "cpu_ops" / key)
    assert built == {
        **{f"{path.stem}.o": 1 for path in cpu_native.SOURCES},
        f"loom_cpu_{key}.so": 1,
    }


def test_the_linear_modes_are_read_from_the_cpp_enum(tmp_path, monkeypatch):
    """cpu_stack.py reads LinearMode's values from cpu_stack.cpp: a renumbered enum moves
    them both, and a missing one is an error naming it."""
    from loomllm.workers.kernels import cpu_native
    from loomllm.workers.models.llama import cpu_stack

    assert cpu_stack.LINEAR_MODES == {"DENSE": 0, "INT4": 1, "INT8": 2, "A8": 3, "GGUF": 4}
    (tmp_path / "k.cpp").write_text("enum Mode : int64_t { A = 0x2, B = 7 };\nenum Other {C=1};")
    monkeypatch.setattr(cpu_native, "HERE", tmp_path)
    assert cpu_native.cpp_enum("k.cpp", "Mode") == {"A": 2, "B": 7}
    with pytest.raises(LookupError, match="no enum LinearMode in k.cpp"):
        cpu_native.cpp_enum("k.cpp", "LinearMode")
