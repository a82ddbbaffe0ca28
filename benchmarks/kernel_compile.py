"""Every Triton kernel a CUDA worker's start compiles, compiled for a GPU on a host without one.

Exits 1 on a failed compile, a shared-memory overflow or a spill. Run: `loom bench kernel compile`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from loomllm.benchmarks.gpu_bench import shape_config
from loomllm.config import EngineConfig

PROG = "loom bench kernel compile"
# 512, 128256 and 151936 specialize alike (> 1, multiples of 16): the same variants compile.
VOCAB = 512
MAX_NUM_SEQS = 256  # the engine's default: decode buckets 1..256
BLOCK_SIZE = 16
# Shared memory a block may use, bytes (CUDA's per-block opt-in maximum).
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


@dataclass
class Variant:
    """One compiled kernel variant."""

    step: str  # what first launched it: "profile", "mixed-step 2048", "decode 8", ...
    kernel: str
    seconds: float
    shared: int = 0
    registers: int | None = None
    stack: int | None = None  # bytes a thread keeps in local memory: spilled registers
    error: str = ""


@dataclass
class Census:
    arch: int
    variants: list[Variant] = field(default_factory=list)
    step: str = "load"

    def problems(self) -> list[str]:
        limit = SHARED_LIMIT.get(self.arch)
        out = [f"{v.kernel} ({v.step}): {v.error}" for v in self.variants if v.error]
        if limit is not None:
            out += [
                f"{v.kernel} ({v.step}): {v.shared} bytes of shared memory, sm_{self.arch} "
                f"has {limit}"
                for v in self.variants
                if v.shared > limit
            ]
        out += [
            f"{v.kernel} ({v.step}): {v.stack} bytes of stack, spilled registers"
            for v in self.variants
            if v.stack
        ]
        return out


class _CompileOnlyDriver:
    """What Triton's JIT asks its driver while compiling: a device, a stream, the target."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target


@contextlib.contextmanager
def compile_only(arch: int) -> Iterator[Census]:
    """Triton launches in this block compile for sm_`arch` (each variant once, as the JIT
    caches them) and launch nothing; the census lists what compiled."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    census = Census(arch)
    compile_launch = JITFunction.run
    seen: list[JITFunction] = []

    def run(kernel: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        cached = len(kernel.device_caches[0][0])  # the variants compiled so far
        started = time.perf_counter()
        try:
            compiled = compile_launch(kernel, *args, grid=grid, warmup=True, **kwargs)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"[:2000]
            census.variants.append(
                Variant(census.step, kernel.fn.__name__, time.perf_counter() - started, error=error)
            )
            raise
        if len(kernel.device_caches[0][0]) > cached:  # a new variant, not a cache hit
            seen.append(kernel)
            census.variants.append(
                _described(compiled, census, kernel.fn.__name__, time.perf_counter() - started)
            )
        return compiled

    previous = driver._active  # reset_active() would look for a GPU driver, and find none
    driver.set_active(_CompileOnlyDriver(GPUTarget("cuda", arch, 32)))
    try:
        # An empty cache of compiled kernels: each variant compiles here, and is timed.
        with (
            tempfile.TemporaryDirectory(prefix="loom-triton-") as cache,
            mock.patch.dict(os.environ, {"TRITON_CACHE_DIR": cache}),
            mock.patch.object(JITFunction, "run", run),
        ):
            yield census
    finally:
        driver._active = previous
        for kernel in seen:  # compiled for this arch only: the next block compiles afresh
            kernel.device_caches.clear()


def _described(compiled: Any, census: Census, name: str, seconds: float) -> Variant:
    """The variant's shared memory (Triton's metadata), and its registers and stack (where
    spilled registers go) as its cubin says (cuobjdump, which Triton ships beside ptxas)."""
    import triton

    variant = Variant(census.step, name, seconds, shared=compiled.metadata.shared)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        done = subprocess.run([str(tool), "-res-usage", cubin.name], capture_output=True, text=True)
    usage = re.search(r"REG:(\d+) STACK:(\d+)", done.stdout)
    if usage:
        variant.registers, variant.stack = int(usage[1]), int(usage[2])
    return variant


@contextlib.contextmanager
def cpu_as_cuda_start(census: Census) -> Iterator[None]:
    """A CUDA worker's start, run on the CPU: graph capture and the allocator's statistics
    do nothing, graph buckets are named in `census.step`, `F.linear` returns zeros, and the
    fused kernels take CPU tensors."""
    import torch

    from loomllm.workers.kernels import fused_ops
    from loomllm.workers.models import fused_layers
    from loomllm.workers.runner import step_graphs

    capture = step_graphs.capture_buckets

    def named_capture(sizes: list[int], run: Any, pool: Any, what: str) -> Any:
        def named(size: int) -> Any:
            census.step = f"{what} {size}"
            return run(size)

        return capture(sizes, named, pool, what)

    def fits(*tensors: torch.Tensor) -> bool:
        return all(t.dtype in fused_ops.DTYPES for t in tensors)

    def zeros(x: torch.Tensor, weight: torch.Tensor, bias: Any = None) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], weight.shape[0])

    class Graph:
        def replay(self) -> None:
            pass

    patches = [
        (torch.cuda, "CUDAGraph", Graph),
        (torch.cuda, "graph", lambda graph, pool=None, **kw: contextlib.nullcontext()),
        (torch.cuda, "graph_pool_handle", lambda: None),
        (torch.cuda, "synchronize", lambda *a, **kw: None),
        (torch.cuda, "empty_cache", lambda: None),
        (torch.cuda, "reset_peak_memory_stats", lambda *a: None),
        (torch.cuda, "memory_reserved", lambda *a: 0),
        (torch.cuda, "max_memory_reserved", lambda *a: 0),
        (torch.nn.functional, "linear", zeros),
        (step_graphs, "capture_buckets", named_capture),
        (fused_ops, "runs_here", fits),
        (fused_layers, "runs_here", fits),
    ]
    with contextlib.ExitStack() as stack:
        for target, name, value in patches:
            stack.enter_context(mock.patch.object(target, name, value))
        yield


def worker_start(shape: str, model_impl: str, census: Census) -> None:
    """What loomllm.workers.worker.state's CUDA fast path runs: the fused kernels, the KV profiling
    pass, then the mixed-step and decode graphs' captures, largest first."""
    import torch

    from loomllm.workers.models.fused_layers import install_fused_ops
    from loomllm.workers.models.llama.model import Linear
    from loomllm.workers.models.loader import load_model
    from loomllm.workers.runner import kv_sizing
    from loomllm.workers.runner.model_runner import ModelRunner

    config = shape_config(shape)
    # One decoder layer at the shape's widths launches every variant the whole model does.
    config.num_hidden_layers, config.vocab_size = 1, VOCAB
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    with tempfile.TemporaryDirectory(prefix="loom-compile-") as model_dir:
        config.save_pretrained(model_dir)
        loaded = load_model(model_dir, dtype="bfloat16", load_format="dummy", model_impl=model_impl)
    with cpu_as_cuda_start(census):
        install_fused_ops(loaded.model)
        for module in loaded.model.modules():
            if isinstance(module, Linear):
                # As if skinny_matmul.pick had chosen the kernel for every weight.
                module.skinny = True

        def make_runner(num_blocks: int) -> ModelRunner:
            return ModelRunner(
                loaded.model,
                loaded.config,
                device=torch.device("cpu"),
                dtype=torch.bfloat16,
                block_size=BLOCK_SIZE,
                num_blocks=num_blocks,
                attention_backend="triton",
            )

        # The step the workers of an engine with default options profile.
        options = EngineConfig().worker_spec().options
        step_tokens = kv_sizing.largest_step_tokens(options, loaded.max_model_len)
        census.step = "profile"
        kv_sizing.profile_activation_bytes(
            torch.device("cpu"), step_tokens, BLOCK_SIZE, VOCAB, loaded.max_model_len, make_runner
        )
        # Room for the longest context: decode graphs size their split-K for it.
        runner = make_runner(-(-loaded.max_model_len // BLOCK_SIZE) + 1)
        runner.enable_graphs(
            MAX_NUM_SEQS, loaded.max_model_len, capture=True, max_step_tokens=step_tokens
        )


def print_census(label: str, census: Census) -> None:
    limit = SHARED_LIMIT.get(census.arch, "?")
    print(
        f"\n{label}, sm_{census.arch}: {len(census.variants)} variants, "
        f"{sum(v.seconds for v in census.variants):.2f} s of compiling here"
    )
    print(
        f"| first launched by | kernel | compile s | shared bytes (of {limit}) | registers "
        "| stack bytes |"
    )
    print("|---|---|---|---|---|---|")
    for v in census.variants:
        if v.error:
            print(f"| {v.step} | {v.kernel} | FAILED | | | |")
        else:
            print(
                f"| {v.step} | {v.kernel} | {v.seconds:.2f} | {v.shared} | {v.registers} "
                f"| {v.stack} |"
            )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-8b", help="comma-separated: llama-8b, qwen-0.5b, tiny")
    p.add_argument("--model-impl", default="auto", help="comma-separated: auto, transformers")
    p.add_argument(
        "--arch",
        default="90",
        help="comma-separated compute capabilities: 90 (H100), 89, 86, 80 (A100)",
    )
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("Triton's interpreter compiles nothing: run without TRITON_INTERPRET=1")
    # Registers and spills are those of the Triton installed here; another version may
    # allocate differently.
    problems = []
    for arch in (int(a) for a in args.arch.split(",")):
        for shape in args.shape.split(","):
            for impl in args.model_impl.split(","):
                label = f"{shape}, model_impl={impl}"
                with compile_only(arch) as census:
                    try:
                        worker_start(shape, impl, census)
                    except Exception as exc:
                        if not any(v.error for v in census.variants):  # not a kernel's
                            raise
                        print(f"{label}: the start stopped at a kernel that failed: {exc}")
                print_census(label, census)
                problems += [f"{label}, sm_{arch}: {p}" for p in census.problems()]
    print()
    for problem in problems:
        print(f"FAIL  {problem}")
    if problems:
        sys.exit(1)
    print("PASS  every variant compiled, within the GPU's shared memory, spilling nothing")


if __name__ == "__main__":
    main()
