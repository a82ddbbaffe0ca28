"""The output processor's three output kinds over the same token stream: FINAL_ONLY's one
output is CUMULATIVE's last, DELTA's pieces add up to it, also when n > 1 sequences end at
different steps or the request is aborted."""

from __future__ import annotations

import time

import pytest

from loomllm.core.scheduler import EngineCoreOutput
from loomllm.engine.output_processor import OutputProcessor, ParentRequest
from loomllm.outputs import RequestMetrics, RequestOutput, RequestOutputCollector
from loomllm.protocols.sampling import RequestOutputKind, SamplingParams
from loomllm.text.tokenizer import Tokenizer

# Per step, per child: (new token ids, finish_reason). Child 0 ends at step 2 (a stop
# token), child 1 at step 4 (its length); child 1 sends two tokens at once in step 3.
STEPS = [
    {"0_r": ([5], None), "1_r": ([7], None)},
    {"0_r": ([6, 2], "stop"), "1_r": ([8], None)},
    {"1_r": ([9, 10], None)},
    {"1_r": ([11], "length")},
]


def run(tokenizer: Tokenizer, kind: RequestOutputKind, steps: int) -> list[RequestOutput]:
    """Every output the consumer would see if it read after each step."""
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, max_tokens=5, output_kind=kind, logprobs=0)
    collector = RequestOutputCollector(kind)
    processor.add(ParentRequest("r", None, [1, 3], params, collector, RequestMetrics(time.time())))
    seen = []
    for step in STEPS[:steps]:
        processor.process(
            [
                EngineCoreOutput(
                    child,
                    ids,
                    [-0.5] * len(ids),
                    [None] * len(ids),
                    reason,
                    2 if reason == "stop" else None,
                )
                for child, (ids, reason) in step.items()
            ]
        )
        if collector._pending is not None:
            seen.append(collector._pending)
            collector._pending = None
    if steps < len(STEPS):
        processor.remove("r")  # aborted before the end
        if collector._pending is not None:
            seen.append(collector._pending)
    assert not processor.states and not processor.parents
    return seen


def completions(output: RequestOutput) -> list[tuple]:
    return [
        (
            c.index,
            c.text,
            c.token_ids,
            c.cumulative_logprob,
            len(c.logprobs or ()),
            c.finish_reason,
            c.stop_reason,
        )
        for c in output.outputs
    ]


@pytest.mark.parametrize("steps", [len(STEPS), 3], ids=["finished", "aborted"])
def test_final_only_is_the_last_cumulative_output(tiny_model, steps):
    tokenizer = Tokenizer.from_model_dir(tiny_model)
    cumulative = run(tokenizer, RequestOutputKind.CUMULATIVE, steps)
    [final] = run(tokenizer, RequestOutputKind.FINAL_ONLY, steps)
    assert final.finished and cumulative[-1].finished and len(cumulative) == steps + (steps < 4)
    assert completions(final) == completions(cumulative[-1])
    reasons = [c.finish_reason for c in final.outputs]
    assert reasons == (["stop", "length"] if steps == 4 else ["stop", "abort"])
    assert final.outputs[1].token_ids == ([7, 8, 9, 10, 11] if steps == 4 else [7, 8, 9, 10])
    assert final.outputs[1].text == "".join(f" w{t}" for t in final.outputs[1].token_ids)
    deltas = run(tokenizer, RequestOutputKind.DELTA, steps)
    for index, expected in enumerate(final.outputs):
        pieces = [c for d in deltas for c in d.outputs if c.index == index]
        assert sum((c.token_ids for c in pieces), []) == expected.token_ids
        assert "".join(c.text for c in pieces) == expected.text
