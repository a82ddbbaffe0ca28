"""Prompt attention on the CPU: the C++ ops' prefill_attention over a paged cache against
torch's causal scaled_dot_product_attention on the same prompts, alternated in one process.

Run: `loom bench kernel cpu-prefill-attention`. SmolLM2-135M's heads by default (9 query heads, 3 KV
heads of 64 dims), in bfloat16 where the CPU computes it natively, else float32.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

PROG = "loom bench kernel cpu-prefill-attention"


def prompt_shape(text: str) -> tuple[int, int]:
    """argparse type for "LENGTHxPROMPTS", e.g. "1024x2"."""
    try:
        length, prompts = (int(part) for part in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is LENGTHxPROMPTS, got {text!r}") from None
    if length < 1 or prompts < 1:
        raise argparse.ArgumentTypeError(f"a shape needs LENGTH, PROMPTS >= 1, got {text!r}")
    return length, prompts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument(
        "--shapes",
        default="128x16,1024x2,4096x1",
        help="prompt length x prompts of each call, comma-separated",
    )
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5, help="alternated calls of each, a shape")
    args = p.parse_args(argv)
    try:
        shapes = [prompt_shape(text) for text in args.shapes.split(",")]
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    if min(args.heads, args.kv_heads, args.head_dim, args.rounds) < 1:
        p.error("--heads, --kv-heads, --head-dim and --rounds must be >= 1")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    import torch

    from loomllm.workers.device.cpu_features import cpu_supports_bf16
    from loomllm.workers.kernels import cpu_native
    from loomllm.workers.models.sources import cache_root

    ops = cpu_native.load(cache_root())
    if ops is None:
        raise SystemExit(f"{PROG}: the C++ ops did not build (is a C++ compiler installed?)")
    dtype = torch.bfloat16 if cpu_supports_bf16() else torch.float32
    heads, kv_heads, dim = args.heads, args.kv_heads, args.head_dim
    print(
        f"{dtype}, {heads} query heads, {kv_heads} KV heads of {dim}, "
        f"{torch.get_num_threads()} threads; median of {args.rounds} alternated calls"
    )
    print(
        f"{'shape':>10} {'loomllm ms':>11} {'SDPA ms':>9} {'GMAC/s':>8} {'SDPA / loomllm':>15}"
        f" {'max |diff|':>11}"
    )
    generator = torch.Generator().manual_seed(0)
    for length, prompts in shapes:
        mine, sdpa, difference = compare(
            ops, dtype, heads, kv_heads, dim, length, prompts, args.rounds, generator
        )
        macs = 2 * prompts * heads * length * (length + 1) / 2 * dim  # scores, then values
        print(
            f"{length:>5}x{prompts:<4} {mine * 1e3:>11.2f} {sdpa * 1e3:>9.2f} "
            f"{macs / mine / 1e9:>8.0f} {sdpa / mine:>15.2f} {difference:>11.2e}"
        )


def compare(
    ops: Any,
    dtype: Any,
    heads: int,
    kv_heads: int,
    dim: int,
    length: int,
    prompts: int,
    rounds: int,
    generator: Any,
) -> tuple[float, float, float]:
    """(loomllm's median seconds, SDPA's, the largest difference of their outputs) for
    `prompts` prompts of `length` tokens, each attended whole."""
    import torch
    import torch.nn.functional as F

    tokens = length * prompts
    # The prompts' keys in pages of 16 slots taken in a shuffled order, as a paged cache
    # hands them out.
    pages = torch.randperm(-(-tokens // 16), generator=generator)
    slots = (pages[:, None] * 16 + torch.arange(16)).flatten()[:tokens].view(prompts, -1)
    k = torch.randn(len(pages) * 16, kv_heads, dim, generator=generator).to(dtype)
    v = torch.randn(len(pages) * 16, kv_heads, dim, generator=generator).to(dtype)
    q = torch.randn(tokens, heads, dim, generator=generator).to(dtype)
    lens = torch.full((prompts,), length)
    starts = torch.arange(prompts) * length
    scale = dim**-0.5

    def ours() -> torch.Tensor:
        return ops.prefill_attention(q, k, v, slots, lens, starts, lens, scale, 0, 0.0, None)

    # SDPA's inputs as it wants them, gathered and laid out before the clock starts.
    q_b = q.view(prompts, length, heads, dim).transpose(1, 2)
    k_b = k[slots].transpose(1, 2)
    v_b = v[slots].transpose(1, 2)

    def theirs() -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q_b, k_b, v_b, is_causal=True, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(tokens, heads, dim)

    difference = (ours().float() - theirs().float()).abs().max().item()
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    for _ in range(rounds):
        for name, call in (("ours", ours), ("theirs", theirs)):
            started = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - started)
    return statistics.median(times["ours"]), statistics.median(times["theirs"]), difference


if __name__ == "__main__":
    main()
