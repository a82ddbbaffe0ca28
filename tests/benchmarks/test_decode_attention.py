"""`loom bench kernel decode-attention`: each tiling timed and checked, the fastest written out."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from loomllm.workers.attention.triton_kernels import AttentionTiling

pytestmark = pytest.mark.compute


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loomllm.cli.main", "bench", "kernel", "decode-attention", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_tiling_is_timed_and_checked_on_the_cpu(tmp_path: Path) -> None:
    """In Triton's interpreter (TRITON_INTERPRET=1 from conftest.py): a table a batch size,
    each tiling's error against float64, and the fastest over both written for a session."""
    best = tmp_path / "best.txt"
    done = bench(
        "--device",
        "cpu",
        "--shape",
        "tiny",
        "--batch-sizes",
        "2,3",
        "--contexts",
        "20-50",
        "--tilings",
        "16x4x3,32x4x2",
        "--best-to",
        str(best),
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = re.findall(
        r"^\| (\d+x\d+x\d+)[^|]* \| ([\d.]+) \| \d+ \| ([\d.]+) \| (\S+) \|$", done.stdout, re.M
    )
    assert [r[0] for r in rows] == ["16x4x3", "32x4x2"] * 2, done.stdout
    assert all(float(error) < 1e-2 and float(ms) > 0 for _, ms, _, error in rows)
    assert re.findall(r"^batch (\d+): fastest", done.stdout, re.M) == ["2", "3"]
    assert AttentionTiling.parse(best.read_text()) in (
        AttentionTiling(16, 4, 3),
        AttentionTiling(32, 4, 2),
    )


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--tilings", "48x4x2", "keys must be a power of two >= 16, got 48"),
        ("--tilings", "64x4", "tilings are keys x warps x stages"),
        ("--contexts", "50-20", "needs 1 <= LOW <= HIGH"),
        ("--contexts", "20", "a context range is LOW-HIGH"),
    ],
)
def test_bad_tilings_and_ranges_are_refused(flag: str, value: str, message: str) -> None:
    done = bench("--device", "cpu", flag, value)
    assert done.returncode == 2 and message in done.stderr, done.stderr
