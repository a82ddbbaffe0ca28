"""The model runner with the Triton attention backend (kernels in Triton's interpreter, on the CPU)
gives the torch backend's tokens and logprobs, step by step, through whole prompts, chunked
prompts, decodes and mixed batches, on tiny random models of two architectures, and through
an engine.
"""

from __future__ import annotations

import pytest
import torch
from support.models import make_tiny_model

from loomllm import LLM
from loomllm.protocols.messages import CachedRequests, NewRequestData, SchedulerOutput
from loomllm.protocols.sampling import SamplingParams
from loomllm.workers.models.loader import load_model
from loomllm.workers.runner.model_runner import ModelRunner
from loomllm.workers.worker.state import _attention_backend

pytestmark = pytest.mark.compute

BLOCK_SIZE = 16
BLOCKS_EACH = 5  # 80 tokens a request: no step needs a new block
PROMPTS = {"a": list(range(3, 43)), "b": list(range(50, 80)), "c": [7, 8, 9, 10, 11]}
# Per step: tokens to compute per request (a prompt may take several steps: chunked).
SCHEDULE = [{"a": 40, "b": 20}, {"a": 1, "b": 10}, {"a": 1, "b": 1, "c": 5}] + [
    {"a": 1, "b": 1, "c": 1}
] * 6


def run(runner: ModelRunner) -> list[tuple[list[str], list[int], list[float]]]:
    """Drive SCHEDULE; each step's (request ids, sampled tokens, their logprobs)."""
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    computed: dict[str, int] = {}
    steps = []
    for step, planned in enumerate(SCHEDULE):
        new = [
            NewRequestData(
                r,
                PROMPTS[r],
                [],
                params,
                [2],
                list(range(i * BLOCKS_EACH, (i + 1) * BLOCKS_EACH)),
                0,
            )
            for i, r in enumerate(PROMPTS)
            if r in planned and r not in computed
        ]
        cached = [r for r in planned if r in computed]
        output = SchedulerOutput(
            step,
            new,
            CachedRequests(cached, [[] for _ in cached], [computed[r] for r in cached]),
            dict(planned),
            [],
        )
        result = runner.execute(output, step)
        steps.append((result.req_ids, result.sampled_token_ids, result.logprobs))
        for r, n in planned.items():
            computed[r] = computed.get(r, 0) + n
    return steps


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_matches_torch(arch, tmp_path):
    loaded = load_model(make_tiny_model(tmp_path, arch), dtype="float32")
    runs = {}
    for backend in ("torch", "triton"):
        runner = ModelRunner(
            loaded.model,
            loaded.config,
            device=torch.device("cpu"),
            dtype=torch.float32,
            block_size=BLOCK_SIZE,
            num_blocks=BLOCKS_EACH * len(PROMPTS),
            attention_backend=backend,
        )
        runs[backend] = run(runner)
    assert len(runs["torch"]) == len(SCHEDULE)
    assert sum(len(ids) for ids, _, _ in runs["torch"]) == 1 + 2 + 3 * 7  # b waits for its chunk
    for (ids, tokens, lps), (t_ids, t_tokens, t_lps) in zip(
        runs["torch"], runs["triton"], strict=True
    ):
        assert (t_ids, t_tokens) == (ids, tokens)
        assert t_lps == pytest.approx(lps, abs=1e-4)


def test_unknown_backend_and_odd_block_sizes_are_refused(tiny_model):
    loaded = load_model(tiny_model, dtype="float32")
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="attention_backend must be one of torch, triton"):
        ModelRunner(
            loaded.model,
            loaded.config,
            device=cpu,
            dtype=torch.float32,
            block_size=16,
            num_blocks=4,
            attention_backend="flash",
        )
    for block_size in (8, 24):
        with pytest.raises(ValueError, match="power of two >= 16 for the Triton"):
            ModelRunner(
                loaded.model,
                loaded.config,
                device=cpu,
                dtype=torch.float32,
                block_size=block_size,
                num_blocks=4,
                attention_backend="triton",
            )


def test_auto_picks_triton_on_cuda_only(monkeypatch):
    assert _attention_backend("auto", torch.device("cuda")) == "triton"
    assert _attention_backend("auto", torch.device("cpu")) == "torch"
    assert _attention_backend("torch", torch.device("cuda")) == "torch"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        _attention_backend("triton", torch.device("cpu"))


def test_an_engine_on_the_triton_backend_matches_torch(tiny_model, shared_manager):
    """Through the engine, the manager and a worker: the option reaches the worker."""
    prompts = ["w5 w6 w7", "w9 " * 40, "w11"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        # The manager inherited TRITON_INTERPRET=1 from this process (conftest.py).
        with LLM(
            tiny_model,
            attention_backend=backend,
            keep_alive=0,
            max_num_batched_tokens=32,
            manager_socket=shared_manager.socket,
        ) as llm:
            outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outputs["triton"] == outputs["torch"]
