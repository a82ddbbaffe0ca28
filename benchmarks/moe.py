"""One mixture-of-experts layer two ways, timed in one run: transformers' loop over the experts
hit ("eager") and its grouped_mm, what loomllm runs Mixtral and Qwen3-MoE with (the default).

Run: `loom bench kernel moe` (`--device cuda` on a GPU; a Mixtral-shaped block by default).
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

from loomllm.benchmarks import int_list

PROG = "loom bench kernel moe"
IMPLEMENTATIONS = ("eager", "grouped_mm")


def layer(hidden: int, inter: int, experts: int, top_k: int, dtype: Any, device: str) -> Any:
    """A Mixtral sparse-MoE block (router and experts) with random weights."""
    import torch
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=32,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=8,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    return model.model.layers[0].mlp


def seconds(fn: Any, device: str, rounds: int) -> float:
    """The best of `rounds` timed calls, after a warm-up call."""
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fn()
    best = float("inf")
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def call(experts: Any, implementation: str, x: Any, index: Any, weights: Any) -> Any:
    experts.config._experts_implementation = implementation
    return experts(x, index, weights)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int_list, default=[1, 64])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3584)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args(argv)
    import torch

    dtype = getattr(torch, args.dtype)
    block = layer(args.hidden, args.intermediate, args.experts, args.top_k, dtype, args.device)
    print(
        f"{PROG}: Mixtral-shaped block, hidden {args.hidden}, intermediate {args.intermediate}, "
        f"{args.experts} experts, top {args.top_k}, {args.dtype} on {args.device}; ms a call of "
        f"the experts, best of {args.rounds} (routing done once, outside)"
    )
    print("| tokens | loop (eager) | grouped_mm | loop / grouped_mm | max abs difference |")
    print("|---|---|---|---|---|")
    for tokens in args.batch_sizes:
        x = torch.randn(tokens, args.hidden, device=args.device, dtype=dtype)
        with torch.no_grad():
            _, weights, index = block.gate(x)
            ms = {}
            outs = {}
            for name in IMPLEMENTATIONS:
                run = functools.partial(call, block.experts, name, x, index, weights)
                ms[name] = seconds(run, args.device, args.rounds) * 1e3
                outs[name] = run()
        diff = (outs["eager"] - outs["grouped_mm"]).abs().max().item()
        print(
            f"| {tokens} | {ms['eager']:.3f} | {ms['grouped_mm']:.3f} | "
            f"x{ms['eager'] / ms['grouped_mm']:.2f} | {diff:.1e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
