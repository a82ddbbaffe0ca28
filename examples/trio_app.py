"""The same engine under trio: three concurrent streams, one deadline, one nursery."""

import trio

from loomllm import Engine, RequestOutputKind, SamplingParams

QUESTIONS = ["Name a color.", "Name a fruit.", "Name a planet."]


async def ask(engine: Engine, question: str) -> None:
    params = SamplingParams(
        max_tokens=24, temperature=0.7, seed=1, output_kind=RequestOutputKind.FINAL_ONLY
    )
    async for output in engine.chat([{"role": "user", "content": question}], params):
        print(f"{question} -> {output.outputs[0].text.strip()!r}")


async def main() -> None:
    async with Engine("smollm2") as engine:
        with trio.fail_after(120):  # a deadline aborts every request still running
            async with trio.open_nursery() as nursery:
                for question in QUESTIONS:
                    nursery.start_soon(ask, engine, question)
        print(engine.stats())


trio.run(main)
