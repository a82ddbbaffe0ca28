"""DecodeGraphs: decode-only steps replayed from CUDA graphs captured at bucketed batch sizes.

Eager PyTorch spends more host time launching a small decode step's kernels than the GPU runs.
"""

from __future__ import annotations

from typing import Any

import torch

from loomllm.workers.attention.metadata import PagedBatch, split_counters
from loomllm.workers.runner.step_graphs import StepGraphs, smallest_holding

MAX_CAPTURE_SIZE = 512  # vLLM's default cap: larger decode batches run eager


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below max_num_seqs (capped at MAX_CAPTURE_SIZE), then that cap."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [1 << i for i in range(top.bit_length()) if 1 << i < top]
    return [*sizes, top]


class DecodeGraphs(StepGraphs):
    """One captured graph per batch-size bucket: packed token i is decode row i. Steps with
    prompts or prompt logprobs, or wider than the largest bucket, run eager."""

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
    ) -> None:
        sizes = bucket_sizes(max_num_seqs)
        super().__init__(
            model,
            kv_caches,
            device=device,
            block_size=block_size,
            scratch_block=scratch_block,
            sizes=sizes,
        )
        self.max_blocks = max_blocks  # block-table width: the longest context the cache holds
        top = sizes[-1]
        self._scratch_block = scratch_block
        self.tables = self._buffer(top, max_blocks)
        self.lens = self._buffer(top)
        self.split_counts = split_counters(kv_caches, top, device)  # every replay zeroes them
        self.rows = torch.arange(top, device=device)  # decode row i is packed token i

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def bucket(self, num_decodes: int) -> int:
        return smallest_holding(self.sizes, num_decodes)

    def capture(self, pool: Any) -> None:
        """Capture every bucket in the memory pool `pool` (CUDA only)."""
        none = self.rows[:0]
        self._load_tokens(none, none, none)
        self._pad_rows(0)
        self._capture(self._forward, pool, "decode")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [n, V] of n decode rows (device tensors: ids, positions, slots [n];
        tables [n, w] int32 with w <= max_blocks; lens [n] int32)."""
        n, width = tables.shape
        self._load_tokens(input_ids, positions, slots)
        self.tables[:n, :width].copy_(tables)
        self.tables[:n, width:].zero_()
        self.lens[:n].copy_(lens)
        self._pad_rows(n)
        return self._replay(self.bucket(n))[:n]

    def _pad_rows(self, n: int) -> None:
        """Rows n.. attend over the scratch slot alone."""
        self.tables[n:].zero_()
        self.tables[n:, 0].fill_(self._scratch_block)
        self.lens[n:].fill_(1)

    def _forward(self, size: int) -> torch.Tensor:
        paged = PagedBatch(
            block_size=self.block_size,
            decode_tables=self.tables[:size],
            decode_lens=self.lens[:size],
            # The split-K is sized for the longest context the cache holds, because a graph
            # cannot change it per step; rows past their own length skip the empty splits.
            max_decode_len=self.max_blocks * self.block_size,
            prefill_tables=self.tables[:0],
            prefill_q_starts=self.lens[:0],
            prefill_q_lens=self.lens[:0],
            prefill_lens=self.lens[:0],
            prefill_tile_reqs=self.lens[:0],
            prefill_tile_firsts=self.lens[:0],
            decode_split_counts=self.split_counts,
        )
        return self._run_model(size, paged, self.rows[:size], self.rows[:size])
