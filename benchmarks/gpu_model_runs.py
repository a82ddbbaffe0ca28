"""Both sides of gpu-check's model checks: a random model saved with transformers' float32
model of it, its greedy tokens with their logits, an Engine's on the same prompts, and the
comparison that tells a near-tie from a wrong token."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

from loomllm.benchmarks import save_word_tokenizer, wait_for_no_workers
from loomllm.benchmarks.gpu_model_shapes import Shapes

MAX_TOKENS = 24
# A divergence from transformers' greedy token is a near-tie when the two tokens' logits
# differ by less than this fraction of the largest logit: float32 kernels in another order.
NEAR_TIE = 1e-4


def random_model(
    shapes: Shapes, config_name: str, fields: dict[str, Any], path: Path, device: str
) -> Any:
    """A random-weight causal LM saved in bf16 to `path` with a word-level tokenizer (built on
    `device`, which is quick); transformers' model of it, float32, eager attention."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = shapes.config(config_name, fields)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    save_word_tokenizer(path, shapes.vocab)
    del model
    free(device)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return reference.to(device).eval()


def free(device: str) -> None:
    """Give the device back what dropped models held, for the next to load."""
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def greedy_with_scores(model: Any, prompts: list[list[int]]) -> list[tuple[list[int], Any]]:
    """transformers' greedy tokens for each prompt, with each step's logits [steps, V]."""
    import torch

    device = next(model.parameters()).device
    model.generation_config.eos_token_id = None
    found = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            logits = torch.cat(out.logits).float().cpu()
            found.append((out.sequences[0, len(prompt) :].tolist(), logits))
    return found


def compare(ours: list[list[int]], reference: list[tuple[list[int], Any]]) -> tuple[bool, str]:
    """Every request's tokens against transformers': identical, or diverging first at a
    near-tie (NEAR_TIE); the words that say which."""
    identical, ties, wrong = 0, [], []
    for i, (tokens, (expected, logits)) in enumerate(zip(ours, reference, strict=True)):
        if tokens == expected:
            identical += 1
            continue
        at = next(
            (j for j, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b),
            min(len(tokens), len(expected)),
        )
        if at >= min(len(tokens), len(expected)):
            wrong.append(f"request {i}: {len(tokens)} tokens, expected {len(expected)}")
            continue
        row = logits[at]
        gap = (row[expected[at]] - row[tokens[at]]).item() / row.abs().max().item()
        (ties if gap < NEAR_TIE else wrong).append(f"request {i} at token {at} (gap {gap:.1e})")
    words = f"{identical} of {len(ours)} requests identical to transformers"
    if ties:
        words += f"; near-ties: {', '.join(ties)}"
    if wrong:
        words += f"; WRONG: {', '.join(wrong)}"
    return not wrong, words


def engine_tokens(
    model_dir: str,
    device: str,
    socket: Path,
    prompts: list[list[int]],
    loras: list[Any] | None = None,
    **options: Any,
) -> tuple[list[list[int]], Any, str]:
    """Greedy tokens of an Engine for every prompt, all started together; its stats; which
    CUDA graphs its worker captured (a forward that cannot be captured runs eager)."""
    import anyio

    from loomllm import Engine, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    loras = loras or [None] * len(prompts)

    async def run() -> tuple[list[list[int]], Any, str]:
        async with Engine(
            model_dir,
            dtype="float32",
            device=device,
            keep_alive=0,
            manager_socket=socket,
            **options,
        ) as engine:
            tokens: list[list[int]] = [[] for _ in prompts]

            async def one(i: int) -> None:
                request = {"prompt_token_ids": prompts[i]}
                async for out in engine.generate(request, params, lora_request=loras[i]):
                    tokens[i] = list(out.outputs[0].token_ids)

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            (graphs,) = await engine.collective_rpc(captured_graphs)
            return tokens, engine.stats(), graphs

    wait_for_no_workers(socket)  # the last engine's worker gone, its memory freed
    return anyio.run(run)


def captured_graphs(worker: Any) -> str:
    """Which CUDA graphs a worker's runner captured, in words (run on the worker)."""
    runner = worker.runner
    kinds = [("decode", runner.decode_graphs), ("mixed", runner.mixed_graphs)]
    return " and ".join(f"{k} graphs" for k, g in kinds if g is not None and g.captured) or "none"
