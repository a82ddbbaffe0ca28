"""benchmarks/peers_build.py: AMX found in /proc/cpuinfo turns AMX off in llama.cpp's build,
the record says which build was made, and a current build is not made again."""

from __future__ import annotations

import json
import os
from pathlib import Path

from loomllm.benchmarks import peers_build

# Trimmed from real /proc/cpuinfo texts: the flags lines keep the ones that matter.
INTEL_AMX = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 \
amx_bf16 avx512_fp16 amx_tile amx_int8
bugs\t\t: spectre_v1

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""
AMD_EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx_vnni avx512_bf16 avx512_vnni
"""
ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimddp sve
"""


def test_an_intel_cpu_with_amx_gets_a_build_with_amx_off():
    plan = peers_build.plan_build(INTEL_AMX)
    assert plan["amx_off"] is True
    assert plan["c_flags"] == plan["cxx_flags"] == "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    assert plan["cpu"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert {"amx_tile", "amx_int8", "amx_bf16", "avx512_vnni"} <= set(plan["cpu_flags"])
    cmd = peers_build.cmake_configure(Path("src"), Path("b"), plan)
    assert "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in cmd
    assert "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in cmd
    assert "-DGGML_NATIVE=ON" in cmd


def test_any_one_amx_flag_is_enough():
    only_tile = AMD_EPYC.replace("avx512_vnni\n", "avx512_vnni amx_tile\n")
    assert peers_build.plan_build(only_tile)["amx_off"] is True


def test_cpus_without_amx_get_the_plain_native_build():
    for text in (AMD_EPYC, ARM, ""):
        plan = peers_build.plan_build(text)
        assert plan["amx_off"] is False and plan["c_flags"] == plan["cxx_flags"] == ""
        cmd = peers_build.cmake_configure(Path("src"), Path("b"), plan)
        # Given empty on purpose: a cached AMX-off flag must not survive into this build.
        assert "-DCMAKE_C_FLAGS=" in cmd and "-DCMAKE_CXX_FLAGS=" in cmd
    assert peers_build.plan_build(AMD_EPYC)["cpu_flags"] == [
        "avx2",
        "fma",
        "f16c",
        "avx_vnni",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512_vnni",
        "avx512_bf16",
    ]
    assert peers_build.cpu_flags(ARM) >= {"asimd", "sve"}
    assert peers_build.cpu_name(ARM) == "unknown CPU"


def test_the_record_is_described_for_the_table():
    amx = peers_build.describe(peers_build.plan_build(INTEL_AMX))
    assert amx.startswith("llama.cpp build: GGML_NATIVE with AMX off (-mno-amx-tile")
    assert "amx_tile" in amx and "Intel(R) Xeon(R) Platinum 8480+" in amx
    plain = peers_build.describe(peers_build.plan_build(AMD_EPYC))
    assert plain.startswith("llama.cpp build: GGML_NATIVE (no AMX on this CPU); built on AMD EPYC")
    assert "not recorded" in peers_build.describe(None)


def fake_cmake(tmp_path):
    """A `cmake` on PATH that logs its arguments to tmp_path/cmake-calls."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    script = bin_dir / "cmake"
    script.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/cmake-calls\n')
    script.chmod(0o755)
    return bin_dir


def test_main_builds_records_and_rebuilds_only_for_another_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", f"{fake_cmake(tmp_path)}{os.pathsep}{os.environ['PATH']}")
    source, record = tmp_path / "llama.cpp", tmp_path / "llama-build.json"
    bin_dir = source / "build" / "bin"
    bin_dir.mkdir(parents=True)
    cpuinfo = tmp_path / "cpuinfo"
    argv = ["--source", str(source), "--record", str(record), "--cpuinfo", str(cpuinfo)]

    def calls() -> list[str]:
        path = tmp_path / "cmake-calls"
        return path.read_text().splitlines() if path.exists() else []

    def build(text: str) -> None:
        cpuinfo.write_text(text)
        for name in peers_build.TARGETS:  # what a real build would have made
            (bin_dir / name).touch()
        peers_build.main(argv)

    build(AMD_EPYC)
    assert len(calls()) == 2  # configure, build
    assert "--target llama-server llama-bench llama-quantize llama-perplexity -j2" in calls()[1]
    written = json.loads(record.read_text())
    assert written["amx_off"] is False and written["bin_dir"] == str(bin_dir.resolve())
    build(AMD_EPYC)
    assert len(calls()) == 2 and "(up to date)" in capsys.readouterr().out
    build(INTEL_AMX)  # the same tree moved to an AMX machine
    assert len(calls()) == 4 and "-DCMAKE_C_FLAGS=-mno-amx-tile" in calls()[2]
    assert json.loads(record.read_text())["amx_off"] is True
    (bin_dir / "llama-perplexity").unlink()
    cpuinfo.write_text(INTEL_AMX)
    peers_build.main(argv)
    assert len(calls()) == 6  # a binary gone: built again


def test_a_failed_build_exits_with_its_log_and_writes_no_record(tmp_path, monkeypatch):
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    (bin_dir / "cmake").write_text("#!/bin/sh\necho 'error: no compiler'\nexit 1\n")
    (bin_dir / "cmake").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "cpuinfo").write_text(AMD_EPYC)
    record = tmp_path / "llama-build.json"
    argv = ["--source", str(tmp_path), "--record", str(record)]
    try:
        peers_build.main([*argv, "--cpuinfo", str(tmp_path / "cpuinfo")])
    except SystemExit as exc:
        assert "failed (1)" in str(exc.code) and "error: no compiler" in str(exc.code)
    else:
        raise AssertionError("a failed build must exit")
    assert not record.exists()


def test_note_for_names_a_binary_outside_the_recorded_build(tmp_path):
    record = tmp_path / "llama-build.json"
    plan = peers_build.plan_build(INTEL_AMX)
    record.write_text(json.dumps({**plan, "bin_dir": str(tmp_path / "bin")}))
    assert "AMX off" in peers_build.note_for(tmp_path / "bin" / "llama-bench", record)
    other = peers_build.note_for(tmp_path / "elsewhere" / "llama-bench", record)
    assert "not the build `make bench-peers` recorded" in other
    assert "not recorded" in peers_build.note_for(tmp_path / "x", tmp_path / "none.json")
