"""Offline batch with the blocking LLM facade: many prompts in, answers out in order."""

from loomllm import LLM, SamplingParams

prompts = [
    "The capital of France is",
    "Water boils at",
    "The three primary colors are",
    "A haiku about the sea:",
]

with LLM("smollm2") as llm:
    outputs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
    for output in outputs:
        print(f"{output.prompt!r} -> {output.outputs[0].text!r}")
    answer = llm.chat(
        [{"role": "user", "content": "Name a prime number."}],
        SamplingParams(max_tokens=32, temperature=0.0),
    )
    print("chat:", answer[0].outputs[0].text)
