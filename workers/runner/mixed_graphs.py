"""MixedGraphs: steps that compute prompt tokens beside decodes, replayed from CUDA graphs.

Eager, such a step costs the host a launch of every kernel of the model, however few its tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from loomllm.workers.attention.metadata import PagedBatch, max_tiles, prefill_tiles
from loomllm.workers.device.transfer import device_tensor
from loomllm.workers.runner.step_graphs import StepGraphs, smallest_holding

SMALL_BUCKET, SMALL_STEPS = 64, 512  # fine buckets where padding would cost most
LARGE_BUCKET = 256
# The engine's default largest step (chunked prefill); a small model's step of this many
# tokens is still host-bound, where a large model's is bound by its arithmetic either way.
MAX_MIXED_TOKENS = 2048


def token_buckets(max_tokens: int) -> list[int]:
    """64, 128, ... 512, then 768, 1024, ...: the first that holds `max_tokens` last
    (capped at MAX_MIXED_TOKENS)."""
    top = min(max_tokens, MAX_MIXED_TOKENS)
    sizes = list(range(SMALL_BUCKET, SMALL_STEPS + 1, SMALL_BUCKET))
    sizes += range(SMALL_STEPS + LARGE_BUCKET, MAX_MIXED_TOKENS + 1, LARGE_BUCKET)
    return sizes[: next(i for i, size in enumerate(sizes) if size >= top) + 1]


class MixedGraphs(StepGraphs):
    """One captured graph per token bucket, for steps with prompt tokens.

    With more requests waiting than slots, one is admitted each time one finishes, so many
    steps of a run are mixed. Every row, decodes too, goes through the prefill kernel from a
    tile list padded to the most the bucket can take, so the graph's grids are fixed. Steps
    with prompt logprobs run eager."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        device: torch.device,
        block_size: int,
        scratch_block: int,
        max_blocks: int,
        max_num_seqs: int,
        max_tokens: int = MAX_MIXED_TOKENS,
    ) -> None:
        sizes = token_buckets(max_tokens)
        super().__init__(
            model,
            kv_caches,
            device=device,
            block_size=block_size,
            scratch_block=scratch_block,
            sizes=sizes,
        )
        self.max_blocks = max_blocks
        top = sizes[-1]
        self.max_rows = min(max_num_seqs, top)
        self.tables = self._buffer(self.max_rows, max_blocks)
        self.q_starts = self._buffer(self.max_rows)
        self.q_lens = self._buffer(self.max_rows)
        self.seq_lens = self._buffer(self.max_rows)
        self.tile_reqs = self._buffer(max_tiles(top, self.max_rows))
        self.tile_firsts = self._buffer(max_tiles(top, self.max_rows))
        self.sample_rows = self._buffer(self.max_rows, dtype=torch.long)

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def fits(self, num_tokens: int, num_rows: int, widest_table: int) -> bool:
        """Whether a step of these tokens, rows and widest block table fits a bucket."""
        if num_tokens > self.max_tokens or widest_table > self.max_blocks:
            return False
        return num_rows <= self._rows(smallest_holding(self.sizes, num_tokens))

    def _rows(self, size: int) -> int:
        return min(self.max_rows, size)

    def capture(self, pool: Any) -> None:
        """Capture every bucket in the memory pool `pool` (CUDA only)."""
        none = self.sample_rows[:0]
        self._load_tokens(none, none, none)
        self._pad_rows(0, 0)
        self.tile_reqs.fill_(-1)
        # Every graph writes its logits into this one buffer, because a graph's own output
        # stays allocated as long as the graph, [rows, vocab] for each bucket, while a step
        # uses one at a time.
        like = self._forward(self.sizes[-1])
        logits = torch.empty((self.max_rows, like.shape[-1]), dtype=like.dtype, device=like.device)
        del like

        def run(size: int) -> torch.Tensor:
            return logits[: self._rows(size)].copy_(self._forward(size))

        self._capture(run, pool, "mixed-step")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: list[int],
        slots: torch.Tensor,
        tables: list[list[int]],
        q_starts: list[int],
        q_lens: list[int],
        seq_lens: list[int],
        sample_idx: list[int],
    ) -> torch.Tensor:
        """Logits [len(sample_idx), V] of a step of n packed tokens (input_ids and slots:
        device tensors [n]) whose rows (requests) have these block tables, first token in
        the batch, token counts and context lengths (this step's tokens included)."""
        n, rows, samples = len(positions), len(tables), len(sample_idx)
        size = smallest_holding(self.sizes, n)
        width = max(len(t) for t in tables)
        dev = self.device
        self._load_tokens(input_ids, device_tensor(positions, torch.long, dev), slots)
        padded = [blocks + [0] * (width - len(blocks)) for blocks in tables]
        self.tables[:rows, :width].copy_(device_tensor(padded, torch.int32, dev))
        self.tables[:rows, width:].zero_()
        for buf, values in (
            (self.q_starts, q_starts),
            (self.q_lens, q_lens),
            (self.seq_lens, seq_lens),
        ):
            buf[:rows].copy_(device_tensor(values, torch.int32, dev))
        num_tiles = max_tiles(size, self._rows(size))
        tile_reqs, tile_firsts = prefill_tiles(q_lens, num_tiles)
        self.tile_reqs[:num_tiles].copy_(device_tensor(tile_reqs, torch.int32, dev))
        self.tile_firsts[:num_tiles].copy_(device_tensor(tile_firsts, torch.int32, dev))
        self.sample_rows[:samples].copy_(device_tensor(sample_idx, torch.long, dev))
        self._pad_rows(rows, samples)
        return self._replay(size)[:samples]

    def _pad_rows(self, num_rows: int, num_samples: int) -> None:
        """Rows from num_rows have no tiles (no tile reads the padded tokens); sampling
        rows from num_samples read token 0."""
        self.tables[num_rows:].zero_()
        self.q_lens[num_rows:].zero_()
        self.seq_lens[num_rows:].zero_()
        self.sample_rows[num_samples:].zero_()

    def _forward(self, size: int) -> torch.Tensor:
        rows = self._rows(size)
        tiles = max_tiles(size, rows)
        none = self.q_lens[:0]
        paged = PagedBatch(
            block_size=self.block_size,
            decode_tables=self.tables[:0],
            decode_lens=none,
            max_decode_len=0,
            prefill_tables=self.tables[:rows],
            prefill_q_starts=self.q_starts[:rows],
            prefill_q_lens=self.q_lens[:rows],
            prefill_lens=self.seq_lens[:rows],
            prefill_tile_reqs=self.tile_reqs[:tiles],
            prefill_tile_firsts=self.tile_firsts[:tiles],
            decode_split_counts=none,
        )
        return self._run_model(size, paged, self.sample_rows[:0], self.sample_rows[:rows])
