"""loomllm's and llama.cpp's perplexity and KL divergence, as `llama-perplexity` measures them.

Both engines run the same tokens and are held to one float32 reference (`loom bench accuracy`).

Run `make bench-peers` and `make bench-models` first. The text is Python's own reference
manual (`pydoc_data.topics`, which every CPython carries), its topics in sorted order; the
protocol itself is llama_perplexity.py's.
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from loomllm.benchmarks import serving
from loomllm.benchmarks.llama_perplexity import (
    N_CTX,
    BaseFile,
    PeerScores,
    Scores,
    chunk_input,
    dumped_scores,
    first_scored,
    kld_difference,
    num_scored,
    parse_base_run,
    parse_kld_run,
    scored_targets,
)
from loomllm.benchmarks.serving import PeerFailed

PROG = "loom bench accuracy"
DEFAULT_PERPLEXITY = serving.DEFAULT_LLAMA_SERVER.with_name("llama-perplexity")
MODELS = serving.PEERS / "models"
# SmolLM2-135M's shipped Q4_1 dequantized by llama-quantize, and two requantizations of it.
DEFAULT_REFERENCE = MODELS / "smollm2-135m-f32.gguf"
DEFAULT_MODELS = (
    "smollm2",
    str(MODELS / "smollm2-135m-q4_k_m.gguf"),
    str(MODELS / "smollm2-135m-q6_k.gguf"),
)
DEFAULT_CHUNKS = 24
MAX_PPL_RATIO_GAP = 0.005  # the target: loomllm's perplexity within 0.5% of llama.cpp's


def reference_text() -> str:
    """Python's reference manual as pydoc shows it: real English, the same on every machine
    with this Python version."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def log_softmax(logits) -> np.ndarray:
    """[T, V] torch logits → float64 log-probabilities (numpy)."""
    return logits.double().log_softmax(-1).numpy()


def run_peer(cmd: Sequence[str], parse):
    """Run llama-perplexity and parse what it printed (stdout and stderr: its summary goes to
    both); PeerFailed where it fails or prints no figures."""
    done = subprocess.run(list(cmd), capture_output=True, text=True, errors="replace")
    output = done.stdout + "\n" + done.stderr
    if done.returncode != 0:
        raise PeerFailed("llama-perplexity", serving.failure_reason(done.returncode, done.stderr))
    try:
        return parse(output)
    except ValueError as exc:
        reason = f"{exc} in its output: {serving.last_line(output)}"
        raise PeerFailed("llama-perplexity", reason) from exc


def llama_cpp_perplexity(
    binary: Path, gguf: Path, text: Path, dump: Path, chunks: int, n_ctx: int = N_CTX
) -> float:
    """llama.cpp's perplexity of `gguf` over `text`, its log-probs written to `dump` (the
    reference's are the KLD runs' base)."""
    cmd = [str(binary), "-m", str(gguf), "-f", str(text), "-c", str(n_ctx), "-t", "2"]
    cmd += ["--chunks", str(chunks), "--kl-divergence-base", str(dump)]
    return run_peer(cmd, parse_base_run)


def llama_cpp_scores(binary: Path, gguf: Path, base: Path) -> PeerScores:
    """llama.cpp's perplexity of `gguf` and its KLD to the reference in `base`."""
    cmd = [str(binary), "-m", str(gguf), "--kl-divergence-base", str(base), "--kl-divergence"]
    return run_peer([*cmd, "-t", "2"], parse_kld_run)


def bos_to_add(gguf: Path, base: BaseFile) -> int | None:
    """The BOS id llama.cpp put first in each chunk, or None: it tokenizes the text with its
    vocabulary's specials, so its stream starts with BOS exactly where the vocabulary adds
    one (the text's own tokens are never parsed as specials)."""
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get("tokenizer.ggml.bos_token_id")
    bos_id = None if field is None else int(field.parts[field.data[0]][0])
    return bos_id if bos_id is not None and int(base.tokens[0, 0]) == bos_id else None


def loomllm_scores(model: str, base: BaseFile, bos_id: int | None, **options) -> tuple[Scores, str]:
    """loomllm's model, loaded in-process with `options` (load_model's), over the chunks of
    `base`: (its scores against the reference, the dtype it ran in). Its logits are kept at
    the scored positions only, one chunk at a time."""
    import torch

    from loomllm.workers.models.loader import load_model

    loaded = load_model(model, **options)
    n_ctx = base.n_ctx
    keep = torch.arange(first_scored(n_ctx), n_ctx - 1)
    scores = Scores()
    with torch.inference_mode():
        for chunk, tokens in enumerate(base.tokens):
            ids = torch.from_numpy(chunk_input(tokens, bos_id))[None]
            logits = loaded.model(input_ids=ids, logits_to_keep=keep).logits[0]  # [T, V]
            scores.add(log_softmax(logits), scored_targets(tokens), base.log_probs(chunk))
            del logits
    dtype = loaded.dtype
    del loaded
    gc.collect()
    return scores, dtype


def tokens_match(model: str, text: str, base: BaseFile) -> int:
    """How many of llama.cpp's chunks loomllm's tokenizer (the GGUF's own) gives identically,
    with special tokens added as llama.cpp adds them."""
    from loomllm.text.tokenizer import Tokenizer
    from loomllm.workers.models.sources import prepare_model_dir, resolve_model

    tokenizer = Tokenizer.from_model_dir(prepare_model_dir(resolve_model(model)))
    ids = tokenizer.encode(text.removesuffix("\n"))  # llama-perplexity -f drops one "\n"
    ours = np.array(ids[: base.tokens.size], dtype=np.int32)
    if len(ours) < base.tokens.size:
        return 0
    return int((ours.reshape(base.tokens.shape) == base.tokens).all(axis=1).sum())


def verdicts(ratio: float, paired: tuple[float, float] | None) -> str:
    """The targets' cell: perplexity within 0.5% of llama.cpp's; mean KLD no larger than its
    own, "within 2 SE" where the excess is inside twice the pairs' standard error."""
    cells = [f"PPL within 0.5%: {'yes' if abs(ratio - 1) <= MAX_PPL_RATIO_GAP else 'no'}"]
    if paired is not None:
        diff, error = paired
        kld = "yes" if diff <= 0 else "no, within 2 SE" if diff <= 2 * error else "no"
        cells.append(f"KLD ≤ llama.cpp's: {kld}")
    return "; ".join(cells)


def row(name: str, engine: str, ppl: str, *cells: str) -> None:
    """One line of the table; `cells` from its fourth column on."""
    print(f"| {name} | {engine} | {ppl} | {' | '.join(cells)} |", flush=True)


def ours_row(
    name: str,
    engine: str,
    scores: Scores,
    peer_ppl: float | None,
    theirs: Scores | PeerFailed | None,
) -> None:
    """loomllm's row: against llama.cpp's perplexity `peer_ppl`, and its KLD paired with
    llama.cpp's dumped scores `theirs` (None: the reference, where no KLD is a target)."""
    kld = f"{scores.mean_kld:.6f} ± {scores.kld_uncertainty:.6f}"
    paired = kld_difference(scores, theirs) if isinstance(theirs, Scores) else None
    paired_cell = "" if paired is None else f"{paired[0]:+.6f} ± {paired[1]:.6f}"
    same = f"{100 * scores.same_top_fraction:.2f}%"
    if peer_ppl is None:
        row(name, engine, f"{scores.ppl:.4f}", "—", kld, paired_cell, same, "")
        return
    ratio = scores.ppl / peer_ppl
    targets = verdicts(ratio, paired)
    row(name, engine, f"{scores.ppl:.4f}", f"{ratio:.4f}", kld, paired_cell, same, targets)


HEADER = (
    "| file | engine | PPL | PPL / llama.cpp's | mean KLD to F32 | KLD − llama.cpp's, paired "
    "by chunk | same top token | targets |\n|---|---|---|---|---|---|---|---|"
)


def llama_cpp_model(
    binary: Path, gguf: Path, text: Path, base: BaseFile, dump: Path, chunks: int
) -> tuple[PeerScores | PeerFailed, Scores | PeerFailed]:
    """llama.cpp on one quantized model: its own KLD run's summary, and its dumped log-probs'
    scores (to pair with loomllm's, chunk by chunk); each a PeerFailed where it fails."""
    printed: PeerScores | PeerFailed
    dumped: Scores | PeerFailed
    try:
        printed = llama_cpp_scores(binary, gguf, base.path)
    except PeerFailed as exc:
        printed = exc
    try:
        llama_cpp_perplexity(binary, gguf, text, dump, chunks)
        dumped = dumped_scores(base, BaseFile.read(dump))
    except PeerFailed as exc:
        dumped = exc
    finally:
        dump.unlink(missing_ok=True)
    return printed, dumped


def compare(
    binary: Path,
    reference: Path,
    models: Iterable[str],
    chunks: int = DEFAULT_CHUNKS,
    dtypes: Sequence[str] = ("auto", "float32"),
) -> None:
    """The whole measurement, printed: llama.cpp's reference run, loomllm's dequantized float32
    against it, then on each model llama.cpp (its KLD run, and its log-probs dumped to pair
    with loomllm's) and loomllm (as stored, in each of `dtypes`). PeerFailed where llama.cpp's
    reference run fails (nothing is comparable then)."""
    from loomllm.workers.models.sources import resolve_model

    with tempfile.TemporaryDirectory(prefix="loom-bench-accuracy-") as tmp:
        text = reference_text()
        text_path, base_path = Path(tmp) / "text.txt", Path(tmp) / "base.dat"
        text_path.write_text(text, encoding="utf-8")
        ref_ppl = llama_cpp_perplexity(binary, reference, text_path, base_path, chunks)
        base = BaseFile.read(base_path)
        bos_id = bos_to_add(reference, base)
        same = tokens_match(str(reference), text, base)
        print(
            f"text: Python {sys.version.split()[0]}'s reference manual (pydoc_data.topics, "
            f"{len(text):,} characters); {base.n_chunk} chunks of {base.n_ctx} tokens, "
            f"{num_scored(base.n_ctx)} scored in each (its second half); BOS "
            f"{'first in each chunk' if bos_id is not None else 'not added'}; the tokens are "
            f"llama.cpp's (loomllm's tokenizer gives {same} of the {base.n_chunk} chunks alike)"
        )
        print(f"reference: {reference.name}, llama.cpp -c {base.n_ctx} -t 2; loomllm in-process")
        print(f"\n{HEADER}", flush=True)
        row(reference.name, "llama.cpp (the reference)", f"{ref_ppl:.4f}", "1", "0", "", "", "")
        dense, _ = loomllm_scores(
            str(reference), base, bos_id, dtype="float32", quantization="none"
        )
        ours_row(reference.name, "loomllm dequantized, float32", dense, ref_ppl, None)
        for model in models:
            gguf = Path(resolve_model(model).path)
            dump = Path(tmp) / "model.dat"
            printed, dumped = llama_cpp_model(binary, gguf, text_path, base, dump, chunks)
            if isinstance(printed, PeerFailed):
                row(gguf.name, str(printed), "", "", "", "", "", "")
            else:
                kld = f"{printed.kld:.6f} ± {printed.kld_uncertainty:.6f}"
                same_top = f"{100 * printed.same_top_fraction:.2f}%"
                paired = str(dumped) if isinstance(dumped, PeerFailed) else ""
                row(gguf.name, "llama.cpp", f"{printed.ppl:.4f}", "1", kld, paired, same_top, "")
            peer_ppl = None if isinstance(printed, PeerFailed) else printed.ppl
            for dtype in dtypes:
                scores, ran_in = loomllm_scores(model, base, bos_id, dtype=dtype)
                ours_row(gguf.name, f"loomllm as stored, {ran_in}", scores, peer_ppl, dumped)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--llama-perplexity", type=Path, default=DEFAULT_PERPLEXITY)
    p.add_argument(
        "--reference",
        type=Path,
        default=DEFAULT_REFERENCE,
        help="the float32 GGUF every model is held to (default: the shipped SmolLM2-135M "
        "dequantized by `make bench-models`)",
    )
    p.add_argument(
        "--models",
        type=lambda s: s.split(","),
        default=list(DEFAULT_MODELS),
        help="comma-separated GGUF files (or model names) with the reference's vocabulary "
        "(default: the shipped SmolLM2-135M Q4_1 and its Q4_K_M and Q6_K requantizations)",
    )
    p.add_argument("--chunks", type=int, default=DEFAULT_CHUNKS, help=f"chunks of {N_CTX} tokens")
    args = p.parse_args(argv)
    if args.chunks < 1:
        p.error(f"--chunks must be at least 1, got {args.chunks}")
    if not args.llama_perplexity.exists():
        sys.exit(f"no llama-perplexity at {args.llama_perplexity}: run `make bench-peers`")
    for path in [args.reference, *(Path(m) for m in args.models if m.endswith(".gguf"))]:
        if not path.exists():
            sys.exit(f"no {path}: run `make bench-models`")
    try:
        compare(args.llama_perplexity, args.reference, args.models, args.chunks)
    except PeerFailed as exc:
        sys.exit(f"llama.cpp's reference run: {exc}")


if __name__ == "__main__":
    main()
