"""Offline throughput and single-stream decode: loomllm vs transformers, in one run.

Peers: `generate` (padded) and `generate_batch`, on the same prompts. Run: `loom bench offline`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

PROG = "loom bench offline"


def make_prompts(num: int, mean_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Ordinary token ids (skip the first few hundred: specials and byte tokens).
    return [
        [rng.randrange(300, vocab) for _ in range(rng.randint(mean_len - 10, mean_len + 10))]
        for _ in range(num)
    ]


def run_loomllm(
    prompts: list[list[int]],
    output_len: int,
    dtype: str,
    weight_dtype: str | None = None,
    model_impl: str = "auto",
    model: str = "smollm2",
) -> tuple[float, int]:
    from loomllm import LLM, SamplingParams

    # Every engine produces exactly output_len tokens: EOS cannot end a request early.
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    options = dict(
        dtype=dtype, weight_dtype=weight_dtype, max_num_seqs=len(prompts), model_impl=model_impl
    )
    with LLM(model, **options) as llm:
        llm.generate(
            [{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4), use_tqdm=False
        )  # warm-up
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def weight_dtype_accuracy(
    prompts: list[list[int]], output_len: int, weight_dtype: str
) -> tuple[int, float, float]:
    """Greedy runs with float32 and with 16-bit weights on the same prompts: how many
    outputs are identical, the mean share of each output before the first difference, and
    the mean |logprob difference| of the chosen tokens over those common prefixes."""
    from loomllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0, logprobs=0)
    runs = []
    for wd in (None, weight_dtype):
        with LLM("smollm2", dtype="float32", weight_dtype=wd) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs.append([o.outputs[0] for o in outs])
    identical, shares, drifts = 0, [], []
    for a, b in zip(*runs, strict=True):
        pairs = enumerate(zip(a.token_ids, b.token_ids, strict=True))  # ignore_eos: same length
        same = next((i for i, (x, y) in pairs if x != y), len(a.token_ids))
        identical += same == len(a.token_ids)
        shares.append(same / len(a.token_ids))
        drifts += [
            abs(a.logprobs[i][t].logprob - b.logprobs[i][t].logprob)
            for i, t in enumerate(a.token_ids[:same])
        ]
    return identical, sum(shares) / len(shares), sum(drifts) / max(len(drifts), 1)


def load_hf(dtype: str, model: str = "smollm2"):
    import torch
    from transformers import AutoModelForCausalLM

    from loomllm.workers.models.sources import prepare_model_dir, resolve_model

    # transformers reads float weights: a GGUF's are dequantized into the cache for it.
    model_dir = prepare_model_dir(resolve_model(model), dense_weights=True)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()


def run_hf(model, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    import torch

    pad = model.generation_config.pad_token_id or 0
    longest = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        pad_token_id=pad,
    )
    with torch.inference_mode():
        model.generate(input_ids[:1], attention_mask=mask[:1], max_new_tokens=4, pad_token_id=pad)
        start = time.perf_counter()
        out = model.generate(input_ids, **kwargs)
        elapsed = time.perf_counter() - start
    return elapsed, (out.shape[1] - longest) * len(prompts)


def run_hf_generate_batch(model, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    model.generate_batch(
        [prompts[0]],
        generation_config=GenerationConfig(
            max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0
        ),
    )  # warm-up
    start = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=config)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.generated_tokens) for o in out.values())


async def stream_timing(engine, prompt: list[int], output_len: int) -> tuple[float, float]:
    """(time to first token, decode seconds per token after it) of one greedy request of
    `output_len` tokens on `engine`."""
    from loomllm import RequestOutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=output_len, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA
    )
    start = time.perf_counter()
    first = None
    async with engine.generate({"prompt_token_ids": prompt}, params) as stream:
        async for _ in stream:
            first = first or time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return first - start, (end - first) / (output_len - 1)


def single_stream_loomllm(
    prompt: list[int],
    output_len: int,
    dtype: str,
    weight_dtype: str | None = None,
    model_impl: str = "auto",
    repeats: int = 1,
    model: str = "smollm2",
) -> tuple[float, float]:
    """(time to first token, decode seconds per token) for one request alone: their means
    over `repeats` requests in a row (llama-bench's tg averages 5 runs)."""
    import anyio

    from loomllm import Engine

    async def run() -> tuple[float, float]:
        firsts, per_tokens = [], []
        async with Engine(
            model, dtype=dtype, weight_dtype=weight_dtype, model_impl=model_impl
        ) as engine:
            await stream_timing(engine, prompt[:8], output_len)  # warm-up
            for _ in range(repeats):
                first, per_token = await stream_timing(engine, prompt, output_len)
                firsts.append(first)
                per_tokens.append(per_token)
        return statistics.mean(firsts), statistics.mean(per_tokens)

    return anyio.run(run)


def single_stream_hf(model, prompt: list[int], output_len: int) -> tuple[float, float]:
    import torch

    ids = torch.tensor([prompt])
    kwargs = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, **kwargs)  # warm-up
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
        whole = time.perf_counter() - start
    return ttft, (whole - ttft) / (output_len - 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-generate-batch", action="store_true", help="slow on CPU")
    p.add_argument(
        "--weight-dtype",
        choices=["bfloat16", "float16"],
        default=None,
        help="also run loomllm with float32 math and 16-bit linear weights, and "
        "measure its greedy agreement and logprob drift against float32",
    )
    p.add_argument(
        "--transformers-model",
        action="store_true",
        help="also run loomllm on transformers' modeling code (model_impl)",
    )
    args = p.parse_args(argv)
    prompts = make_prompts(args.num_prompts, args.prompt_len, 49152, args.seed)
    rows = [("loomllm", *run_loomllm(prompts, args.output_len, args.dtype))]
    streams = [("loomllm", *single_stream_loomllm(prompts[0], args.output_len, args.dtype))]
    if args.transformers_model:
        name = "loomllm, transformers' modeling code"
        rows.append(
            (name, *run_loomllm(prompts, args.output_len, args.dtype, model_impl="transformers"))
        )
        streams.append(
            (
                name,
                *single_stream_loomllm(
                    prompts[0], args.output_len, args.dtype, model_impl="transformers"
                ),
            )
        )
    accuracy = None
    if args.weight_dtype:
        name = f"loomllm, {args.weight_dtype} weights"
        rows.append((name, *run_loomllm(prompts, args.output_len, "float32", args.weight_dtype)))
        streams.append(
            (
                name,
                *single_stream_loomllm(prompts[0], args.output_len, "float32", args.weight_dtype),
            )
        )
        accuracy = weight_dtype_accuracy(prompts[:16], 64, args.weight_dtype)
    if not args.skip_hf:
        model = load_hf(args.dtype)
        rows.append(
            ("transformers generate (padded batch)", *run_hf(model, prompts, args.output_len))
        )
        if not args.skip_generate_batch:
            rows.append(
                (
                    "transformers generate_batch",
                    *run_hf_generate_batch(model, prompts, args.output_len),
                )
            )
        streams.append(
            ("transformers generate", *single_stream_hf(model, prompts[0], args.output_len))
        )
    print(
        f"\n{args.num_prompts} prompts x ~{args.prompt_len} tokens, {args.output_len} output "
        f"tokens each, {args.dtype}, SmolLM2-135M, CPU"
    )
    base = rows[0][2] / rows[0][1]
    print(f"{'engine':40} {'seconds':>8} {'tokens':>7} {'tok/s':>8} {'loomllm/x':>10}")
    for name, seconds, tokens in rows:
        rate = tokens / seconds
        print(f"{name:40} {seconds:8.1f} {tokens:7d} {rate:8.1f} {base / rate:10.2f}")
    print(f"\none stream, {len(prompts[0])}-token prompt, {args.output_len} output tokens")
    print(f"{'engine':40} {'TTFT ms':>8} {'ms/tok':>7} {'tok/s':>8} {'loomllm/x':>10}")
    for name, ttft, per_token in streams:
        print(
            f"{name:40} {ttft * 1e3:8.1f} {per_token * 1e3:7.1f} {1 / per_token:8.1f} "
            f"{per_token / streams[0][2]:10.2f}"
        )

    if accuracy is not None:
        identical, share, drift = accuracy
        print(
            f"\n{args.weight_dtype} weights vs float32, 16 prompts x 64 greedy tokens: "
            f"{identical}/16 identical, {share:.1%} of tokens before the first difference, "
            f"mean |logprob drift| {drift:.4f} on the common prefixes"
        )


if __name__ == "__main__":
    main()
