"""Embeddings, timed in one run: loomllm (runner="pooling", every text batched by the engine)
against sentence-transformers' `encode` on the same model, with how far their vectors differ.

Run: `loom bench engine embed` (SmolLM2, last-token pooling, normalized: 256 texts of 20-200 tokens,
sentence-transformers at batch 64).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

PROG = "loom bench engine embed"


def texts_of(tokenizer: Any, count: int, low: int, high: int, seed: int) -> list[str]:
    """`count` texts of `low` to `high` tokens: random vocabulary ids, decoded."""
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    first = min(1000, vocab // 2)  # past the special and byte tokens
    return [
        tokenizer.decode([rng.randrange(first, vocab) for _ in range(rng.randint(low, high))])
        for _ in range(count)
    ]


def sentence_transformers_copy(model_dir: str, size: int, into: Path) -> str:
    """`model_dir` as a sentence-transformers model pooling as loomllm's default for a
    decoder without those files: the last token, normalized (links to its files)."""
    for path in Path(model_dir).iterdir():
        (into / path.name).symlink_to(path)
    modules = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    (into / "modules.json").write_text(
        json.dumps(
            [
                {"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{t}"}
                for i, (p, t) in enumerate(modules)
            ]
        )
    )
    (into / "1_Pooling").mkdir()
    (into / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": size, "pooling_mode_lasttoken": True})
    )
    return str(into)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--texts", type=int, default=256)
    p.add_argument("--min-tokens", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64, help="sentence-transformers' batch")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=3, help="each side's best of this many")
    args = p.parse_args(argv)
    import torch
    from sentence_transformers import SentenceTransformer

    from loomllm import LLM

    with (
        LLM(
            args.model, runner="pooling", dtype=args.dtype, quantization="none", manager="private"
        ) as llm,
        tempfile.TemporaryDirectory() as tmp,
    ):
        tokenizer = llm.get_tokenizer()
        texts = texts_of(tokenizer, args.texts, args.min_tokens, args.max_tokens, seed=0)
        tokens = sum(len(tokenizer.encode(t)) for t in texts)
        info = llm.engine.model_info
        assert info.pooling is not None
        st_dir = sentence_transformers_copy(info.model_dir, info.pooling.size, Path(tmp))
        st = SentenceTransformer(
            st_dir, device="cpu", model_kwargs={"dtype": getattr(torch, args.dtype)}
        )
        if st.tokenizer.pad_token is None:
            st.tokenizer.pad_token = st.tokenizer.eos_token
        runs: dict[str, Any] = {
            "loomllm": lambda: [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)],
            "sentence-transformers": lambda: st.encode(
                texts, batch_size=args.batch_size, convert_to_tensor=True
            ).tolist(),
        }
        best = {name: float("inf") for name in runs}
        vectors: dict[str, Any] = {}
        for run in runs.values():  # a warm-up each
            run()
        for _ in range(args.rounds):  # alternated, so that drift touches both alike
            for name, run in runs.items():
                start = time.perf_counter()
                vectors[name] = run()
                best[name] = min(best[name], time.perf_counter() - start)
    ours, theirs = (torch.tensor(vectors[name]) for name in runs)
    diff = (ours - theirs).abs().max().item()
    cosine = torch.nn.functional.cosine_similarity(ours, theirs).min().item()
    print(
        f"{PROG}: {args.model}, {args.dtype}, {args.texts} texts of {args.min_tokens}-"
        f"{args.max_tokens} tokens ({tokens} in all), sentence-transformers at batch "
        f"{args.batch_size}; best of {args.rounds}"
    )
    print("| engine | seconds | texts/s | tokens/s |")
    print("|---|---|---|---|")
    for name, seconds in best.items():
        print(f"| {name} | {seconds:.2f} | {args.texts / seconds:.1f} | {tokens / seconds:.0f} |")
    ratio = best["sentence-transformers"] / best["loomllm"]
    print(f"loomllm / sentence-transformers: x{ratio:.2f} (throughput)")
    print(f"vectors: max abs difference {diff:.1e}, lowest cosine similarity {cosine:.6f}")


if __name__ == "__main__":
    main()
