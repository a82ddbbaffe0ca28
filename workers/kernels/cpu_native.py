"""loomllm's C++ kernels for the CPU (the .cpp files of SOURCES): compiled once per machine
into the cache dir at a worker's start, then loaded as torch.ops.loom_cpu.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from loomllm.workers.device.cpu_features import cpu_identity

logger = logging.getLogger(__name__)
_ops: Any | None = None  # torch.ops.loom_cpu, once `load` has loaded it
# A process holds one build: a second library would register the same ops again (an abort).
_built: Any | None = None

HERE = Path(__file__).parent
# The attention kernels live with the rest of attention (the Triton kernels, the torch
# reference); one library holds them all, built from copies side by side.
ATTENTION = HERE.parent / "attention"
SOURCES = (
    HERE / "cpu_ops.cpp",
    ATTENTION / "cpu_attention.cpp",
    ATTENTION / "cpu_prefill_attention.cpp",
    HERE / "cpu_sample.cpp",
    HERE / "cpu_block_linear.cpp",
    HERE / "cpu_gguf_linear.cpp",
    HERE / "cpu_stack.cpp",
)
HEADERS = (
    HERE / "cpu_ops.h",
    ATTENTION / "cpu_attention_lanes.h",
    HERE / "cpu_gguf_blocks.h",
    HERE / "cpu_gguf_avx512.h",
    HERE / "cpu_gguf_avx2.h",
    HERE / "cpu_gguf_panels.h",
)
DTYPES = (torch.float32, torch.bfloat16)  # what the kernels compute in
# "0": run the torch ops instead (the reference the C++ kernels are tested against).
CPU_KERNELS_ENV = "LOOM_CPU_KERNELS"
COMPLETE = "complete"  # written in a build's directory once its library has loaded
# Compiled for this CPU's own instruction set; no FMA contraction, so that the rotary
# embedding and the norms round exactly as torch's separate multiplies and adds. OpenMP, or
# at::parallel_for runs on one thread (the process has torch's libgomp.so.1 loaded already,
# which the library then shares).
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp")
LDFLAGS = ("-fopenmp",)


def cpp_enum(source: str, name: str) -> dict[str, int]:
    """The members of the C++ enum `name` in the kernel file `source`, read from its text, so
    that the Python side states none of its values again."""
    text = (HERE / source).read_text()
    found = re.search(rf"enum\s+{name}\b[^{{]*{{([^}}]*)}}", text)
    if found is None:
        raise LookupError(f"no enum {name} in {source}")
    members = (item.split("=") for item in found.group(1).split(",") if item.strip())
    return {key.strip(): int(value, 0) for key, value in members}


def build_key() -> str:
    """What the library depends on: its sources, torch, the compiler's flags, the CPU."""
    return _key(_read_code())


def _read_code() -> dict[str, str]:
    """Each source and header file's name and text."""
    return {path.name: path.read_text() for path in (*SOURCES, *HEADERS)}


def _key(code: dict[str, str]) -> str:
    text = "\0".join([*code.values(), torch.__version__, *CFLAGS, *LDFLAGS, cpu_identity()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load(cache_dir: Path) -> Any | None:
    """torch.ops.loom_cpu, built under `cache_dir` if this machine has no build of it yet;
    None (logged) where it is turned off, or cannot be built or loaded. A worker calls it
    once, at its start; from then on `loaded()` is these ops in that process."""
    global _ops, _built
    setting = os.environ.get(CPU_KERNELS_ENV, "").strip()
    if setting not in ("", "0", "1"):
        raise ValueError(f"{CPU_KERNELS_ENV} must be 0 or 1 (or unset); got {setting!r}")
    if setting == "0":
        logger.info("CPU kernels: torch's ops (%s=0)", CPU_KERNELS_ENV)
        return None
    if _ops is not None:
        return _ops
    if _built is not None:
        _ops = _built
        return _ops
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        logger.warning("CPU kernels: torch's ops, slower: no C++ compiler (c++ or $CXX) found")
        return None
    code = _read_code()
    key = _key(code)
    build_dir = cache_dir / "cpu_ops" / key
    started = time.perf_counter()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        lock = open(build_dir.with_suffix(".lock"), "w")  # closed by the `with` below
    except OSError as exc:
        logger.warning("CPU kernels: torch's ops, slower: %s is unusable: %s", build_dir, exc)
        return None
    with lock:
        # One process builds at a time, under a lock the kernel drops when its holder dies.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _load_or_build(build_dir, key, code):
            return None
    logger.info(
        "CPU kernels: loomllm's C++ ops from %s (%.1f s)", build_dir, time.perf_counter() - started
    )
    _ops = _built = torch.ops.loom_cpu
    return _ops


def _load_or_build(build_dir: Path, key: str, code: dict[str, str]) -> bool:
    """Under the build lock: load the library built in `build_dir`, building it first where
    no finished build is there; False (logged) where that failed."""
    # torch's own lock file would stay behind a worker killed mid-build and stall every later
    # build, so one found while we hold ours is such a leftover.
    (build_dir / "lock").unlink(missing_ok=True)
    library = build_dir / f"loom_cpu_{key}.so"
    if library.exists() and not _marked_complete(build_dir, library):
        # A build cut short (a worker killed while linking) can leave a truncated library
        # that looks up to date, and loading it kills the process: build from nothing.
        logger.info("CPU kernels: %s was not finished; building it again", build_dir)
        shutil.rmtree(build_dir, ignore_errors=True)
        build_dir.mkdir(parents=True, exist_ok=True)
    if library.exists():
        # Loaded as it is: torch's loader would run ninja, which compiles everything again
        # when build.ninja names another checkout's or venv's paths or a source is newer.
        try:
            torch.ops.load_library(str(library))
        except Exception as exc:  # the dynamic loader's error
            logger.warning("CPU kernels: torch's ops, slower: loading %s failed: %s", library, exc)
            return False
        return True
    logger.info("CPU kernels: compiling them for this machine, once (a minute or two)")
    try:
        _build(build_dir, key, code)
    except Exception as exc:  # a compiler, linker or loader error
        logger.warning("CPU kernels: torch's ops, slower: building them failed: %s", exc)
        return False
    (build_dir / COMPLETE).write_text(_stamp(library))
    return True


def _build(build_dir: Path, key: str, code: dict[str, str]) -> None:
    """Compile `code` in `build_dir` (what a build cut short left undone) and load it."""
    from torch.utils import cpp_extension  # a big import, for CPU workers only

    ninja_on_path()
    # From copies in the build's own directory: build.ninja then names the same files whichever
    # checkout asks, and they are never newer than what a build cut short compiled.
    source_dir = build_dir / "src"
    source_dir.mkdir(exist_ok=True)
    for name, text in code.items():
        copy = source_dir / name
        if not copy.exists() or copy.read_text() != text:
            copy.write_text(text)
    cpp_extension.load(
        name=f"loom_cpu_{key}",
        sources=[str(source_dir / path.name) for path in SOURCES],
        build_directory=str(build_dir),
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        is_python_module=False,
        verbose=False,
    )


def ninja_on_path() -> None:
    """torch's loader runs `ninja` from PATH, which lacks the venv's bin (where the ninja
    package puts it) when Python is run by its path without activating the venv: add it."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return  # the build fails, naming ninja, and the worker runs torch's ops
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _stamp(library: Path) -> str:
    info = library.stat()
    return f"{info.st_size} {info.st_mtime_ns}"


def _marked_complete(build_dir: Path, library: Path) -> bool:
    """Whether the library is the one a finished build loaded."""
    try:
        return (build_dir / COMPLETE).read_text() == _stamp(library)
    except OSError:
        return False


def loaded() -> Any | None:
    """torch.ops.loom_cpu where `load` has loaded it in this process, else None."""
    return _ops


def use(ops: Any | None) -> None:
    """Make `loaded()` these ops, or None: what the torch backend's decode attention takes in
    this process (benchmarks compare the two)."""
    global _ops
    _ops = ops
