"""`loom bench gpu-session`: a GPU session's steps within a time budget, their output kept."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from support.paths import REPO_ROOT

from loomllm.benchmarks.gpu_session import Step, run_steps, write_results

SLEEPER = """
import sys, time
print("started", flush=True)
try:
    time.sleep(60)
finally:
    print("cleaned up", flush=True)  # SIGINT lets a benchmark stop its manager
"""


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_steps_run_in_turn_until_the_budget_is_spent(tmp_path: Path) -> None:
    steps = [
        Step("fine", "", py("print('fine')"), needs_s=0),
        Step("broken", "", py("import sys; print('oops'); sys.exit(3)"), needs_s=0),
        Step("greedy", "", py("print('never')"), needs_s=3600),  # more than the budget
        Step("slow", "", py(SLEEPER), needs_s=0),
        Step("late", "", py("print('late')"), needs_s=0),
    ]
    seen = []
    run_steps(steps, tmp_path, budget_s=4, env=dict(os.environ), after=seen.append)
    fine, broken, greedy, slow, late = steps
    assert (fine.status, fine.output) == ("ok", "fine\n")
    assert (broken.status, broken.output) == ("failed (exit 3)", "oops\n")
    assert re.fullmatch(r"skipped: \d s left, needs 3600", greedy.status), greedy.status
    assert slow.status == "interrupted after 4 s" and 3 < slow.seconds < 15, slow
    lines = slow.output.splitlines()
    assert lines[:2] == ["started", "cleaned up"] and lines[-1] == "KeyboardInterrupt", lines
    assert late.status == "skipped: 0 s left, needs 0"
    assert seen == [fine, broken, slow]  # `after` once a step has run, not once skipped
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "01-fine.log",
        "02-broken.log",
        "04-slow.log",
    ]


def test_results_hold_each_step_and_every_log(tmp_path: Path) -> None:
    logs, out = tmp_path / "logs", tmp_path / "out"
    (logs / "start").mkdir(parents=True)
    out.mkdir()
    (logs / "start" / "worker.log").write_text("kv blocks")
    steps = [
        Step(
            "a",
            "the first",
            ["python", "-m", "x", "bench", "a", "--flag"],
            0,
            status="ok",
            seconds=12.4,
            output="| row |\n",
        ),
        Step("b", "the second", ["python"], 9, status="skipped: 1 s left, needs 9"),
    ]
    write_results(out, steps, ["- nproc: 16"], logs)
    text = (out / "summary.md").read_text()
    assert "- nproc: 16" in text and "| a | the first | ok | 12 |" in text
    assert "| b | the second | skipped: 1 s left, needs 9 | 0 |" in text
    assert "## a: ok\n\n`bench a --flag`\n\n```\n| row |\n```" in text and "## b" not in text
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "logs/start/worker.log" in tar.getnames()


@pytest.mark.compute
def test_session_runs_a_real_step_and_refuses_unknown_ones(tmp_path: Path) -> None:
    """End to end on the CPU at the tiny shape: the start step, its worker logs kept."""
    cmd = [
        sys.executable,
        "benchmarks/gpu_session.py",
        "--device",
        "cpu",
        "--big",
        "tiny",
        "--small",
        "tiny",
        "--out",
        str(tmp_path),
        "--wheels",
        str(tmp_path / "none"),
    ]
    done = subprocess.run(
        [*cmd, "--steps", "start"], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert re.search(r"^\| start \| .* \| ok \| \d+ \|$", done.stdout, re.M), done.stdout
    assert "| cold | auto | False |" in (tmp_path / "summary.md").read_text()
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        assert any(n.startswith("logs/start/auto/") for n in tar.getnames()), tar.getnames()
    done = subprocess.run(
        [*cmd, "--steps", "start,bogus"], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT
    )
    assert done.returncode == 2 and "unknown steps ['bogus']" in done.stderr


def test_the_attention_steps_fastest_tiling_runs_in_the_steps_after_it(tmp_path: Path) -> None:
    from loomllm.benchmarks.gpu_session import BEST_TILING, plan, take_best_tiling

    names = [s.name for s in plan("cuda", "llama-8b", "qwen-0.5b", tmp_path, tmp_path)]
    assert names.index("check") < names.index("attention") < names.index("throughput")
    assert names.index("throughput") < names.index("seqs-512")
    env: dict[str, str] = {}
    attention = Step("attention", "", [], 0)
    assert take_best_tiling(attention, tmp_path, env) == [] and env == {}  # it wrote none
    (tmp_path / BEST_TILING).write_text("32x8x2\n")
    assert take_best_tiling(Step("check", "", [], 0), tmp_path, env) == [] and env == {}
    assert take_best_tiling(attention, tmp_path, env) == [
        "- decode tiling from the attention step on: 32x8x2"
    ]
    assert env == {"LOOM_DECODE_TILING": "32x8x2"}


def test_the_check_step_leaves_out_the_checks_it_is_told_to(tmp_path: Path) -> None:
    from loomllm.benchmarks.gpu_session import plan

    def check_argv(**options: str) -> list[str]:
        steps = plan("cuda", "llama-8b", "qwen-0.5b", tmp_path, tmp_path, **options)
        return next(s.argv for s in steps if s.name == "check")

    assert "--skip" not in check_argv()
    assert check_argv(check_skip="kernels,lora")[-2:] == ["--skip", "kernels,lora"]
