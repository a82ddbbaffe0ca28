"""Speculative decoding, timed in one run: the same greedy requests plain, with n-gram drafts
and with a draft model's, on a task that repeats its input (an edit of a given text) and on
free writing, with the tokens per second of each, the ratio to plain, and the acceptance.

Run: `loom bench engine spec` (SmolLM2, 4 prompts x 128 tokens a task, one at a time; k=4, n-grams
of 3 to 4 tokens; the draft model SmolLM2 itself unless --draft-model names another).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

PROG = "loom bench engine spec"

PASSAGE = (
    "The loom is a device used to weave cloth and tapestry. The basic purpose of any loom is "
    "to hold the warp threads under tension to facilitate the interweaving of the weft "
    "threads. The precise shape of the loom and its mechanics may vary, but the basic "
    "function is the same. Weaving is done by intersecting the longitudinal threads, the "
    "warp, with the transverse threads, the weft."
)
TASKS = {
    # The answer is mostly the prompt's own text: n-gram drafts are often right.
    "edit": [
        f"Rewrite this text, replacing the word 'loom' with 'frame' and nothing else:\n\n{PASSAGE}",
        f"Copy this text exactly, in all capital letters... no, as it is:\n\n{PASSAGE}",
        f"Fix any typos in this text and return it whole:\n\n{PASSAGE}",
        f"Return this text with each sentence on its own line:\n\n{PASSAGE}",
    ],
    # Nothing to copy: drafts come only from the answer's own repetitions.
    "free": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Describe your ideal weekend in the mountains.",
        "Explain how a bicycle stays upright, to a child.",
        "Write a letter to a friend about learning to cook.",
    ],
}


def run(llm: Any, prompts: list[str], max_tokens: int) -> tuple[float, int, Any]:
    """(seconds, output tokens, the engine's stats after) for one batch of chats."""
    from loomllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    messages = [[{"role": "user", "content": p}] for p in prompts]
    started = time.perf_counter()
    outs = llm.chat(messages, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs), llm.engine.stats()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    p.add_argument("--lookup-min", type=int, default=3, help="prompt_lookup_min")
    p.add_argument("--batch", type=int, default=1, help="prompts in flight at once")
    p.add_argument(
        "--draft-model",
        default=None,
        help="also run method draft_model with this model drafting (default: the model "
        "itself, which shows the mechanics: every draft right, each paid for in full)",
    )
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rounds", type=int, default=2, help="each side's best of this many")
    args = p.parse_args(argv)
    from loomllm import LLM

    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": args.lookup_max,
        "prompt_lookup_min": args.lookup_min,
    }
    draft = {
        "method": "draft_model",
        "model": args.draft_model or args.model,
        "num_speculative_tokens": args.k,
    }
    common = {"dtype": args.dtype, "max_num_seqs": args.batch, "manager": "private"}
    engines = {
        "plain": LLM(args.model, **common),
        "ngram": LLM(args.model, speculative_config=spec, **common),
        "draft": LLM(args.model, speculative_config=draft, **common),
    }
    try:
        print(
            f"{PROG}: {args.model}, greedy, {args.max_tokens} tokens a prompt, batch {args.batch}"
        )
        print(f"draft model: {draft['model']}")
        print(f"{'task':6} {'method':6} {'tok/s':>8} {'/ plain':>8} {'accepted':>9}")
        for task, prompts in TASKS.items():
            rate: dict[str, float] = {}
            for name, llm in engines.items():
                best = 0.0
                for _ in range(args.rounds):
                    before = llm.engine.stats()
                    seconds, tokens, after = run(llm, prompts, args.max_tokens)
                    best = max(best, tokens / seconds)
                rate[name] = best
                drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
                taken = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
                accepted = f"{taken / drafted:.0%}" if drafted else ""
                ratio = best / rate["plain"]
                print(f"{task:6} {name:6} {best:8.1f} {ratio:8.2f} {accepted:>9}")
    finally:
        for llm in engines.values():
            llm.close()
