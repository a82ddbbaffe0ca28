"""loomllm's C++ kernels for the CPU (cpu_ops.cpp, cpu_attention.cpp, cpu_stack.cpp): compiled
once per machine into the cache dir at a worker's start, then loaded as torch.ops.loom_cpu.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from loomllm.workers.device.cpu_features import cpu_identity

logger = logging.getLogger(__name__)
_ops: Any | None = None  # torch.ops.loom_cpu, once `load` has loaded it

HERE = Path(__file__).parent
SOURCES = tuple(HERE / name for name in ("cpu_ops.cpp", "cpu_attention.cpp", "cpu_stack.cpp"))
HEADERS = (HERE / "cpu_ops.h",)
DTYPES = (torch.float32, torch.bfloat16)  # what the kernels compute in
# "0": run the torch ops instead (the reference the C++ kernels are tested against).
CPU_KERNELS_ENV = "LOOM_CPU_KERNELS"
# Compiled for this CPU's own instruction set; no FMA contraction, so that the rotary
# embedding and the norms round exactly as torch's separate multiplies and adds. OpenMP, or
# at::parallel_for runs on one thread (the process has torch's libgomp.so.1 loaded already,
# which the library then shares).
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp")
LDFLAGS = ("-fopenmp",)


def build_key() -> str:
    """What the library depends on: its sources, torch, the compiler's flags, the CPU."""
    code = [path.read_text() for path in (*SOURCES, *HEADERS)]
    text = "\0".join([*code, torch.__version__, *CFLAGS, *LDFLAGS, cpu_identity()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load(cache_dir: Path) -> Any | None:
    """torch.ops.loom_cpu, built under `cache_dir` if this machine has no build of it yet;
    None (logged) where it is turned off, or cannot be built or loaded. A worker calls it
    once, at its start; from then on `loaded()` is these ops in that process."""
    global _ops
    setting = os.environ.get(CPU_KERNELS_ENV, "").strip()
    if setting not in ("", "0", "1"):
        raise ValueError(f"{CPU_KERNELS_ENV} must be 0 or 1 (or unset); got {setting!r}")
    if setting == "0":
        logger.info("CPU kernels: torch's ops (%s=0)", CPU_KERNELS_ENV)
        return None
    if _ops is not None:
        return _ops
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        logger.warning("CPU kernels: torch's ops, slower: no C++ compiler (c++ or $CXX) found")
        return None
    from torch.utils import cpp_extension  # a big import, for CPU workers only

    key = build_key()
    build_dir = cache_dir / "cpu_ops" / key
    started = time.perf_counter()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        # torch's loader takes a lock in build_dir: two workers starting at once build once.
        cpp_extension.load(
            name=f"loom_cpu_{key}",
            sources=[str(path) for path in SOURCES],
            build_directory=str(build_dir),
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # a compiler or linker error: run the torch ops instead
        logger.warning("CPU kernels: torch's ops, slower: building them failed: %s", exc)
        return None
    logger.info(
        "CPU kernels: loomllm's C++ ops from %s (%.1f s)", build_dir, time.perf_counter() - started
    )
    _ops = torch.ops.loom_cpu
    return _ops


def loaded() -> Any | None:
    """torch.ops.loom_cpu where `load` has loaded it in this process, else None."""
    return _ops
