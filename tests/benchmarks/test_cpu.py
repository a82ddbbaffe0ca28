"""`loom bench cpu`: its peers' output read right, its offline runs alternated, and a clear
refusal without the peers."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from loomllm.benchmarks import cpu, serving


def test_llama_bench_rows_are_read(tmp_path):
    rows = [
        {"n_prompt": 128, "n_gen": 0, "avg_ts": 400.5},
        {"n_prompt": 0, "n_gen": 128, "avg_ts": 170.25},
    ]
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!/bin/sh\ncat <<'EOF'\n{json.dumps(rows)}\nEOF\n")
    fake.chmod(0o755)
    assert cpu.llama_bench(fake, tmp_path / "m.gguf", 128, 128) == (400.5, 170.25)


def test_without_its_peers_it_says_how_to_get_them():
    done = subprocess.run(
        [sys.executable, "-m", "loomllm.cli.main", "bench", "cpu", "--llama-bench", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "make bench-peers" in done.stderr


def test_llama_server_gets_the_extra_flags_after_its_own(tmp_path):
    # A flag given last wins: a run can turn one of llama-server's own off.
    fake = tmp_path / "llama-server"
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    options = argparse.Namespace(llama_server=fake, prompt_tokens=8, output_tokens=8)
    proc, _, log = serving.serve_llama_cpp(
        options, tmp_path / "m.gguf", 1, tmp_path, ("-fa", "off")
    )
    assert proc.wait(timeout=30) == 0
    words = log.read_text().split()
    assert words[:2] == ["-m", str(tmp_path / "m.gguf")] and words[-2:] == ["-fa", "off"]


def test_offline_runs_alternate_and_the_row_shows_each_engines_median(
    tmp_path, monkeypatch, capsys
):
    """Each round runs loomllm, then transformers, on the same prompts; the row holds the
    medians and every run is printed below it."""
    runs: list[str] = []
    ours = iter([100.0, 300.0, 200.0])
    theirs = iter([50.0, 90.0, 70.0])

    def run_loomllm(prompts, output_len, dtype, model):
        assert model == "smollm2"
        runs.append("loomllm")
        return 64 * output_len / next(ours), 64 * output_len

    def run_hf(model, prompts, output_len):
        assert model == "model"
        runs.append("transformers")
        return 64 * output_len / next(theirs), 64 * output_len

    monkeypatch.setattr(cpu.offline_throughput, "run_loomllm", run_loomllm)
    monkeypatch.setattr(cpu.offline_throughput, "run_hf", run_hf)
    monkeypatch.setattr(cpu.offline_throughput, "load_hf", lambda dtype, model: "model")
    peers = []
    for name in ("llama-bench", "llama-server"):
        peers += [f"--{name}", str(tmp_path / name)]
        (tmp_path / name).touch()
    cpu.main([*peers, "--skip", "stream,footprint,serving,accuracy", "--offline-rounds", "3"])
    assert runs == ["loomllm", "transformers"] * 3
    out = capsys.readouterr().out
    assert "| offline 64 x 128, tok/s (median of 3 alternated runs) | 200.0 | 70.0 (" in out
    assert "| 2.86 |" in out
    assert "100.0 / 50.0 = 2.00, 300.0 / 90.0 = 3.33, 200.0 / 70.0 = 2.86" in out


def test_offline_rounds_below_one_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        cpu.main(["--offline-rounds", "0"])
    assert exc.value.code == 2
    assert "--offline-rounds must be at least 1, got 0" in capsys.readouterr().err
