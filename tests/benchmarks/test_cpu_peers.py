"""`loom bench cpu` and `loom bench serving` with peers that fail: a row that says so, never a
traceback; and `--model` reaching every engine."""

from __future__ import annotations

import argparse
import shutil

import pytest

from loomllm.benchmarks import cpu, serving
from loomllm.benchmarks.serving import Level, PeerFailed
from loomllm.workers.models.sources import resolve_model


def script(path, body: str):
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def peers(tmp_path, llama_bench: str = "exit 0") -> list[str]:
    bench = script(tmp_path / "llama-bench", llama_bench)
    server = script(tmp_path / "llama-server", "exit 0")
    return ["--llama-bench", str(bench), "--llama-server", str(server)]


def test_llama_bench_killed_by_a_signal_is_a_peer_failure(tmp_path):
    crash = script(tmp_path / "llama-bench", "echo 'llama_model_load: loaded' >&2; kill -SEGV $$")
    with pytest.raises(PeerFailed) as exc:
        cpu.llama_bench(crash, tmp_path / "m.gguf", 128, 64)
    assert str(exc.value) == "llama-bench failed: SIGSEGV (-11): llama_model_load: loaded"
    garbage = script(tmp_path / "garbage", "echo '[{\"n_prompt\": 128'")
    with pytest.raises(PeerFailed, match="llama-bench failed: no figures in its output"):
        cpu.llama_bench(garbage, tmp_path / "m.gguf", 128, 64)


def test_exit_reasons_name_signals_and_statuses():
    assert serving.exit_reason(-11) == "SIGSEGV (-11)"
    assert serving.exit_reason(-6) == "SIGABRT (-6)"
    assert serving.exit_reason(3) == "exit status 3"
    assert serving.last_line("a\nb\n\n  \n") == "b"
    assert serving.last_line("x" * 300, limit=10) == "x" * 9 + "…"
    assert serving.failure_reason(-11, "\n") == "SIGSEGV (-11)"
    assert serving.failure_reason(1, "a\nerror: b\n") == "exit status 1: error: b"


def test_a_crashing_llama_bench_is_a_row_and_the_build_is_printed(tmp_path, monkeypatch, capsys):
    argv = peers(tmp_path, "kill -SEGV $$")
    seen = {}

    def single_stream(prompt, tokens, dtype, repeats, model):
        seen["model"], seen["max_id"] = model, max(prompt)
        return 0.5, 0.01

    monkeypatch.setattr(cpu.offline_throughput, "single_stream_loomllm", single_stream)
    monkeypatch.setattr(cpu.cpu_footprint, "plain_read", lambda path: (2_000_000_000, 0.04))
    ours = cpu.cpu_footprint.Footprint(
        5.0, 0.5, 0.2, 3 * 10**9, 2 * 10**9, 2 * 10**8, 10**9, 300.0, 512
    )
    monkeypatch.setattr(cpu.cpu_footprint, "loomllm_footprint", lambda path: ours)
    cpu.main([*argv, "--skip", "serving,offline,accuracy"])
    out = capsys.readouterr().out
    failed = "llama-bench failed: SIGSEGV (-11) | — |"
    assert f"| one stream, 128 tokens, tok/s | 100.0 | {failed}" in out
    assert f"| prompt of 512, tok/s | 300.0 | {failed}" in out
    assert f"| worker memory, GB (RSS) | 3.0 | {failed}" in out
    assert "the file's pages 1.00 GB, the KV cache, and 1.00 GB more" in out
    assert "\nllama.cpp build: " in out
    assert seen["model"] == "smollm2" and seen["max_id"] < 49152


def test_a_failed_llama_server_is_a_row_in_the_serving_part(tmp_path, monkeypatch, capsys):
    def compare(options, levels):
        assert options.model == "smollm2"
        ours = [Level(c, 8, 0, 50.0 * c, 10, 20, 30, 40) for c in levels]
        return {"loomllm": ours, "llama.cpp": PeerFailed("llama-server", "SIGSEGV (-11): x")}

    monkeypatch.setattr(cpu.serving, "compare", compare)
    (tmp_path / "guidellm").touch()
    argv = [*peers(tmp_path), "--guidellm", str(tmp_path / "guidellm")]
    cpu.main([*argv, "--skip", "stream,footprint,offline,accuracy", "--concurrency", "1,4"])
    out = capsys.readouterr().out
    failed = "llama-server failed: SIGSEGV (-11): x | — |"
    assert f"| serving c=1, output tok/s | 50.0 | {failed}" in out
    assert f"| serving c=4, output tok/s | 200.0 | {failed}" in out
    assert f"| serving c=4, ITL p50 ms (lower wins) | 20.0 | {failed}" in out


def test_compare_keeps_a_peers_failure_and_raises_loomllms(tmp_path, monkeypatch):
    failing = {"llama.cpp"}

    def measure(args, name, server, tokenizer, levels, workdir):
        if name in failing:
            raise PeerFailed(name, "SIGSEGV (-11): boom")
        return [Level(1, 8, 0, 50.0, 10, 20, 30, 40)]

    monkeypatch.setattr(serving, "measure", measure)
    monkeypatch.setattr(serving, "tokenizer_dir", lambda source, workdir: workdir)
    monkeypatch.setattr(serving, "serve_loom", lambda args, workdir: None)
    monkeypatch.setattr(serving, "serve_llama_cpp", lambda *args: None)
    args = argparse.Namespace(model="smollm2", skip_llama_cpp=False)
    results = serving.compare(args, [1])
    assert isinstance(results["llama.cpp"], PeerFailed) and results["loomllm"][0].requests == 8
    failing.add("loomllm")
    with pytest.raises(PeerFailed, match="loomllm failed"):
        serving.compare(args, [1])


def test_a_server_that_dies_at_start_is_its_exit_and_last_line(tmp_path):
    server = script(tmp_path / "llama-server", "echo 'main: loading model'; kill -SEGV $$")
    options = argparse.Namespace(llama_server=server, prompt_tokens=8, output_tokens=8)
    launched = serving.serve_llama_cpp(options, tmp_path / "m.gguf", 1, tmp_path)
    args = argparse.Namespace(guidellm=tmp_path / "guidellm")
    with pytest.raises(PeerFailed) as exc:
        serving.measure(args, "llama.cpp", launched, tmp_path, [1], tmp_path)
    assert str(exc.value) == "llama-server failed: SIGSEGV (-11): main: loading model"


def test_model_reaches_every_engine_and_skips_the_accuracy_part(tmp_path, monkeypatch, capsys):
    gguf = tmp_path / "other.gguf"
    shutil.copyfile(resolve_model("smollm2").path, gguf)
    models = []
    rows = (
        '[{"n_prompt": 128, "n_gen": 0, "avg_ts": 9.0}, {"n_prompt": 0, "n_gen": 8, "avg_ts": 5.0}]'
    )
    argv = peers(tmp_path, f"echo '{rows}'")

    def single_stream(prompt, tokens, dtype, repeats, model):
        models.append(("stream", model))
        return 0.5, 0.1

    def run_loomllm(prompts, tokens, dtype, model):
        models.append(("offline", model))
        return 1.0, 100

    def load_hf(dtype, model):
        models.append(("transformers", model))
        return "hf"

    monkeypatch.setattr(cpu.offline_throughput, "single_stream_loomllm", single_stream)
    monkeypatch.setattr(cpu.offline_throughput, "run_loomllm", run_loomllm)
    monkeypatch.setattr(cpu.offline_throughput, "load_hf", load_hf)
    monkeypatch.setattr(cpu.offline_throughput, "run_hf", lambda model, prompts, tokens: (2.0, 100))
    # 2 GB a token's step reads, read plainly in 0.04 s: 50 GB/s.
    monkeypatch.setattr(cpu.cpu_footprint, "plain_read", lambda path: (2_000_000_000, 0.04))
    cpu.main([*argv, "--model", str(gguf), "--skip", "serving,footprint", "--offline-rounds", "1"])
    out = capsys.readouterr().out
    assert models == [("stream", str(gguf)), ("transformers", str(gguf)), ("offline", str(gguf))]
    assert out.startswith("other.gguf (0.")
    assert "| one stream, 128 tokens, tok/s | 10.0 | 5.0 (llama-bench tg) | 2.00 |" in out
    row = "| one stream, weights read, GB/s | 20.0 | 50.0 (a plain 2-thread read of the same bytes)"
    assert f"{row} | 0.40 |" in out
    assert "accuracy: skipped, it runs on smollm2" in out


def test_a_model_that_is_not_a_gguf_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        cpu.main([*peers(tmp_path), "--model", str(tmp_path)])
    assert "--model must be a GGUF file" in capsys.readouterr().err
