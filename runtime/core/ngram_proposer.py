"""Speculative decoding's n-gram proposer (vLLM's method "ngram", prompt lookup): it drafts the
tokens that followed the last earlier occurrence of the sequence's own ending."""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """One request's n-grams (n_min to n_max tokens) by where they last ended, indexed as
    its tokens grow, so that a proposal costs O(n_max), not a scan of the sequence."""

    __slots__ = ("n_min", "n_max", "_ends", "_indexed")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self._indexed = 0  # n-grams ending before this position are in _ends

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens: for the longest n whose last n tokens occurred earlier, those
        that followed the most recent earlier occurrence. None found: []."""
        size = len(tokens)
        # Index the n-grams that end before the last token: each has a token after it.
        for end in range(self._indexed, size):
            for n, ends in self._ends.items():
                if end >= n:
                    ends[tuple(tokens[end - n : end])] = end
        self._indexed = size
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            found = self._ends[n].get(tuple(tokens[size - n :]))
            if found is not None:
                return list(tokens[found : found + k])
        return []


def propose_ngram(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """NgramIndex.propose for a sequence seen once (a fresh index)."""
    return NgramIndex(n_min, n_max).propose(tokens, k)
