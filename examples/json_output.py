"""Structured outputs: answers that parse, asked for as a JSON schema, a choice and a regex.

All three run in one batch; each request's grammar masks its own tokens."""

import json

from loomllm import LLM, SamplingParams, StructuredOutputsParams

person = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
asks = {
    "Invent a person and give their name and age.": StructuredOutputsParams(json=person),
    "Is the Pacific an ocean? Answer yes or no.": StructuredOutputsParams(choice=["yes", "no"]),
    "Write a date in ISO format.": StructuredOutputsParams(regex=r"\d{4}-\d{2}-\d{2}"),
}

with LLM("smollm2") as llm:
    conversations = [[{"role": "user", "content": ask}] for ask in asks]
    params = [
        SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=constraint)
        for constraint in asks.values()
    ]
    for ask, output in zip(asks, llm.chat(conversations, params), strict=True):
        answer = output.outputs[0]
        print(f"{ask}\n  -> {answer.text}")
        if answer.finish_reason == "length":  # max_tokens cuts a grammar's sentence short
            print("  (cut short at max_tokens)")
    person_answer = llm.chat(conversations[0], params[0], use_tqdm=False)[0].outputs[0]
    if person_answer.finish_reason == "stop":
        print("parsed:", json.loads(person_answer.text))
