"""StepGraphs: what decode and mixed-step CUDA graphs share. Each keeps static buffers for its
largest bucket, captures one graph per bucket, and calls the model over paged metadata."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from loomllm.workers.attention.metadata import AttentionMetadata, PagedBatch

logger = logging.getLogger(__name__)


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


class StepGraphs:
    """A graph has fixed shapes and addresses, so a step is copied into the buffers of the
    smallest bucket that holds it, the rest padded, and that bucket's graph replayed (run
    eagerly over the same buffers where none was captured: the CPU tests)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        device: torch.device,
        block_size: int,
        scratch_block: int,
        sizes: list[int],
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.block_size = block_size
        self.sizes = sizes  # ascending buckets of packed tokens
        self._scratch_slot = scratch_block * block_size
        self.input_ids = self._buffer(1, sizes[-1], dtype=torch.long)
        self.positions = self._buffer(1, sizes[-1], dtype=torch.long)
        self.slots = self._buffer(sizes[-1], dtype=torch.long)
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # size -> (graph, logits)

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def _buffer(self, *shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def _capture(self, run: Callable[[int], torch.Tensor], pool: Any, what: str) -> None:
        self._graphs = capture_buckets(self.sizes, run, pool, what)

    def _load_tokens(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """The step's n packed tokens into the buffers' first n rows; the rest compute
        token 0 at position 0 into the scratch slot: the runner allocates one block past
        the scheduler's, which no request owns."""
        n = len(input_ids)
        self.input_ids[0, :n].copy_(input_ids)
        self.positions[0, :n].copy_(positions)
        self.slots[:n].copy_(slots)
        self.input_ids[0, n:].zero_()
        self.positions[0, n:].zero_()
        self.slots[n:].fill_(self._scratch_slot)

    def _replay(self, size: int) -> torch.Tensor:
        """The bucket's logits: its graph replayed, or its forward run eagerly."""
        if size in self._graphs:
            graph, logits = self._graphs[size]
            graph.replay()
            return logits
        return self._forward(size)

    def _forward(self, size: int) -> torch.Tensor:
        raise NotImplementedError

    def _run_model(
        self,
        size: int,
        paged: PagedBatch,
        decode_token_idx: torch.Tensor,
        logits_to_keep: torch.Tensor,
    ) -> torch.Tensor:
        """The model over the first `size` tokens of the buffers, with `paged` tables."""
        none = decode_token_idx[:0]
        meta = AttentionMetadata(
            kv_caches=self.kv_caches,
            slot_mapping=self.slots[:size],
            decode_token_idx=decode_token_idx,
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
            logits_to_keep=logits_to_keep,
        )
        return out.logits[0]  # [len(logits_to_keep), V]
