"""DecodeGraphs: decode-only steps replayed from CUDA graphs captured at bucketed batch sizes.

Eager PyTorch spends more host time launching a small decode step's kernels than the GPU runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from loomllm.workers.attention.metadata import AttentionMetadata, PagedBatch, split_counters

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512  # vLLM's default cap: larger decode batches run eager


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below max_num_seqs (capped at MAX_CAPTURE_SIZE), then that cap."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [1 << i for i in range(top.bit_length()) if 1 << i < top]
    return [*sizes, top]


def smallest_holding(sizes: list[int], n: int) -> int:
    """The first of the ascending bucket `sizes` that holds `n`."""
    return next(size for size in sizes if size >= n)


def capture_buckets(
    sizes: list[int], run: Callable[[int], torch.Tensor], pool: Any, what: str
) -> dict[int, tuple[Any, torch.Tensor]]:
    """A CUDA graph of `run(size)` for each size, largest first, in the memory pool `pool`:
    size -> (graph, the output tensor its replays write)."""
    started = time.monotonic()
    graphs = {}
    for size in sorted(sizes, reverse=True):
        # One run outside the capture compiles the size's new Triton kernel variants and
        # lets cuBLAS pick its kernels (vLLM warms up once too). A second run would add an
        # eager forward per bucket to every start, and warm nothing more.
        run(size)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = run(size)
        graphs[size] = (graph, out)
    torch.cuda.synchronize()
    logger.info(
        "captured %s CUDA graphs for sizes %s in %.1fs", what, sizes, time.monotonic() - started
    )
    return graphs


class DecodeGraphs:
    """Static buffers for the largest bucket, and one captured graph per bucket.

    A graph has fixed shapes and addresses, so a step of n decodes is padded to the smallest
    bucket holding it. Steps with prompts or prompt logprobs, or wider than that, run eager."""

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
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks = max_blocks  # block-table width: the longest context the cache holds
        self.sizes = bucket_sizes(max_num_seqs)
        top = self.sizes[-1]
        self._scratch_slot = scratch_block * block_size
        self._scratch_block = scratch_block

        def buffer(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = buffer(1, top, dtype=torch.long)
        self.positions = buffer(1, top, dtype=torch.long)
        self.slots = buffer(top, dtype=torch.long)
        self.tables = buffer(top, max_blocks, dtype=torch.int32)
        self.lens = buffer(top, dtype=torch.int32)
        self.split_counts = split_counters(kv_caches, top, device)  # every replay zeroes them
        self.rows = torch.arange(top, device=device)  # decode row i is packed token i
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # size -> (graph, logits)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def bucket(self, num_decodes: int) -> int:
        return smallest_holding(self.sizes, num_decodes)

    def capture(self, pool: Any) -> None:
        """Capture every bucket in the memory pool `pool` (CUDA only)."""
        self._pad_from(0)
        self._graphs = capture_buckets(self.sizes, self._forward, pool, "decode")

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
        size = self.bucket(n)
        self.input_ids[0, :n].copy_(input_ids)
        self.positions[0, :n].copy_(positions)
        self.slots[:n].copy_(slots)
        self.tables[:n, :width].copy_(tables)
        self.tables[:n, width:].zero_()
        self.lens[:n].copy_(lens)
        self._pad_from(n)
        if size in self._graphs:
            graph, logits = self._graphs[size]
            graph.replay()
        else:
            logits = self._forward(size)
        return logits[:n]

    def _pad_from(self, n: int) -> None:
        """Rows n.. compute token 0 at position 0 into the scratch slot, over that slot alone:
        the runner allocates one block past the scheduler's, which no request owns."""
        self.input_ids[0, n:].zero_()
        self.positions[0, n:].zero_()
        self.slots[n:].fill_(self._scratch_slot)
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
        none = self.rows[:0]
        meta = AttentionMetadata(
            kv_caches=self.kv_caches,
            slot_mapping=self.slots[:size],
            decode_token_idx=self.rows[:size],
            decode_slots=none,
            decode_valid=none.bool(),
            decode_lens=none,
            decode_bias=none,
            prefills=[],
            paged=paged,
        )
        out = self.model(
            input_ids=self.input_ids[:, :size],
            position_ids=self.positions[:, :size],
            use_cache=False,
            attn_metadata=meta,
            logits_to_keep=self.rows[:size],
        )
        return out.logits[0]  # [size, V]
