"""The paged decode attention alone, against the time to read its KV bytes at copy bandwidth.

Run: `loom bench kernel decode-attention` on CUDA (`--device cpu`: a smoke test in the interpreter).
"""

from __future__ import annotations

import argparse
import functools
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

from loomllm.benchmarks import int_list, parsed_list
from loomllm.benchmarks.decode_profile import timer
from loomllm.benchmarks.gpu_bench import SHAPES, copy_bandwidth

PROG = "loom bench kernel decode-attention"
BLOCK_SIZE = 16
# Keys a step x warps x stages: the 16-key tilings walk a page a step, as the kernel did
# before it took several; every one compiles for sm_90 with no spill (`loom bench kernel compile`).
TILINGS = (
    "16x4x3,16x8x2,32x4x2,32x4x3,32x8x2,64x4x1,64x4x2,64x4x3,64x8x2,64x8x3,"
    "128x4x2,128x8x1,128x8x2,128x8x3"
)
CHECKED_REQUESTS = 8  # rows of each batch checked against a float64 reference


def context_range(text: str) -> tuple[int, int]:
    """argparse type for "1024-2048"."""
    try:
        low, high = (int(part) for part in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a context range is LOW-HIGH, got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"a context range needs 1 <= LOW <= HIGH, got {text!r}")
    return low, high


def paged_batch(
    batch: int, contexts: tuple[int, int], kv_heads: int, heads: int, head_dim: int, device: str
) -> dict[str, Any]:
    """`batch` requests with contexts drawn from `contexts` in a cache of shuffled pages."""
    import torch

    rng = random.Random(batch)
    lens = [rng.randint(*contexts) for _ in range(batch)]
    pages = [-(-n // BLOCK_SIZE) for n in lens]
    order = torch.randperm(sum(pages), generator=torch.Generator().manual_seed(batch))
    width = max(pages)
    tables = torch.zeros(batch, width, dtype=torch.int32)
    taken = 0
    for i, n in enumerate(pages):
        tables[i, :n] = order[taken : taken + n]
        taken += n
    shape = (sum(pages) * BLOCK_SIZE, kv_heads, head_dim)
    return {
        "q": torch.randn(batch, heads, head_dim, device=device, dtype=torch.bfloat16),
        "k": torch.randn(shape, device=device, dtype=torch.bfloat16),
        "v": torch.randn(shape, device=device, dtype=torch.bfloat16),
        "tables": tables.to(device),
        "lens": torch.tensor(lens, dtype=torch.int32, device=device),
        "longest": contexts[1],
        "kv_bytes": sum(lens) * 2 * kv_heads * head_dim * 2,  # K and V, bf16
    }


def worst_error(out: Any, b: dict[str, Any], scale: float) -> float:
    """The worst relative error of CHECKED_REQUESTS rows against a float64 reference."""
    import torch

    from loomllm.benchmarks.attention_reference import reference, relative_error, slots_of

    tables, lens = b["tables"].tolist(), b["lens"].tolist()
    worst = 0.0
    for i in range(0, len(lens), max(1, len(lens) // CHECKED_REQUESTS)):
        # The request's own K/V, gathered on the device and compared on the host.
        slots = b["k"].new_tensor(slots_of(tables[i], lens[i], BLOCK_SIZE), dtype=torch.long)
        k, v = b["k"][slots].cpu(), b["v"][slots].cpu()
        ref = reference(b["q"][i : i + 1].cpu(), k, v, list(range(lens[i])), 1, scale, None)
        worst = max(worst, relative_error(out[i : i + 1].cpu(), ref))
    return worst


def main(argv: list[str] | None = None) -> None:
    from loomllm.workers.attention.triton_kernels import AttentionTiling

    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    p.add_argument("--batch-sizes", type=int_list, default=[64, 256])
    p.add_argument("--contexts", type=context_range, default=(1024, 2048))
    p.add_argument(
        "--tilings",
        type=parsed_list(AttentionTiling.parse, "tilings are keys x warps x stages"),
        default=TILINGS,
    )
    p.add_argument("--reps", type=int, default=20, help="launches per timed graph")
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--best-to",
        type=Path,
        help="write the tiling fastest over all the batch sizes here (LOOM_DECODE_TILING's form)",
    )
    args = p.parse_args(argv)
    import torch

    from loomllm.workers.attention import triton_kernels as ta

    s = SHAPES[args.shape]
    heads, kv_heads = s["num_attention_heads"], s["num_key_value_heads"]
    head_dim = s["hidden_size"] // heads
    scale = head_dim**-0.5
    cuda = args.device.startswith("cuda")
    seconds = timer(args.device, args.reps)
    copy = copy_bandwidth(args.device)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(
        f"{PROG}: {args.shape} ({heads} heads, {kv_heads} KV heads, dim {head_dim}), bf16, "
        f"pages of {BLOCK_SIZE}, contexts {args.contexts[0]}-{args.contexts[1]}, on {name}; "
        f"copy bandwidth {copy / 1e9:.0f} GB/s (read + write); default tiling "
        f"{ta.DECODE_TILING}"
    )
    print(
        "x floor: the time over that of reading the KV bytes at the copy bandwidth; error: "
        f"the worst of {CHECKED_REQUESTS} rows against float64 (< 1e-2)"
    )
    total: dict[Any, float] = defaultdict(float)  # a tiling's seconds over the batch sizes
    for batch in args.batch_sizes:
        b = paged_batch(batch, args.contexts, kv_heads, heads, head_dim, args.device)
        floor = b["kv_bytes"] / copy
        counts = torch.zeros(batch * kv_heads, dtype=torch.int32, device=args.device)
        print(
            f"\nbatch {batch}: {b['kv_bytes'] / 1e9:.2f} GB of K and V, floor "
            f"{floor * 1e3:.3f} ms\n| tiling | ms | GB/s | x floor | error |\n|---|---|---|---|---|"
        )
        best = None
        for tiling in args.tilings:
            call = functools.partial(
                ta.decode_attention,
                b["q"],
                b["k"],
                b["v"],
                b["tables"],
                b["lens"],
                b["longest"],
                BLOCK_SIZE,
                scale,
                split_counts=counts,
                tiling=tiling,
            )
            try:
                error = worst_error(call(), b, scale)
                took = seconds(call)
            except Exception as exc:  # a tiling this GPU cannot build or run
                print(f"| {tiling} | failed: {type(exc).__name__}: {str(exc)[:80]} | | | |")
                total[tiling] = float("inf")
                continue
            mark = " (default)" if tiling == ta.DECODE_TILING else ""
            print(
                f"| {tiling}{mark} | {took * 1e3:.3f} | {b['kv_bytes'] / took / 1e9:.0f} | "
                f"{took / floor:.2f} | {error:.1e} |",
                flush=True,
            )
            total[tiling] += took if error < 1e-2 else float("inf")
            if error < 1e-2 and (best is None or took < best[1]):
                best = (tiling, took)
        if best is not None:
            print(f"batch {batch}: fastest {best[0]}, x{best[1] / floor:.2f} the floor")
        del b
        if cuda:
            torch.cuda.empty_cache()
    ran_all = [t for t in total if total[t] < float("inf")]
    if ran_all:
        fastest = min(ran_all, key=total.__getitem__)
        default = total.get(ta.DECODE_TILING)
        print(
            f"\nfastest over batches {','.join(map(str, args.batch_sizes))}: {fastest}"
            + (f", x{default / total[fastest]:.2f} faster than the default" if default else "")
        )
        if args.best_to:
            args.best_to.write_text(str(fastest))


if __name__ == "__main__":
    main()
