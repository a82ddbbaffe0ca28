"""Stream a chat answer from the embedded default model (SmolLM2-135M-Instruct).

No `if __name__ == "__main__"` guard needed: loomllm never re-imports your script.
The first run loads the model (and converts the GGUF once, ~30 s); later runs attach
to the warm worker that the engine-manager kept for you.
"""

import asyncio
import sys

from loomllm import Engine, RequestOutputKind, SamplingParams

QUESTION = " ".join(sys.argv[1:]) or "What is the capital of France? Answer in one sentence."


async def main() -> None:
    params = SamplingParams(max_tokens=128, temperature=0.0, output_kind=RequestOutputKind.DELTA)
    async with Engine("smollm2") as engine:
        print(f"> {QUESTION}")
        async for output in engine.chat([{"role": "user", "content": QUESTION}], params):
            print(output.outputs[0].text, end="", flush=True)
        print()


asyncio.run(main())
