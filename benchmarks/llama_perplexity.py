"""llama.cpp's `llama-perplexity` in Python: its chunks and the tokens it scores, its
--kl-divergence-base files, its perplexity and KLD sums, and the figures it prints.

Pure (numpy only): `loom bench accuracy` (accuracy.py) runs the engines over it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

N_CTX = 512  # llama-perplexity's default context: the chunks' length
# llama.cpp's KLD sums the reference's tokens above this log-probability only.
KLD_LOG_PROB_FLOOR = -16.0
MAGIC = b"_logits_"  # a --kl-divergence-base file's first bytes


def first_scored(n_ctx: int) -> int:
    """The first position whose logits are scored: each chunk's second half, so every scored
    token has at least n_ctx / 2 tokens of context."""
    return n_ctx // 2


def num_scored(n_ctx: int) -> int:
    """Tokens scored per chunk: logits at positions first..n_ctx-2 predict the next token."""
    return n_ctx - 1 - first_scored(n_ctx)


def chunk_input(tokens: np.ndarray, bos_id: int | None) -> np.ndarray:
    """A chunk's tokens as llama.cpp feeds them: its first replaced by BOS where the vocabulary
    adds one (bos_id not None)."""
    ids = np.array(tokens, dtype=np.int64)
    if bos_id is not None:
        ids[0] = bos_id
    return ids


def scored_targets(tokens: np.ndarray) -> np.ndarray:
    """The tokens a chunk's scored logits predict: the original ones, never the BOS."""
    first = first_scored(len(tokens))
    return np.asarray(tokens[first + 1 :], dtype=np.int64)


@dataclass(frozen=True, slots=True)
class BaseFile:
    """llama-perplexity's --kl-divergence-base file: "_logits_", n_ctx (uint32), n_vocab and
    n_chunk (int32), the n_chunk * n_ctx evaluated tokens (int32, BOS not substituted), then
    for each chunk its num_scored(n_ctx) scored positions, each one record of
    `record_len` uint16: scale and min log-prob (two float32), then one uint16 per token:
    log p = scale * q + min (tokens below max - 16 logits, and padding, are q = 0)."""

    path: Path
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray  # [n_chunk, n_ctx] int32

    @classmethod
    def read(cls, path: Path) -> BaseFile:
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise ValueError(f"{path} is not a llama-perplexity log-probability file")
            header = np.fromfile(f, dtype="<i4", count=3)
            n_ctx, n_vocab, n_chunk = (int(v) for v in header)
            tokens = np.fromfile(f, dtype="<i4", count=n_chunk * n_ctx)
        if len(tokens) != n_chunk * n_ctx:
            raise ValueError(f"{path} ends inside its tokens")
        base = cls(path, n_ctx, n_vocab, n_chunk, tokens.reshape(n_chunk, n_ctx))
        expected = base.offset(n_chunk)
        if path.stat().st_size != expected:
            raise ValueError(f"{path} has {path.stat().st_size} bytes, its header says {expected}")
        return base

    @property
    def record_len(self) -> int:
        return 2 * ((self.n_vocab + 1) // 2) + 4

    def offset(self, chunk: int) -> int:
        """Where chunk `chunk`'s records start, in bytes."""
        head = len(MAGIC) + 12 + 4 * self.tokens.size
        return head + 2 * chunk * num_scored(self.n_ctx) * self.record_len

    def log_probs(self, chunk: int) -> np.ndarray:
        """The reference's log-probabilities at chunk `chunk`'s scored positions, as llama.cpp
        decodes them: [num_scored, n_vocab] float32."""
        shape = (num_scored(self.n_ctx), self.record_len)
        records = np.fromfile(
            self.path, dtype="<u2", count=shape[0] * shape[1], offset=self.offset(chunk)
        )
        return decode_records(records.reshape(shape), self.n_vocab)


def decode_records(records: np.ndarray, n_vocab: int) -> np.ndarray:
    """[T, record_len] uint16 records → [T, n_vocab] float32 log-probabilities."""
    head = np.ascontiguousarray(records[:, :4]).view("<f4")  # [T, 2]: scale, min log-prob
    scale, floor = head[:, :1], head[:, 1:]
    return records[:, 4 : 4 + n_vocab].astype(np.float32) * scale + floor


@dataclass(slots=True)
class Scores:
    """Sums over scored tokens, as llama.cpp's kl_divergence keeps them: the model's NLL, the
    reference's NLL, KL(reference || model) per token, and how often their top tokens agree;
    and each chunk's mean KLD, to pair two models' chunks."""

    count: int = 0
    nll: float = 0.0
    nll_base: float = 0.0
    kld: float = 0.0
    kld2: float = 0.0
    same_top: int = 0
    chunk_klds: list[float] = field(default_factory=list)

    def add(self, log_probs: np.ndarray, targets: np.ndarray, base: np.ndarray) -> None:
        """One chunk: the model's log-probabilities [T, V] (float64), the tokens they score
        [T], the reference's log-probabilities [T, V]."""
        rows = np.arange(len(targets))
        base = base.astype(np.float64)
        self.nll -= float(log_probs[rows, targets].sum())
        self.nll_base -= float(base[rows, targets].sum())
        kept = base > KLD_LOG_PROB_FLOOR
        terms = np.where(kept, np.exp(base) * (base - log_probs), 0.0)
        per_token = terms.sum(axis=1)
        self.kld += float(per_token.sum())
        self.kld2 += float((per_token**2).sum())
        self.chunk_klds.append(float(per_token.mean()))
        self.same_top += int((log_probs.argmax(axis=1) == base.argmax(axis=1)).sum())
        self.count += len(targets)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def ppl_base(self) -> float:
        return math.exp(self.nll_base / self.count)

    @property
    def mean_kld(self) -> float:
        return self.kld / self.count

    @property
    def kld_uncertainty(self) -> float:
        """The standard error of the mean KLD, as llama.cpp prints it after ±."""
        variance = self.kld2 / self.count - self.mean_kld**2
        return math.sqrt(variance / (self.count - 1)) if variance > 0 and self.count > 10 else 0.0

    @property
    def same_top_fraction(self) -> float:
        return self.same_top / self.count


def kld_difference(ours: Scores, theirs: Scores) -> tuple[float, float]:
    """(our mean KLD less theirs, its standard error) over the same chunks, paired by chunk:
    the text's hard and easy chunks move both alike, so the pairs' spread is what is left."""
    diffs = np.subtract(ours.chunk_klds, theirs.chunk_klds)
    error = float(diffs.std(ddof=1)) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
    return ours.mean_kld - theirs.mean_kld, error


def dumped_scores(base: BaseFile, dump: BaseFile) -> Scores:
    """The scores of the model whose log-probs llama.cpp dumped, against the reference's: its
    per-chunk KLDs, for pairing (its mean differs from llama.cpp's own by the dump's 16 bits)."""
    if not np.array_equal(base.tokens, dump.tokens):
        raise ValueError(f"{dump.path} holds other tokens than {base.path}")
    scores = Scores()
    for chunk, tokens in enumerate(base.tokens):
        log_probs = dump.log_probs(chunk).astype(np.float64)
        scores.add(log_probs, scored_targets(tokens), base.log_probs(chunk))
    return scores


@dataclass(frozen=True, slots=True)
class PeerScores:
    """llama-perplexity --kl-divergence's summary, as it printed it."""

    ppl: float
    ppl_base: float
    kld: float
    kld_uncertainty: float
    same_top_fraction: float


NUMBER = r"(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"


def parse_base_run(output: str) -> float:
    """The perplexity in llama-perplexity's "Final estimate: PPL = 11.8478 +/- 0.40275"."""
    found = re.search(rf"Final estimate: PPL = {NUMBER}", output)
    if found is None:
        raise ValueError("no 'Final estimate: PPL = …' line")
    return float(found.group(1))


def parse_kld_run(output: str) -> PeerScores:
    """The figures of llama-perplexity --kl-divergence's summary."""

    def figure(name: str, label: str, unit: str = "") -> re.Match:
        found = re.search(rf"^{label}\s*:\s*{NUMBER}\s*±\s*{NUMBER}\s*{unit}", output, re.M)
        if found is None:
            raise ValueError(f"no {name!r} line")
        return found

    kld = figure("Mean KLD", r"Mean\s+KLD")
    return PeerScores(
        ppl=float(figure("Mean PPL(Q)", r"Mean PPL\(Q\)").group(1)),
        ppl_base=float(figure("Mean PPL(base)", r"Mean PPL\(base\)").group(1)),
        kld=float(kld.group(1)),
        kld_uncertainty=float(kld.group(2)),
        same_top_fraction=float(figure("Same top p", "Same top p", "%").group(1)) / 100,
    )
