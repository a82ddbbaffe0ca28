"""Whether this CPU computes bfloat16 natively, which decides what dtype="auto" means on CPU.

device/dtype.py asks when it picks the weights' (and so the KV cache's) dtype.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from pathlib import Path

CPU_BF16_ENV = "LOOM_CPU_BF16"
# x86 flags of native bf16 GEMMs: AVX512-BF16 (Cooper Lake, Zen 4+) and AMX (Sapphire Rapids+).
# torch.ops.mkldnn._is_mkldnn_bf16_supported() is no guide: it says True on any AVX512 CPU,
# where oneDNN emulates bf16 (slower than fp32; on AVX2-only CPUs torch's fallback is slower
# still), so only these flags make bf16 worth its precision loss.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_CPUINFO = Path("/proc/cpuinfo")


def cpu_supports_bf16(
    cpuinfo: str | None = None, environ: Mapping[str, str] | None = None
) -> tuple[bool, str]:
    """Whether bf16 GEMMs run natively on this CPU, and why we think so (for the log).

    cpuinfo: the text of /proc/cpuinfo (read when None). environ: where to look for
    $LOOM_CPU_BF16 (os.environ when None); "1" forces bf16, "0" forbids it.
    """
    override = (os.environ if environ is None else environ).get(CPU_BF16_ENV, "").strip()
    if override in ("0", "1"):
        return override == "1", f"{CPU_BF16_ENV}={override}"
    if override:
        raise ValueError(f"{CPU_BF16_ENV} must be 0 or 1 (or unset); got {override!r}")
    if cpuinfo is None:
        try:
            cpuinfo = _CPUINFO.read_text()
        except OSError:
            return False, f"{_CPUINFO} is unreadable, so no native bf16 is assumed"
    flags = _common_flags(cpuinfo)
    found = [flag for flag in BF16_FLAGS if flag in flags]
    if found:
        return True, f"the CPU has {' and '.join(found)}"
    return False, f"the CPU has neither {' nor '.join(BF16_FLAGS)}"


def _common_flags(cpuinfo: str) -> set[str]:
    """The flags every processor in `cpuinfo` lists (x86's "flags : ..." lines)."""
    common: set[str] | None = None
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            flags = set(value.split())
            common = flags if common is None else common & flags
    return common or set()


def cpu_identity() -> str:
    """The CPU's model name and flags, for keys of what was measured or built for it."""
    model, flags = "", ""
    try:
        for line in _CPUINFO.read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model or platform.processor()}\0{flags}"
