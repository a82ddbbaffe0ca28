"""Reading a request's stream to its end."""

from __future__ import annotations

from loomllm import Engine, SamplingParams


async def final(engine: Engine, prompt, params: SamplingParams):
    """The last output of one request, which must be its finished one."""
    outputs = [out async for out in engine.generate(prompt, params)]
    assert outputs and outputs[-1].finished
    return outputs[-1]
