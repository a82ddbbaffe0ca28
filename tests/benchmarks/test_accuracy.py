"""`loom bench accuracy` (benchmarks/accuracy.py) and the llama-perplexity protocol it follows
(benchmarks/llama_perplexity.py): its output and base files read right, chunks scored as it
scores them, its KLD against a float64 reference, pairs by chunk, and a skip that says why."""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from loomllm.benchmarks import accuracy, cpu, llama_perplexity
from loomllm.benchmarks.serving import PeerFailed

BASE_RUN = """\
0.00.585.642 I perplexity: calculating perplexity over 24 chunks, n_ctx=512, batch_size=2048
[1]17.7365,[2]12.6063,[3]11.2305,
0.38.088.875 I Final estimate: PPL = 11.8478 +/- 0.40275
"""
KLD_RUN = """\
chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence
  24      11.8778 ±    0.4039       0.00252 ±    0.00103       0.00306 ±    0.00004

====== Perplexity statistics ======
Mean PPL(Q)                   :  11.877750 ±   0.403930
Mean PPL(base)                :  11.847828 ±   0.402754
Cor(ln(PPL(Q)), ln(PPL(base))):  99.95%

====== KL divergence statistics ======
Mean    KLD:   0.003055 ±   0.000038
Maximum KLD:   0.039815

====== Token probability statistics ======
Mean    Δp: -0.029 ± 0.019 %
RMS Δp    :  1.507 ± 0.028 %
Same top p: 96.830 ± 0.224 %
"""


def llama_cpp_record(logits: np.ndarray) -> np.ndarray:
    """One position's record as llama-perplexity writes it (perplexity.cpp's uint16
    log_softmax): scale and min log-prob, then each logit's steps above max - 16."""
    n_vocab = len(logits)
    logits = logits.astype(np.float32)
    top = logits.max()
    low = max(logits.min(), top - np.float32(16))
    log_sum_exp = np.float32(math.log(np.exp(logits - top, dtype=np.float64).sum()))
    scale = np.float32((top - low) / np.float32(65535))
    record = np.zeros(2 * ((n_vocab + 1) // 2) + 4, dtype="<u2")
    record[:4] = np.array([scale, low - top - log_sum_exp], dtype="<f4").view("<u2")
    if scale:  # all logits equal: every step stays 0
        steps = np.rint((logits - low) / scale)
        record[4 : 4 + n_vocab] = np.where(logits > low, steps, 0)
    return record


def write_base(path, tokens: np.ndarray, logits: np.ndarray) -> None:
    """A --kl-divergence-base file: tokens [n_chunk, n_ctx], logits [n_chunk, scored, V]."""
    n_chunk, n_ctx = tokens.shape
    with open(path, "wb") as f:
        f.write(b"_logits_")
        np.array([n_ctx, logits.shape[-1], n_chunk], dtype="<i4").tofile(f)
        tokens.astype("<i4").tofile(f)
        for chunk in logits:
            np.stack([llama_cpp_record(row) for row in chunk]).tofile(f)


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def test_chunks_are_scored_as_llama_perplexity_scores_them():
    # Each chunk's second half: logits at 256..510 predict tokens 257..511.
    assert (llama_perplexity.first_scored(512), llama_perplexity.num_scored(512)) == (256, 255)
    tokens = np.arange(10, 18, dtype=np.int32)  # n_ctx 8: positions 4, 5, 6 predict 5, 6, 7
    assert llama_perplexity.num_scored(8) == 3
    assert llama_perplexity.scored_targets(tokens).tolist() == [15, 16, 17]
    # BOS replaces the chunk's first token in what is fed, never in the tokens scored.
    assert llama_perplexity.chunk_input(tokens, 1).tolist() == [1, *range(11, 18)]
    assert llama_perplexity.chunk_input(tokens, None).tolist() == list(range(10, 18))
    assert tokens[0] == 10


def test_the_base_file_is_read_as_llama_cpp_writes_it(tmp_path):
    rng = np.random.default_rng(0)
    n_ctx, n_vocab = 8, 5  # an odd vocabulary: each record is padded to an even length
    tokens = rng.integers(0, n_vocab, size=(2, n_ctx), dtype=np.int32)
    logits = rng.normal(0, 4, size=(2, llama_perplexity.num_scored(n_ctx), n_vocab)).astype(
        np.float32
    )
    logits[1, 0, 3] = logits[1, 0].max() - 30  # below max - 16: stored at the floor
    path = tmp_path / "base.dat"
    write_base(path, tokens, logits)
    base = llama_perplexity.BaseFile.read(path)
    assert (base.n_ctx, base.n_vocab, base.n_chunk, base.record_len) == (8, 5, 2, 10)
    assert (base.tokens == tokens).all()
    for chunk in range(2):
        exact = log_softmax64(logits[chunk])
        decoded = base.log_probs(chunk)
        assert decoded.shape == (3, n_vocab)
        step = 16 / 65535
        kept = exact > exact.max(axis=1, keepdims=True) - 16
        assert np.abs(decoded - exact)[kept].max() < step
    assert base.log_probs(1)[0, 3] == pytest.approx(log_softmax64(logits[1, 0])[0:5].max() - 16)


def test_a_file_that_is_no_base_file_is_refused(tmp_path):
    path = tmp_path / "base.dat"
    path.write_bytes(b"GGUF" + bytes(40))
    with pytest.raises(ValueError, match="not a llama-perplexity log-probability file"):
        llama_perplexity.BaseFile.read(path)
    write_base(path, np.zeros((1, 4), np.int32), np.zeros((1, 1, 3), np.float32))
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(ValueError, match="its header says"):
        llama_perplexity.BaseFile.read(path)


def test_kld_and_perplexity_match_a_float64_reference(tmp_path):
    rng = np.random.default_rng(1)
    n_ctx, n_vocab = 16, 40
    tokens = rng.integers(0, n_vocab, size=(1, n_ctx), dtype=np.int32)
    reference = rng.normal(0, 3, size=(1, llama_perplexity.num_scored(n_ctx), n_vocab))
    model = reference + rng.normal(0, 0.3, size=reference.shape)  # a nearby distribution
    write_base(tmp_path / "base.dat", tokens, reference.astype(np.float32))
    base = llama_perplexity.BaseFile.read(tmp_path / "base.dat")
    targets = llama_perplexity.scored_targets(tokens[0])
    scores = llama_perplexity.Scores()
    log_q = log_softmax64(model[0])
    scores.add(log_q, targets, base.log_probs(0))

    log_p = log_softmax64(reference[0])
    exact_kld = (np.exp(log_p) * (log_p - log_q)).sum(axis=1)
    rows = np.arange(len(targets))
    assert scores.count == 7
    assert scores.mean_kld == pytest.approx(exact_kld.mean(), abs=2e-4)
    assert exact_kld.mean() > 0.01  # the tolerance is well below the figure
    assert scores.ppl == pytest.approx(math.exp(-log_q[rows, targets].mean()), rel=1e-12)
    assert scores.ppl_base == pytest.approx(math.exp(-log_p[rows, targets].mean()), rel=1e-3)
    same = (log_q.argmax(axis=1) == log_p.argmax(axis=1)).sum()
    assert scores.same_top == same


def test_kld_leaves_out_reference_tokens_below_its_floor():
    # Token 1's reference log-prob is -17: llama.cpp skips it, however unlikely the model
    # makes it; with the floor lower, the term would be e^-17 * 983.
    scores = llama_perplexity.Scores()
    scores.add(np.array([[0.0, -1000.0]]), np.array([0]), np.array([[0.0, -17.0]], np.float32))
    assert scores.mean_kld == 0.0 and scores.ppl == 1.0 and scores.same_top == 1


def test_torch_logits_become_float64_log_probabilities():
    logits = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    out = accuracy.log_softmax(logits)
    assert out.dtype == np.float64
    assert out == pytest.approx(log_softmax64(np.array([[1.0, 2.0, 3.0]])))


def test_llama_perplexity_output_is_parsed():
    assert llama_perplexity.parse_base_run(BASE_RUN) == 11.8478
    assert llama_perplexity.parse_kld_run(KLD_RUN) == llama_perplexity.PeerScores(
        ppl=11.87775,
        ppl_base=11.847828,
        kld=0.003055,
        kld_uncertainty=0.000038,
        same_top_fraction=pytest.approx(0.9683),
    )
    with pytest.raises(ValueError, match="Final estimate"):
        llama_perplexity.parse_base_run("[1]17.7365,")
    with pytest.raises(ValueError, match="Mean"):
        llama_perplexity.parse_kld_run(BASE_RUN)


def script(path, body: str):
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def test_a_failing_llama_perplexity_is_a_peer_failure(tmp_path):
    crash = script(tmp_path / "crash", "echo 'llama_model_load: loaded' >&2; kill -SEGV $$")
    with pytest.raises(PeerFailed) as exc:
        accuracy.llama_cpp_scores(crash, tmp_path / "m.gguf", tmp_path / "base.dat")
    assert str(exc.value) == "llama-perplexity failed: SIGSEGV (-11): llama_model_load: loaded"
    quiet = script(tmp_path / "quiet", "echo 'kl_divergence: computing'")
    with pytest.raises(PeerFailed, match="no 'Mean KLD' line in its output"):
        accuracy.llama_cpp_scores(quiet, tmp_path / "m.gguf", tmp_path / "base.dat")
    # Its summary goes to stderr: both streams are read.
    printed = script(tmp_path / "ok", f"cat >&2 <<'EOF'\n{BASE_RUN}EOF")
    text = tmp_path / "t.txt"
    assert (
        accuracy.llama_cpp_perplexity(printed, tmp_path / "m", text, tmp_path / "b", 4) == 11.8478
    )


def test_loomllm_runs_the_chunks_llama_cpp_ran(tmp_path, monkeypatch):
    """Each chunk is fed whole, BOS first; logits are kept at the scored positions only and
    scored against the tokens after them."""
    from loomllm.workers.models import loader

    rng = np.random.default_rng(2)
    n_ctx, n_vocab = 8, 6
    tokens = rng.integers(2, n_vocab, size=(2, n_ctx), dtype=np.int32)
    table = torch.tensor(rng.normal(0, 2, size=(n_vocab, n_vocab)), dtype=torch.float32)
    seen = []

    def model(input_ids, logits_to_keep):  # a bigram model: each token's row of `table`
        seen.append((input_ids.tolist(), logits_to_keep.tolist()))
        return SimpleNamespace(logits=table[input_ids[:, logits_to_keep]])

    def load_model(path, **options):
        assert (path, options) == ("m.gguf", {"dtype": "float32"})
        return SimpleNamespace(model=model, dtype="float32")

    monkeypatch.setattr(loader, "load_model", load_model)
    reference = np.stack([table.numpy()[chunk[4:7]] for chunk in tokens]) + 0.1
    write_base(tmp_path / "base.dat", tokens, reference)
    base = llama_perplexity.BaseFile.read(tmp_path / "base.dat")
    scores, dtype = accuracy.loomllm_scores("m.gguf", base, 1, dtype="float32")

    assert dtype == "float32"
    assert seen == [([[1, *tokens[c, 1:].tolist()]], [4, 5, 6]) for c in range(2)]
    expected = llama_perplexity.Scores()
    for c in range(2):
        log_q = log_softmax64(table.numpy()[tokens[c, 4:7]])
        expected.add(log_q, tokens[c, 5:].astype(np.int64), base.log_probs(c))
    assert (scores.count, scores.same_top) == (expected.count, expected.same_top) == (6, 6)
    assert (scores.nll, scores.kld) == pytest.approx((expected.nll, expected.kld), rel=1e-9)
    assert scores.mean_kld == pytest.approx(0, abs=1e-3)  # the same bigrams, shifted by 0.1


def chunked(*klds: float) -> llama_perplexity.Scores:
    """Scores of one token per chunk, with these KLDs."""
    scores = llama_perplexity.Scores(count=len(klds), kld=sum(klds), chunk_klds=list(klds))
    scores.nll = len(klds) * math.log(10.0)
    return scores


def test_kld_differences_are_paired_by_chunk():
    # The chunks' own spread (0.01 to 0.03) cancels: only the pairs' differences count.
    diff, error = llama_perplexity.kld_difference(
        chunked(0.011, 0.021, 0.032), chunked(0.01, 0.02, 0.03)
    )
    assert diff == pytest.approx(0.004 / 3)
    assert error == pytest.approx(np.std([0.001, 0.001, 0.002], ddof=1) / math.sqrt(3))


def test_llama_cpps_dumped_log_probs_are_scored_against_the_reference(tmp_path):
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 30, size=(2, 8), dtype=np.int32)
    reference = rng.normal(0, 3, size=(2, 3, 30))
    model = reference + rng.normal(0, 0.3, size=reference.shape)
    write_base(tmp_path / "ref.dat", tokens, reference)
    write_base(tmp_path / "model.dat", tokens, model)
    base = llama_perplexity.BaseFile.read(tmp_path / "ref.dat")
    scores = llama_perplexity.dumped_scores(
        base, llama_perplexity.BaseFile.read(tmp_path / "model.dat")
    )
    exact = [
        (np.exp(p) * (p - q)).sum(axis=1).mean()
        for p, q in zip(log_softmax64(reference), log_softmax64(model), strict=True)
    ]
    assert scores.chunk_klds == pytest.approx(exact, abs=3e-4)
    write_base(tmp_path / "other.dat", tokens[::-1], model)
    with pytest.raises(ValueError, match="holds other tokens"):
        llama_perplexity.dumped_scores(base, llama_perplexity.BaseFile.read(tmp_path / "other.dat"))


def test_the_targets_verdicts():
    assert (
        accuracy.verdicts(1.004, (-0.001, 0.0005)) == "PPL within 0.5%: yes; KLD ≤ llama.cpp's: yes"
    )
    assert accuracy.verdicts(0.994, (0.0009, 0.0005)).endswith(
        "no; KLD ≤ llama.cpp's: no, within 2 SE"
    )
    assert accuracy.verdicts(1.0, (0.0011, 0.0005)).endswith("KLD ≤ llama.cpp's: no")
    assert accuracy.verdicts(1.0, None) == "PPL within 0.5%: yes"


def test_loomllm_rows_show_the_ratio_and_the_paired_difference(capsys):
    ours = chunked(0.012, 0.022)
    accuracy.ours_row("q.gguf", "loomllm", ours, 10.05, chunked(0.01, 0.02))
    accuracy.ours_row("q.gguf", "loomllm", ours, 10.0, PeerFailed("llama-perplexity", "SIGSEGV"))
    accuracy.ours_row("q.gguf", "loomllm", ours, None, None)
    paired, failed, alone = capsys.readouterr().out.splitlines()
    assert paired == (
        "| q.gguf | loomllm | 10.0000 | 0.9950 | 0.017000 ± 0.000000 | +0.002000 ± 0.000000 | "
        "0.00% | PPL within 0.5%: yes; KLD ≤ llama.cpp's: no |"
    )
    assert failed.endswith("| 0.017000 ± 0.000000 |  | 0.00% | PPL within 0.5%: yes |")
    assert alone == "| q.gguf | loomllm | 10.0000 | — | 0.017000 ± 0.000000 |  | 0.00% |  |"


def test_the_cpu_benchmark_says_why_its_accuracy_part_is_skipped(tmp_path, monkeypatch, capsys):
    args = argparse.Namespace(llama_bench=tmp_path / "llama-bench")
    cpu.accuracy(args, tmp_path / "m.gguf", "bfloat16")
    assert "accuracy: skipped, no llama-perplexity at" in capsys.readouterr().out

    script(tmp_path / "llama-perplexity", "echo 'perplexity: tokenizing' >&2; kill -SEGV $$")
    monkeypatch.setattr(accuracy, "DEFAULT_REFERENCE", tmp_path / "missing-f32.gguf")
    cpu.accuracy(args, tmp_path / "m.gguf", "bfloat16")
    assert "run `make bench-models`" in capsys.readouterr().out

    monkeypatch.setattr(accuracy, "DEFAULT_REFERENCE", tmp_path / "m.gguf")
    (tmp_path / "m.gguf").write_bytes(b"")
    cpu.accuracy(args, tmp_path / "m.gguf", "bfloat16")
    out = capsys.readouterr().out
    assert (
        "accuracy: skipped, llama.cpp's reference run: llama-perplexity failed: SIGSEGV (-11): "
        "perplexity: tokenizing" in out
    )
