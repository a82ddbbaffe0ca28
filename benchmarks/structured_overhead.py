"""What structured outputs cost: one batch plain, under a regex and under a JSON schema, one run.

One SmolLM2 engine, the three alternated over rounds. Run: `loom bench engine structured`.
"""

from __future__ import annotations

import argparse
import statistics
import time

PROG = "loom bench engine structured"
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "pages": {"type": "integer"},
        "notes": {"type": "string"},
    },
    "required": ["title", "pages", "notes"],
}
CONSTRAINTS = {"plain": None, "regex": {"regex": "([a-z]+ )+"}, "json schema": {"json": SCHEMA}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)

    from loomllm import LLM, SamplingParams, StructuredOutputsParams

    asks = [
        [{"role": "user", "content": f"Describe book number {i} as JSON."}]
        for i in range(args.num_prompts)
    ]
    rates: dict[str, list[float]] = {name: [] for name in CONSTRAINTS}
    with LLM("smollm2", dtype=args.dtype, max_num_seqs=args.num_prompts) as llm:
        for spec in CONSTRAINTS.values():  # warm-up: compile every grammar once
            so = None if spec is None else StructuredOutputsParams(**spec)
            llm.chat(asks[0], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
        for _ in range(args.rounds):
            for name, spec in CONSTRAINTS.items():
                so = None if spec is None else StructuredOutputsParams(**spec)
                # ignore_eos: exactly output_len tokens each. A grammar that has ended allows
                # only its stop tokens, so it still masks every step after its end.
                params = SamplingParams(
                    max_tokens=args.output_len,
                    ignore_eos=True,
                    temperature=0.0,
                    structured_outputs=so,
                )
                start = time.perf_counter()
                outputs = llm.chat(asks, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                assert tokens == args.num_prompts * args.output_len, tokens
                rates[name].append(tokens / elapsed)
    plain = statistics.median(rates["plain"])
    print(
        f"{args.num_prompts} requests x {args.output_len} tokens, {args.rounds} rounds, "
        f"SmolLM2 {args.dtype}\n"
    )
    print("| constraint | tokens/s (median) | / plain |\n|---|---|---|")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.1f} | {median / plain:.2f} |")


if __name__ == "__main__":
    main()
