"""Build llama.cpp's peer binaries for the CPU at hand (`make bench-peers`) and record how.

On an Intel CPU with AMX, a `GGML_NATIVE` build crashes (SIGSEGV) on its first prompt, so
there the build turns AMX off; the record (.peers/llama-build.json) says which build was made
so that `loom bench cpu` can print it. Standard library only: it runs before any venv exists.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

TARGETS = ("llama-server", "llama-bench", "llama-quantize", "llama-perplexity")
AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# The CPU flags that decide which kernels a native build compiles, kept in the record.
DECIDING_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    *AMX_FLAGS,
)


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first processor's feature flags in /proc/cpuinfo text (x86 "flags", Arm
    "Features"); empty where the text has neither."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_name(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "model name":
            return value.strip()
    return "unknown CPU"


def plan_build(cpuinfo: str) -> dict:
    """The build this CPU gets: native, with AMX turned off where the CPU has any AMX flag."""
    flags = cpu_flags(cpuinfo)
    amx = sorted(flags.intersection(AMX_FLAGS))
    extra = NO_AMX if amx else ""
    return {
        "ggml_native": True,
        "amx_off": bool(amx),
        "c_flags": extra,
        "cxx_flags": extra,
        "cpu": cpu_name(cpuinfo),
        "cpu_flags": [f for f in DECIDING_FLAGS if f in flags],
    }


def cmake_configure(source: Path, build: Path, plan: dict) -> list[str]:
    return [
        "cmake",
        "-S",
        str(source),
        "-B",
        str(build),
        "-DLLAMA_BUILD_SERVER=ON",
        "-DGGML_NATIVE=ON",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_CURL=OFF",
        # Always given, empty included: a cached AMX-off flag must not outlive a move to
        # another CPU.
        f"-DCMAKE_C_FLAGS={plan['c_flags']}",
        f"-DCMAKE_CXX_FLAGS={plan['cxx_flags']}",
    ]


def describe(record: dict | None) -> str:
    """One line for a benchmark's header: which llama.cpp build its figures come from."""
    if record is None:
        return "llama.cpp build: not recorded (built before `make bench-peers` kept a record)"
    cpu_flags = " ".join(record["cpu_flags"]) or "none of note"
    if record["amx_off"]:
        how = f"GGML_NATIVE with AMX off ({record['c_flags']}): native AMX builds crash here"
    else:
        how = "GGML_NATIVE (no AMX on this CPU)"
    return f"llama.cpp build: {how}; built on {record['cpu']}, flags {cpu_flags}"


def note_for(binary: Path, record_path: Path) -> str:
    """describe() for the build `binary` comes from: the recorded one where it lies in the
    recorded bin_dir, else a line saying it is another."""
    record = read_record(record_path)
    if record is not None and Path(record["bin_dir"]) != binary.resolve().parent:
        return f"llama.cpp build: {binary}, not the build `make bench-peers` recorded"
    return describe(record)


def read_record(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def is_current(record: dict | None, plan: dict, binaries: list[Path]) -> bool:
    """Whether the recorded build is the one planned here and all its binaries are there."""
    if record is None or not all(path.exists() for path in binaries):
        return False
    return all(record.get(key) == value for key, value in plan.items())


def run_logged(cmd: list[str], log: Path) -> None:
    """Run `cmd` with its output in `log`; on failure, exit with the log's tail."""
    with log.open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}); the end of {log}:\n{tail}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", type=Path, required=True, help="llama.cpp's source tree")
    p.add_argument("--record", type=Path, required=True, help="the JSON file to write")
    p.add_argument("--cpuinfo", type=Path, default=Path("/proc/cpuinfo"))
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(argv)

    build = args.source / "build"
    binaries = [build / "bin" / name for name in TARGETS]
    plan = plan_build(args.cpuinfo.read_text())
    if is_current(read_record(args.record), plan, binaries):
        print(describe(read_record(args.record)) + " (up to date)")
        return
    logs = args.record.parent
    started = time.monotonic()
    run_logged(cmake_configure(args.source, build, plan), logs / "cmake.log")
    build_cmd = ["cmake", "--build", str(build), "--target", *TARGETS, f"-j{args.jobs}"]
    run_logged(build_cmd, logs / "build.log")
    record = {**plan, "bin_dir": str(build.resolve() / "bin"), "targets": list(TARGETS)}
    tmp = args.record.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(args.record)
    print(f"{describe(record)} ({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
