"""`loom bench`: the benchmarks in benchmarks/ run from the installed command."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.compute


def loom(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loomllm.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_overhead_benchmark_phases_add_up_and_it_compares_gc_freeze() -> None:
    """One run, both checks: each table's phases add up, and `--gc-freeze both` prints a
    table for each mode and their ratio."""
    done = loom(
        "bench",
        "engine",
        "overhead",
        "--batch-sizes",
        "1,3",
        "--max-tokens",
        "4",
        "--backends",
        "asyncio",
        "--gc-freeze",
        "both",
        "--rounds",
        "1",
    )
    assert done.returncode == 0, done.stderr
    assert "gc freeze off, round 1" in done.stdout and "gc freeze on, round 1" in done.stdout
    rows = [line for line in done.stdout.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "3", "1", "3"]  # off, on
    for row in rows:
        cells = [float(c) for c in row.strip("|").split("|")]
        batch, steps, _, tok_s, *phases, step, outside, share, _loop, turnaround = cells
        assert steps >= 4 and tok_s > 0
        assert 0 < turnaround < step  # from a reply to the next send: within the step
        assert sum(phases) == pytest.approx(step, rel=0.02, abs=0.005)
        assert outside == pytest.approx(step - phases[2], rel=0.02, abs=0.005)  # minus worker
        # The table prints ms to 2 decimals and the share (from the unrounded times) to 1:
        # recomputed from the printed times it may differ by their rounding's effect.
        slack = 0.05 + 100 * 0.005 * (step + outside) / step**2
        assert share == pytest.approx(100 * outside / step, abs=slack)
    assert re.search(
        r"tokens/s with gc freeze on / off.*\n  batch   1: x\d.*\n  batch   3: x\d", done.stdout
    )


def test_overhead_benchmark_compares_one_thing_at_a_time() -> None:
    both = loom("bench", "engine", "overhead", "--gc-freeze", "both", "--async-scheduling", "both")
    assert both.returncode == 2 and "one thing at a time" in both.stderr


def test_emulated_device_holds_each_step_and_idles_only_without_async_scheduling() -> None:
    done = loom(
        "bench",
        "engine",
        "emulated",
        "--num-requests",
        "6",
        "--prompt-mean",
        "12",
        "--output-mean",
        "8",
        "--base-ms",
        "20",
        "--async-scheduling",
        "both",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [
        line.split("|")[1:-1]
        for line in done.stdout.splitlines()
        if re.match(r"\| (on|off) \|", line)
    ]
    assert [row[0].strip() for row in rows] == ["on", "off"], done.stdout
    idle = {}
    for row in rows:
        mode, _, seconds, tok_s, steps, prompt_steps, busy, *step_ms, idle_share, turnaround = row
        # One device, one step at a time, each at least base-ms long, all within the run.
        assert int(steps) >= 4 and 0.020 * int(steps) <= float(busy) <= float(seconds) + 0.01
        assert float(tok_s) > 0 and float(turnaround) > 0
        # Every prompt has a step, and a step with prompts costs more than a decode.
        assert 1 <= int(prompt_steps) < int(steps)
        assert 20 <= float(step_ms[0]) < float(step_ms[1]), step_ms
        idle[mode.strip()] = float(idle_share)
    # Sent ahead, each step is queued while the one before runs: the host's ~1 ms a step
    # hides behind the 20 ms steps. Without async scheduling it shows.
    assert 0 <= idle["on"] < idle["off"] <= 100, idle


def test_gpu_benchmark_runs_on_the_cpu_at_the_tiny_shape() -> None:
    """The GPU benchmark's every part, on the CPU: what a GPU session runs at full shapes."""
    done = loom(
        "bench",
        "gpu",
        "--shape",
        "tiny",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--num-requests",
        "6",
        "--prompt-mean",
        "12",
        "--output-mean",
        "8",
        "--stream-tokens",
        "8",
        "--hf-batch",
        "4",
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:5]
        for line in done.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| engine")
    }
    asked = int(re.search(r"(\d+) output tokens", done.stdout).group(1))
    assert len(rows) == 5 and all(int(cells[1]) == asked for cells in rows.values()), rows
    idle = re.findall(
        r"async scheduling (on|off): (\d+) engine steps.* the device idled "
        r"(\d+\.\d)% between steps.*; (\d+) of (\d+) steps ran eager.*; "
        r"(\d+) gaps of 1 ms or more, (\d+)% of the idle time \(longest",
        done.stdout,
    )
    assert [mode for mode, *_ in idle] == ["on", "off"], done.stdout
    assert all(int(steps) >= 8 and 0 <= float(share) <= 100 for _, steps, share, *_ in idle)
    # No graphs on the CPU: every step the worker marked ran eager.
    assert all(eager == marked and int(marked) > 0 for *_, eager, marked, _, _ in idle), idle
    assert all(
        int(stalls) <= int(marked) and 0 <= int(share) <= 100 for *_, marked, stalls, share in idle
    ), idle
    # Every step the worker marked either computed prompt tokens (each prompt needs one) or
    # only decoded.
    split = re.findall(
        r"of (\d+) steps ran eager.*; (\d+) steps computed prompt tokens, "
        r"[\d.]+ ms each, the (\d+) decode-only ones [\d.]+ ms each",
        done.stdout,
    )
    assert len(split) == 2 and all(
        int(prompts) >= 1 and int(prompts) + int(decodes) == int(marked)
        for marked, prompts, decodes in split
    ), split
    streams = re.findall(
        r"one stream(, enforce_eager)?: [\d.]+ tok/s .* bandwidth limit "
        r"[\d.]+ tok/s.* idle (\d+\.\d)% between steps",
        done.stdout,
    )
    assert [eager for eager, _ in streams] == ["", ", enforce_eager"], done.stdout
    assert all(0 <= float(share) <= 100 for _, share in streams), streams
    ceiling = re.search(
        r"longest request decodes (\d+) tokens.* at most (\d+) output tok/s", done.stdout
    )
    assert ceiling and int(ceiling.group(1)) <= asked, done.stdout


def test_gpu_benchmark_skips_parts_and_refuses_unknown_ones() -> None:
    done = loom(
        "bench",
        "gpu",
        "--shape",
        "tiny",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--num-requests",
        "3",
        "--prompt-mean",
        "8",
        "--output-mean",
        "4",
        "--stream-tokens",
        "4",
        "--skip",
        "async-off,serve,generate,continuous,eager",
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| loomllm")]
    assert [r.split("|")[1].strip() for r in rows] == ["loomllm, async scheduling on"]
    assert "async scheduling off" not in done.stdout
    assert re.findall(r"^one stream[^:]*:", done.stdout, re.M) == ["one stream:"], done.stdout
    done = loom("bench", "gpu", "--skip", "serve,bogus")
    assert done.returncode == 2 and "unknown parts ['bogus']" in done.stderr


def test_start_benchmark_times_a_cold_start_and_warm_attaches() -> None:
    """A new process each: the first finds no manager (cold), the next reuse its worker."""
    done = loom(
        "bench",
        "engine",
        "start",
        "--shape",
        "tiny",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--warm",
        "1",
        "--model-impl",
        "auto,transformers",
        "--import-times",
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    imports = re.findall(r"^imports, (.+): ([\d.]+) s$", done.stdout, re.M)
    assert [what for what, _ in imports] == [
        "torch",
        "the zygote's list",
        "and transformers' modeling code",
    ], done.stdout
    assert re.search(r"^bytecode: written by this interpreter: (True|False); ", done.stdout, re.M)
    rows = [
        line.split("|")[1:-1]
        for line in done.stdout.splitlines()
        if line.startswith("| cold") or line.startswith("| warm")
    ]
    assert [tuple(c.strip() for c in r[:3]) for r in rows] == [
        ("cold", "auto", "False"),
        ("warm 1", "auto", "True"),
        ("cold", "transformers", "False"),
        ("warm 1", "transformers", "True"),
    ]
    for _, _, _, attached, first, launched in rows:
        assert 0 <= float(attached) <= float(first) <= float(launched)
    for cold, warm in (rows[:2], rows[2:]):
        assert float(warm[4]) < float(cold[4]), rows  # attaching skips the worker's start
    assert re.search(
        r"^cold start, process launch to first token: transformers / auto = "
        r"\d+\.\d\d$",
        done.stdout,
        re.M,
    ), done.stdout


def test_gpu_checks_run_on_the_cpu_as_a_smoke_test() -> None:
    """Every part of what a GPU session checks, at tiny shapes (the kernels in Triton's
    interpreter: TRITON_INTERPRET=1 is inherited from conftest.py), the models' checks
    against transformers included."""
    done = loom(
        "bench",
        "gpu-check",
        "--device",
        "cpu",
        "--shape",
        "tiny",
        "--kernel-batches",
        "2",
        "--longest",
        "64",
        "--requests",
        "4",
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    words = re.findall(r"^(PASS|FAIL|SKIP)  ([^:]+):", done.stdout, re.M)
    assert words == [
        ("PASS", "Triton kernels"),
        ("PASS", "fused kernels"),
        ("SKIP", "decode CUDA graphs"),
        ("PASS", "engines, async scheduling and graphs on/off"),
        ("PASS", "architectures"),
        ("PASS", "pooling"),
        ("PASS", "the Triton LoRA kernel"),
        ("PASS", "LoRA adapters in one batch"),
        ("PASS", "speculative decoding"),
    ], done.stdout


def test_decode_profile_runs_on_the_cpu_as_a_smoke_test() -> None:
    """Its four runs (transformers' model with its ops and with the fused kernels, with
    graphs; loomllm's own with and without), the kernels in Triton's interpreter; the
    kernel tables need a GPU's profiler."""
    done = loom(
        "bench",
        "kernel",
        "decode-profile",
        "--device",
        "cpu",
        "--shape",
        "tiny",
        "--batch-sizes",
        "1",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--prompt-len",
        "8",
        "--mixed-prompt",
        "8",
        "--tilings",
        "16x256x4x4,32x128x2",
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    # The skinny kernel's tilings, at 1 and 8 rows, on five weights (no GB/s to speak of
    # here: the interpreter).
    assert "| weight | [out, in] | 16x256x4x4 | 32x128x2x4 |" in done.stdout, done.stdout
    assert (
        len(re.findall(r"^\| .+ \| \[\d+, \d+\] \| \d+ / \d+ \| \d+ / \d+ \|$", done.stdout, re.M))
        == 5
    ), done.stdout
    # The matmul table, cuBLAS (here F.linear on the CPU) and the skinny kernel at batch 1,
    # for the eight weights and for gate|up with its activation.
    assert (
        len(re.findall(r"^\| .+ \| \[\d+, \d+\] \| \d+ / \d+ \(x[\d.]+\) \|$", done.stdout, re.M))
        == 9
    ), done.stdout
    runs = re.findall(r"^batch 1, (.+), (graphs|eager): [\d.]+ ms a step", done.stdout, re.M)
    assert runs == [
        ("transformers' ops", "graphs"),
        ("fused ops", "graphs"),
        ("loomllm's model", "graphs"),
        ("loomllm's model", "eager"),
    ], done.stdout
    # loomllm's model again, each profiled step computing a new 8-token prompt too.
    mixed = re.findall(
        r"^batch 1 and a 8-token prompt, (.+), (graphs|eager): [\d.]+ ms a step", done.stdout, re.M
    )
    assert mixed == [("loomllm's model", "graphs"), ("loomllm's model", "eager")], done.stdout


def test_broadcast_benchmark_measures_every_step_and_rank_count() -> None:
    done = loom(
        "bench", "engine", "broadcast", "--batch-sizes", "1,8", "--repeats", "3", "--ranks", "1,2"
    )
    assert done.returncode == 0, done.stderr
    rows = [
        line.split("|")[1:-1]
        for line in done.stdout.splitlines()
        if line.startswith("| decode") or line.startswith("| prefill")
    ]
    assert [r[0].strip() for r in rows] == [
        "decode, batch 1",
        "decode, batch 8",
        "prefill, 1 x 100 tokens",
        "prefill, 8 x 100 tokens",
    ]
    sizes = [int(r[1]) for r in rows]
    assert sizes[0] < sizes[1] < sizes[3] and sizes[2] < sizes[3]
    assert all(float(c) > 0 for r in rows for c in r[2:])


def test_serving_benchmark_says_how_to_get_its_peers() -> None:
    done = loom("bench", "serving", "--guidellm", "/nonexistent/guidellm")
    assert done.returncode != 0
    assert "make bench-peers" in done.stderr


def test_unknown_benchmark_is_refused() -> None:
    done = loom("bench", "nosuch")
    assert done.returncode == 2 and "invalid choice" in done.stderr


def test_eager_step_benchmark_prints_both_models_and_the_ratio() -> None:
    done = loom(
        "bench",
        "kernel",
        "eager-step",
        "--layers",
        "2",
        "--steps",
        "3",
        "--rounds",
        "1",
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert re.search(r"^model_impl=loom: [\d.]+ ms a step$", done.stdout, re.M), done.stdout
    assert re.search(r"^model_impl=transformers: [\d.]+ ms a step$", done.stdout, re.M)
    assert re.search(r"^transformers / loom, median step: \d+\.\d\d$", done.stdout, re.M)


def test_cpu_step_benchmark_prints_each_way_beside_the_linears() -> None:
    done = loom(
        "bench",
        "kernel",
        "cpu-step",
        "--batch-sizes",
        "1,3",
        "--steps",
        "2",
        "--rounds",
        "1",
        "--context",
        "4",
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    for batch in (1, 3):
        row = rf"^\| {batch} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| x\d+\.\d\d \| -?[\d.]+ \|$"
        assert re.search(row, done.stdout, re.M), done.stdout
    with pytest.raises(SystemExit):
        from loomllm.benchmarks.cpu_step import main

        main(["--steps", "0"])


def test_cpu_prefill_attention_benchmark_agrees_with_sdpa_and_prints_the_ratio() -> None:
    done = loom(
        "bench", "kernel", "cpu-prefill-attention", "--shapes", "40x2,17x1", "--rounds", "1"
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    for length, prompts in ((40, 2), (17, 1)):
        row = rf"^ +{length}x{prompts} +[\d.]+ +[\d.]+ +\d+ +\d+\.\d\d +([\d.e+-]+)$"
        found = re.search(row, done.stdout, re.M)
        assert found, done.stdout
        # Against SDPA's output: bfloat16's rounding of values of about 1 at most.
        assert float(found.group(1)) < 2e-2, done.stdout
    refused = loom("bench", "kernel", "cpu-prefill-attention", "--shapes", "40by2")
    assert refused.returncode == 2 and "LENGTHxPROMPTS" in refused.stderr


def test_cpu_contention_benchmark_prints_both_modes_and_their_ratio(tiny_model) -> None:
    done = loom(
        "bench",
        "kernel",
        "cpu-contention",
        "--model",
        tiny_model,
        "--dtype",
        "float32",
        "--tokens",
        "6",
        "--prompt-tokens",
        "8",
        "--rounds",
        "1",
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    for mode in ("on", "off"):
        row = rf"^\| {mode} \| [\d.]+ \| [\d.]+ \([\d.]+\) \| x\d+\.\d\d \|$"
        assert re.search(row, done.stdout, re.M), done.stdout
    assert re.search(r"^side by side, off / on: x\d+\.\d\d$", done.stdout, re.M), done.stdout
    with pytest.raises(SystemExit):
        from loomllm.benchmarks.cpu_contention import main

        main(["--engines", "1"])


def test_decode_profile_sorts_kernels_by_kind_and_refuses_unknown_runs() -> None:
    from loomllm.benchmarks.decode_profile import kernel_kind

    assert kernel_kind("nvjet_tst_128x64_64x8_2x1_v_bz_coopB_TNT") == "GEMM (cuBLAS)"
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64") == (
        "GEMM (cuBLAS)"
    )
    assert kernel_kind("_decode_split_kernel") == "attention"
    copy = "void at::native::elementwise_kernel<128, 4, at::native::direct_copy_kernel_cuda>"
    assert kernel_kind(copy) == "copy or transpose"
    assert kernel_kind("_add_rms_norm_kernel") == "loomllm's Triton"
    assert kernel_kind("void at::native::index_elementwise_kernel<128, 4>") == "other"
    done = loom("bench", "kernel", "decode-profile", "--device", "cpu", "--runs", "graphs,bogus")
    assert done.returncode == 2 and "--runs: bogus unknown" in done.stderr, done.stderr


def test_moe_benchmark_times_the_loop_and_grouped_mm_alike() -> None:
    done = loom(
        "bench",
        "kernel",
        "moe",
        "--hidden",
        "32",
        "--intermediate",
        "48",
        "--experts",
        "4",
        "--batch-sizes",
        "1,5",
        "--rounds",
        "2",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(r"^\| (\d+) \| [\d.]+ \| [\d.]+ \| x[\d.]+ \| (\S+) \|$", done.stdout, re.M)
    assert [r[0] for r in rows] == ["1", "5"], done.stdout
    assert all(float(diff) < 1e-5 for _, diff in rows)  # the same numbers both ways


def test_embed_benchmark_times_loomllm_and_sentence_transformers_alike() -> None:
    done = loom(
        "bench",
        "engine",
        "embed",
        "--texts",
        "6",
        "--min-tokens",
        "3",
        "--max-tokens",
        "9",
        "--rounds",
        "1",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(r"^\| (loomllm|sentence-transformers) \| [\d.]+ \|", done.stdout, re.M)
    assert rows == ["loomllm", "sentence-transformers"], done.stdout
    diff = re.search(r"max abs difference (\S+),", done.stdout)
    assert diff is not None and float(diff.group(1)) < 1e-4, done.stdout  # the same vectors


def test_benchmarks_are_grouped_and_a_member_takes_its_own_flags() -> None:
    """The engine's internals and the kernel micro-benchmarks are under a group each; the
    flags after a benchmark's name go to it, its --help included."""
    done = loom("bench", "kernel", "cpu-step", "--help")
    assert done.returncode == 0 and "usage: loom bench kernel cpu-step" in done.stdout
    done = loom("bench", "kernel", "overhead")
    assert done.returncode == 2 and "invalid choice: 'overhead'" in done.stderr
    done = loom("bench", "cpu-step")
    assert done.returncode == 2 and "invalid choice: 'cpu-step'" in done.stderr
