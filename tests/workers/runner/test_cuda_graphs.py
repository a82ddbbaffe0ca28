"""CUDA graphs: decode-only steps padded to bucketed batch sizes, and mixed steps padded to
token buckets, give the eager path's tokens.

CUDA graph capture needs a GPU; what it replays is the padded path over static buffers,
which runs here eagerly (`capture=False`) with the Triton kernels in the interpreter, and
must sample what the unpadded eager path samples: step by step, launched ahead (async
scheduling), with 1-token prompt chunks among the decodes, and through an engine.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from types import MappingProxyType

import anyio
import pytest
import torch
from support.runner_driver import drive

from loomllm import Engine
from loomllm.core.request import Request
from loomllm.core.scheduler import Scheduler, SchedulerConfig
from loomllm.protocols.sampling import SamplingParams
from loomllm.workers.models.fused_layers import install_fused_ops
from loomllm.workers.models.llama.model import Linear
from loomllm.workers.models.loader import load_model
from loomllm.workers.runner.cuda_graphs import DecodeGraphs, bucket_sizes
from loomllm.workers.runner.mixed_graphs import MixedGraphs, token_buckets
from loomllm.workers.runner.model_runner import ModelRunner

pytestmark = pytest.mark.compute

EOS = 2
MAX_MODEL_LEN = 64


def test_bucket_sizes_double_up_to_max_num_seqs():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert bucket_sizes(5000)[-2:] == [256, 512]  # larger decode batches run eager


def make_runner(
    model_dir: str, graphs: bool, fused: bool = False, backend: str = "triton"
) -> ModelRunner:
    loaded = load_model(model_dir, dtype="float32")
    if fused:  # as a CUDA worker runs: rotary and K/V write inside the decode kernel, padded
        assert install_fused_ops(loaded.model).layers  # rows too; steps of up to 8 rows with
        for linear in loaded.model.modules():  # the skinny matmul (a worker times it first)
            if isinstance(linear, Linear):
                linear.skinny = True
    runner = ModelRunner(
        loaded.model,
        loaded.config,
        device=torch.device("cpu"),
        dtype=torch.float32,
        block_size=16,
        num_blocks=24,
        attention_backend=backend,
    )
    if graphs:
        runner.enable_graphs(max_num_seqs=8, max_model_len=MAX_MODEL_LEN, capture=False)
    return runner


def drive_requests(
    runner: ModelRunner, ahead: bool, budget: int = 5, long_prompt: int = 10
) -> tuple[dict[str, list], int]:
    """Seven requests under a 5-token budget: four short prompts decode while the three
    long ones come in one-token chunks beside them (a decode-only step with a row that does
    not sample), then the batch shrinks to 1 as they finish one by one. Returns each
    request's (tokens, logprobs) per step, and how many decode-only steps had such a row."""
    scheduler = Scheduler(SchedulerConfig(8, budget, MAX_MODEL_LEN, 16, runner.num_blocks))
    for i in range(7):
        prompt = [5 + i + j for j in range(2 if i < 4 else long_prompt)]
        max_tokens = 8 + 2 * i if i < 4 else i
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        scheduler.add_request(Request(f"r{i}", prompt, params, frozenset({EOS}), 64, 0.0))
    silent_rows = 0

    def count_silent_rows(so) -> None:
        nonlocal silent_rows
        if so.num_scheduled_tokens and set(so.num_scheduled_tokens.values()) == {1}:
            requests = [scheduler.requests[r] for r in so.num_scheduled_tokens]
            silent_rows += any(r.num_computed_tokens < r.num_prompt_tokens for r in requests)

    outputs = drive(scheduler, runner, ahead, count_silent_rows)
    return {
        r: [(o.new_token_ids, o.new_logprobs) for o in outs] for r, outs in outputs.items()
    }, silent_rows


@functools.cache
def eager_reference(model_dir: str, budget: int, long_prompt: int) -> Mapping[str, tuple]:
    """What the unpadded eager path samples, step by step, on the torch backend (nothing in
    the interpreter): the reference of both ways of driving the padded path (launched ahead
    must sample what step by step does). Shared by the tests, so read-only."""
    runner = make_runner(model_dir, graphs=False, backend="torch")
    outputs = drive_requests(runner, False, budget, long_prompt)[0]
    return MappingProxyType({r: tuple(outs) for r, outs in outputs.items()})


# Each way of driving and each path once, not every pair: each case runs for 20-60 s in the
# interpreter. Launched ahead, the fused kernels run: what a CUDA worker runs.
@pytest.mark.parametrize(
    "ahead, fused", [(False, False), (True, True)], ids=["step by step", "launched ahead, fused"]
)
def test_padded_decode_steps_sample_the_eager_tokens(tiny_model, ahead, fused):
    eager = eager_reference(tiny_model, 5, 10)
    runner = make_runner(tiny_model, graphs=True, fused=fused)
    graphs = runner.decode_graphs
    batches: list[int] = []
    forward = graphs.forward
    graphs.forward = lambda *args: (batches.append(args[3].shape[0]), forward(*args))[1]
    mixed_rows: list[int] = []  # of each mixed step
    mixed_forward = runner.mixed_graphs.forward
    runner.mixed_graphs.forward = lambda *args: (
        mixed_rows.append(len(args[3])),
        mixed_forward(*args),
    )[1]
    padded, silent_rows = drive_requests(runner, ahead)
    assert {r: [t for t, _ in o] for r, o in padded.items()} == {
        r: [t for t, _ in o] for r, o in eager.items()
    }
    for req_id, outs in padded.items():
        for (_, lps), (_, ref) in zip(outs, eager[req_id], strict=True):
            assert lps == pytest.approx(ref, abs=1e-5)
    assert not graphs.captured and silent_rows > 0
    # Three buckets at least, and padding: batches of 5 to 7 rows ran in the bucket of 8.
    assert len({graphs.bucket(n) for n in batches}) >= 3 and {5, 6, 7} & set(batches)
    # The prompts' steps, decodes beside them, ran padded to 64 tokens too: fused, these are
    # the fused kernels' case of padded tokens and rows.
    assert len(mixed_rows) >= 2 and max(mixed_rows) >= 4


# Each way of driving, each bucket. The fused kernels' padded tokens and rows: in the decode
# test's mixed steps (they are slow in the interpreter; the bucket's size is only a size).
@pytest.mark.parametrize("ahead, budget, long_prompt", [(False, 5, 10), (True, 70, 30)])
def test_padded_mixed_steps_sample_the_eager_tokens(tiny_model, ahead, budget, long_prompt):
    """Prompt chunks beside decodes, every row through the prefill kernel: in the 64-token
    bucket (a 5-token budget), and in the 128-token one (a 70-token budget)."""
    eager = eager_reference(tiny_model, budget, long_prompt)
    runner = make_runner(tiny_model, graphs=True)
    mixed = runner.mixed_graphs
    steps: list[tuple[int, int]] = []  # (tokens, rows) of each mixed step
    forward = mixed.forward
    mixed.forward = lambda *args: (steps.append((len(args[1]), len(args[3]))), forward(*args))[1]
    padded, _ = drive_requests(runner, ahead, budget, long_prompt)
    assert {r: [t for t, _ in o] for r, o in padded.items()} == {
        r: [t for t, _ in o] for r, o in eager.items()
    }
    for req_id, outs in padded.items():
        for (_, lps), (_, ref) in zip(outs, eager[req_id], strict=True):
            assert lps == pytest.approx(ref, abs=1e-5)
    assert not mixed.captured and len(steps) >= 2
    # Decodes rode along in mixed steps (more rows than prompts computing), and a step of
    # more than 64 tokens ran in the next bucket.
    assert max(rows for _, rows in steps) >= 4
    assert budget < 64 or max(tokens for tokens, _ in steps) > 64


def test_token_buckets_are_fine_for_small_steps_and_reach_the_largest_step():
    assert token_buckets(2048) == [*range(64, 513, 64), 768, 1024, 1280, 1536, 1792, 2048]
    assert token_buckets(64) == [64] and token_buckets(5) == [64]
    assert token_buckets(1000)[-2:] == [768, 1024]  # the largest step fits
    assert token_buckets(8192)[-1] == 2048  # larger steps run eager


def test_mixed_graphs_fit_what_their_buckets_hold(tiny_model):
    runner = make_runner(tiny_model, graphs=True)  # max_num_seqs 8, largest step 2048
    mixed = runner.mixed_graphs
    assert mixed.sizes == token_buckets(2048) and mixed.max_rows == 8
    assert mixed.fits(2048, 8, mixed.max_blocks) and mixed.fits(1, 1, 1)
    assert not mixed.fits(2049, 1, 1)
    assert not mixed.fits(64, 9, 1)  # more rows than max_num_seqs
    assert not mixed.fits(64, 1, mixed.max_blocks + 1)
    runner.enable_graphs(
        max_num_seqs=8, max_model_len=MAX_MODEL_LEN, capture=False, max_step_tokens=100
    )
    assert runner.mixed_graphs.sizes == [64, 128]


def test_a_failed_mixed_capture_keeps_the_decode_graphs(tiny_model, monkeypatch, caplog):
    """Each kind of graph falls back to eager alone (capture itself needs CUDA: faked)."""
    runner = make_runner(tiny_model, graphs=False)
    captured = []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(DecodeGraphs, "capture", lambda self, pool: captured.append(pool))

    def fail(self, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(MixedGraphs, "capture", fail)
    runner.enable_graphs(max_num_seqs=8, max_model_len=MAX_MODEL_LEN, capture=True)
    assert runner.mixed_graphs is None and runner.decode_graphs is not None
    assert captured == ["pool"] and "mixed-step CUDA graph capture failed" in caplog.text
    eager = eager_reference(tiny_model, 5, 10)
    served, _ = drive_requests(runner, ahead=False)  # mixed steps eager, decodes padded
    assert {r: [t for t, _ in o] for r, o in served.items()} == {
        r: [t for t, _ in o] for r, o in eager.items()
    }


def test_capture_makes_one_graph_a_bucket_and_mixed_logits_share_a_buffer(tiny_model, monkeypatch):
    """The capture code, with CUDA's graph calls faked (the captured region runs once,
    eagerly; a replay is recorded): every bucket has its graph, each mixed graph's output
    is a view of one logits buffer, and a step replays its bucket's graph."""
    replays = []

    class FakeGraph:
        def replay(self):
            replays.append(self)

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool: contextlib.nullcontext())
    runner = make_runner(tiny_model, graphs=False)
    runner.enable_graphs(
        max_num_seqs=8, max_model_len=MAX_MODEL_LEN, capture=True, max_step_tokens=128
    )
    mixed, decode = runner.mixed_graphs, runner.decode_graphs
    assert mixed.captured and decode.captured
    assert sorted(mixed._graphs) == [64, 128] and sorted(decode._graphs) == [1, 2, 4, 8]
    outputs = [logits for _, logits in mixed._graphs.values()]
    assert len({out.untyped_storage().data_ptr() for out in outputs}) == 1
    assert [out.shape[0] for out in outputs] == [8, 8]  # rows: max_num_seqs
    ids = torch.tensor([5, 6, 7, 8, 9])
    logits = mixed.forward(
        ids,
        [0, 1, 2, 0, 1],
        torch.tensor([16, 17, 18, 32, 33]),
        [[1], [2]],
        [0, 3],
        [3, 2],
        [3, 2],
        [2, 4],
    )
    assert replays == [mixed._graphs[64][0]] and logits.shape[0] == 2
    assert logits.untyped_storage().data_ptr() == outputs[0].untyped_storage().data_ptr()


def test_decode_graphs_need_the_triton_backend(tiny_model):
    loaded = load_model(tiny_model, dtype="float32")
    runner = ModelRunner(
        loaded.model,
        loaded.config,
        device=torch.device("cpu"),
        dtype=torch.float32,
        block_size=16,
        num_blocks=4,
    )
    with pytest.raises(ValueError, match="Triton attention backend"):
        runner.enable_graphs(max_num_seqs=4, max_model_len=64, capture=False)


async def generate(engine: Engine, prompt: str, params: SamplingParams, into: dict, key: int):
    async for out in engine.generate(prompt, params):
        into[key] = out.outputs[0].token_ids


@pytest.mark.anyio
async def test_an_engine_with_padded_decode_steps_matches_eager(
    tiny_model, shared_manager, anyio_backend
):
    prompts = ["w5 w6 w7", "w9 " * 9, "w11", "w3 w4"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outputs = {}
    for graphs in (False, True):
        async with Engine(
            tiny_model,
            manager_socket=shared_manager.socket,
            dtype="float32",
            attention_backend="triton",
            max_num_seqs=8,
            enforce_eager=True,
            keep_alive=0,
        ) as engine:
            if graphs:  # what a CUDA worker captures at start, here without the capture
                await engine.collective_rpc(lambda w: w.runner.enable_graphs(8, 64, False))
            outputs[graphs] = {}
            async with anyio.create_task_group() as tg:  # decode batches of 4 down to 1
                for i in range(len(prompts)):
                    tg.start_soon(generate, engine, prompts[i], params[i], outputs[graphs], i)
    assert outputs[True] == outputs[False]
