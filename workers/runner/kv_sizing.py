"""How many bytes of KV cache a worker gets: the user's, a CPU default, or on CUDA what is
left of the allowed share of the GPU after a profiling forward pass of a full step.
"""

from __future__ import annotations

import logging
from typing import Any

from loomllm.protocols.worker_options import PROFILE_WHOLE_CONTEXT, WorkerOptions

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
GiB = float(1 << 30)


def largest_step_tokens(options: WorkerOptions, max_model_len: int) -> int:
    """The most tokens one step of the engine computes (its `profile_tokens` option)."""
    tokens = options.profile_tokens
    if tokens == PROFILE_WHOLE_CONTEXT:  # no chunked prefill: a step holds a whole prompt
        return max_model_len
    return tokens


def kv_cache_budget(
    loaded: Any, options: WorkerOptions, block_size: int, per_block: int, make_runner: Any
) -> float:
    """Bytes for the KV cache. `make_runner(num_blocks)` builds a ModelRunner.

    On CUDA, with the weights loaded, the largest step the engine sends runs through a
    throwaway runner; the cache gets the rest of `gpu_memory_utilization` x the GPU's memory,
    counting all that is in use on the device (weights, the CUDA context, other processes)."""
    import torch

    if options.kv_cache_memory is not None:
        return float(options.kv_cache_memory)
    device = torch.device(loaded.device)
    if device.type == "cuda":
        utilization = options.gpu_memory_utilization
        tokens = largest_step_tokens(options, loaded.max_model_len)
        peak = profile_activation_bytes(
            device, tokens, block_size, loaded.vocab_size, loaded.max_model_len, make_runner
        )
        free, total = torch.cuda.mem_get_info(device)
        budget = gpu_kv_budget(total, free, peak, utilization)
        logger.info(
            "KV cache: %.2f GiB (%.0f%% of %.1f GiB, less %.2f GiB in use and %.2f GiB of "
            "activations for a %d-token step)",
            budget / GiB,
            utilization * 100,
            total / GiB,
            (total - free) / GiB,
            peak / GiB,
            tokens,
        )
        return budget
    # Room for 32 full-length sequences, at most 1 GiB: small models stay small.
    return min(DEFAULT_CPU_KV_CACHE_BYTES, 32 * loaded.max_model_len * per_block / block_size)


def gpu_kv_budget(total: float, free: float, activation_peak: float, utilization: float) -> float:
    """The share of the GPU the user allows, less what is in use now and the forward's peak."""
    return utilization * total - (total - free) - activation_peak


def profile_activation_bytes(
    device: Any, tokens: int, block_size: int, vocab_size: int, max_model_len: int, make_runner: Any
) -> int:
    """Peak memory of one step of `tokens` prompt tokens (as many requests as the context
    length needs), beyond the weights and its KV blocks: reserved by the allocator, so its
    fragmentation counts, and with every position's logprobs computed, the worst a step's
    logits can take (prompt_logprobs)."""
    import torch

    from loomllm.protocols.messages import CachedRequests, NewRequestData, SchedulerOutput
    from loomllm.protocols.sampling import SamplingParams

    sizes = [min(max_model_len, tokens - start) for start in range(0, tokens, max_model_len)]
    blocks = [-(-n // block_size) for n in sizes]
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_reserved(device)
    runner = make_runner(sum(blocks))
    with_cache = torch.cuda.memory_reserved(device)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    requests, first = [], 0
    for i, (n, b) in enumerate(zip(sizes, blocks, strict=True)):
        prompt = [(first + j) % vocab_size for j in range(n)]
        requests.append(
            NewRequestData(f"profile-{i}", prompt, [], params, [], list(range(first, first + b)), 0)
        )
        first += b
    step = SchedulerOutput(
        0,
        requests,
        CachedRequests([], [], []),
        {r.req_id: len(r.prompt_token_ids) for r in requests},
        [],
    )
    runner.execute(step, 0)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device) - with_cache
    del runner
    torch.cuda.empty_cache()
    logger.debug(
        "profiling step: %d tokens in %d requests, %d bytes of KV blocks, peak %d bytes above them",
        tokens,
        len(sizes),
        with_cache - before,
        peak,
    )
    return peak
