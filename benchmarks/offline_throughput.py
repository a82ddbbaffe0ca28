"""Offline throughput, side by side in one run: loomllm vs transformers `generate` (padded batch).

Same model, same dtype, same prompts (token ids drawn from a fixed seed), same number of
output tokens (`ignore_eos` / `min_new_tokens`, so EOS cannot end a request early).

    .venv/bin/python benchmarks/offline_throughput.py [--num-prompts 64] [--prompt-len 100]
        [--output-len 128] [--dtype float32] [--skip-hf]
"""

from __future__ import annotations

import argparse
import random
import time


def make_prompts(num: int, mean_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Ordinary token ids (skip the first few hundred: specials and byte tokens).
    return [
        [rng.randrange(300, vocab) for _ in range(rng.randint(mean_len - 10, mean_len + 10))]
        for _ in range(num)
    ]


def run_loomllm(prompts: list[list[int]], output_len: int, dtype: str) -> tuple[float, int]:
    from runtime import LLM, SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    with LLM("smollm2", dtype=dtype, max_num_seqs=len(prompts)) as llm:
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4),
                     use_tqdm=False)  # warm-up  # fmt: skip
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def run_hf(prompts: list[list[int]], output_len: int, dtype: str) -> tuple[float, int]:
    import torch
    from transformers import AutoModelForCausalLM

    from workers.model_loader import prepare_model_dir, resolve_model

    model_dir = prepare_model_dir(resolve_model("smollm2"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    pad = model.generation_config.pad_token_id or 0
    longest = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=output_len,
                  min_new_tokens=output_len, pad_token_id=pad)  # fmt: skip
    with torch.inference_mode():
        model.generate(input_ids[:1], attention_mask=mask[:1], max_new_tokens=4, pad_token_id=pad)
        start = time.perf_counter()
        out = model.generate(input_ids, **kwargs)
        elapsed = time.perf_counter() - start
    return elapsed, (out.shape[1] - longest) * len(prompts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true")
    args = p.parse_args()
    prompts = make_prompts(args.num_prompts, args.prompt_len, 49152, args.seed)
    rows = [("loomllm", *run_loomllm(prompts, args.output_len, args.dtype))]
    if not args.skip_hf:
        rows.append(("transformers generate (padded batch)",
                     *run_hf(prompts, args.output_len, args.dtype)))  # fmt: skip
    print(f"\n{args.num_prompts} prompts x ~{args.prompt_len} tokens, {args.output_len} output "
          f"tokens each, {args.dtype}, SmolLM2-135M, CPU")  # fmt: skip
    base = rows[0][2] / rows[0][1]
    print(f"{'engine':40} {'seconds':>8} {'tokens':>7} {'tok/s':>8} {'loomllm/x':>10}")
    for name, seconds, tokens in rows:
        rate = tokens / seconds
        print(f"{name:40} {seconds:8.1f} {tokens:7d} {rate:8.1f} {base / rate:10.2f}")


main()
