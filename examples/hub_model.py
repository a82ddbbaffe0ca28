"""A model from the Hugging Face Hub by its id: the engine-manager downloads what serving needs
once (a progress bar shows it here), and every later engine loads it from the HF cache.

Run: `python examples/hub_model.py [org/name]` (`loom pull org/name` downloads without loading).
"""

import sys

from loomllm import LLM, SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else "Qwen/Qwen2.5-0.5B-Instruct"
with LLM(model) as llm:
    outputs = llm.generate(
        ["The capital of France is"], SamplingParams(max_tokens=16, temperature=0.0)
    )
    print(outputs[0].outputs[0].text)
