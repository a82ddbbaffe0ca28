"""Builds an EngineCore from the config and what the workers reported (tokenizer, limits)."""

from __future__ import annotations

import logging

from loomllm.clients.workers import WorkerClient
from loomllm.config import DEFAULT_CHUNKED_TOKEN_BUDGET, EngineConfig
from loomllm.core.scheduler import Scheduler, SchedulerConfig
from loomllm.engine.core import EngineCore
from loomllm.engine.output_processor import OutputProcessor
from loomllm.protocols.messages import ModelInfo
from loomllm.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# async_scheduling=None on a CPU worker: steps of at most this many requests run ahead (and
# larger ones whose outputs are all whole: EngineCore._may_run_ahead).
CPU_AHEAD_MAX_ROWS = 1


def resolve_max_model_len(cfg: EngineConfig, info: ModelInfo) -> int:
    """The user's max_model_len, else the model's, within what the KV cache can hold."""
    capacity = info.num_kv_blocks * info.block_size
    if cfg.max_model_len is not None:
        if cfg.max_model_len > info.max_model_len:
            raise ValueError(
                f"max_model_len={cfg.max_model_len} exceeds the model's {info.max_model_len}"
            )
        if cfg.max_model_len > capacity:
            raise ValueError(
                f"max_model_len={cfg.max_model_len} needs more KV cache than the "
                f"{capacity} tokens that kv_cache_memory holds; raise kv_cache_memory"
            )
        return cfg.max_model_len
    if capacity < info.max_model_len:
        logger.warning(
            "max_model_len lowered from %d to %d: that is what the KV cache holds",
            info.max_model_len,
            capacity,
        )
    return min(info.max_model_len, capacity)


def build_engine_core(
    cfg: EngineConfig, info: ModelInfo, workers: WorkerClient, tokenizer: Tokenizer | None = None
) -> EngineCore:
    """Build one replica's EngineCore; `tokenizer` is given when another replica loaded it."""
    max_model_len = resolve_max_model_len(cfg, info)
    # An encoder's attention is bidirectional: a prompt split over steps would attend to
    # only part of itself, so its prompts are never chunked.
    encoder = info.pooling is not None and not info.pooling.causal
    chunked = cfg.enable_chunked_prefill and not encoder
    budget = cfg.max_num_batched_tokens
    if budget is None:
        budget = DEFAULT_CHUNKED_TOKEN_BUDGET if chunked else max_model_len
    if not chunked and budget < max_model_len:
        why = "an encoder computes" if encoder else "when enable_chunked_prefill is off,"
        raise ValueError(
            f"max_num_batched_tokens ({budget}) must be >= max_model_len ({max_model_len}): "
            f"{why} each prompt whole, in one step"
        )
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            block_size=info.block_size,
            num_blocks=info.num_kv_blocks,
            # A pooling worker pools the hidden states of every prompt token it computes:
            # a prefix-cache hit would skip some (mean, CLS).
            enable_prefix_caching=cfg.enable_prefix_caching and info.pooling is None,
            enable_chunked_prefill=chunked,
            scheduling_policy=cfg.scheduling_policy,
            speculative=cfg.speculative,
            max_loras=cfg.max_loras if cfg.enable_lora else None,
        )
    )
    if tokenizer is None:
        tokenizer = Tokenizer.from_model_dir(info.model_dir)
    async_scheduling, ahead_max_rows = cfg.async_scheduling, None
    if async_scheduling is None:
        # A request with drafts in flight is not scheduled ahead (it waits for how many are
        # taken), so with speculation the overlap would mostly be lost: off unless asked.
        async_scheduling = cfg.speculative is None
        if not info.device.startswith("cuda"):
            # A CPU worker's forward shares the cores with this process: the engine's work
            # beside it pays for one stream, or a batch that streams nothing until it ends,
            # whose share is small, and stalls the worker's threads once it grows with a
            # batch's streams (a server's per-token writes).
            ahead_max_rows = CPU_AHEAD_MAX_ROWS
    return EngineCore(
        scheduler,
        workers,
        OutputProcessor(tokenizer),
        tokenizer.eos_token_ids,
        max_model_len,
        async_scheduling=async_scheduling,
        ahead_max_rows=ahead_max_rows,
    )
