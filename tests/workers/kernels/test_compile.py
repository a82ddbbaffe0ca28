"""The CUDA path's Triton kernels compile for real GPUs (H100, A100), on a host without one.

The other kernel tests run them in Triton's interpreter, which compiles nothing; here
`loom bench kernel compile` replays a CUDA worker's start with Triton's compiler and ptxas
(benchmarks/kernel_compile.py), in a process without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from loomllm.benchmarks.kernel_compile import Census, Variant

pytestmark = pytest.mark.compute

# What a start compiles: the kernels a step of the model launches on the CUDA path.
OWN_MODEL = {
    "_rms_norm_kernel",
    "_add_rms_norm_kernel",
    "_rope_cache_kernel",
    "_silu_mul_kernel",
    "_prefill_kernel",
    "_decode_split_kernel",
    "_skinny_kernel",
}
TRANSFORMERS_MODEL = OWN_MODEL - {"_rope_cache_kernel", "_skinny_kernel"} | {
    "_rope_kernel",
    "_write_kv_kernel",
}


def compiler_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def test_every_kernel_a_cuda_start_launches_compiles_for_h100_and_a100() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loomllm.cli.main",
            "bench",
            "kernel",
            "compile",
            "--shape",
            "llama-8b,qwen-0.5b",
            "--model-impl",
            "auto,transformers",
            "--arch",
            "90,80",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=compiler_env(),
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.rstrip().endswith(
        "PASS  every variant compiled, within the GPU's shared memory, spilling nothing"
    )
    censuses = re.split(r"^\n", done.stdout, flags=re.M)
    heads = [re.match(r"(\S+), model_impl=(\w+), sm_(\d+): (\d+) variants", c) for c in censuses]
    seen = {(m[1], m[2], m[3]) for m in heads if m}
    assert seen == {
        (shape, impl, arch)
        for shape in ("llama-8b", "qwen-0.5b")
        for impl in ("auto", "transformers")
        for arch in ("90", "80")
    }
    for census, head in zip(censuses, heads, strict=True):
        if not head:
            continue
        rows = re.findall(
            r"^\| ([^|]+) \| (\w+) \| ([\d.]+) \| (\d+) \| (\d+) \| (\d+) \|$", census, re.M
        )
        assert len(rows) == int(head[4]), census
        kernels = {kernel for _, kernel, *_ in rows}
        assert kernels == (OWN_MODEL if head[2] == "auto" else TRANSFORMERS_MODEL), census
        # A register spilled to local memory would slow a kernel down: none spills.
        assert all(stack == "0" for *_, stack in rows), census
        # The graphs' buckets reuse the variants the profiling pass and the largest
        # buckets compiled: a start compiles each kernel once, and the skinny matmul
        # once for each bias and input width it meets.
        steps = {kernel: step for step, kernel, *_ in reversed(rows)}
        assert steps["_rms_norm_kernel"] == "profile", census
        assert steps["_decode_split_kernel"] == "decode 256", census


def test_a_kernel_the_compiler_refuses_is_a_failure_of_the_census(tmp_path) -> None:
    script = tmp_path / "refused.py"  # Triton reads a kernel's source from its file
    script.write_text("""
import json, torch, triton, triton.language as tl
from loomllm.benchmarks.kernel_compile import compile_only

@triton.jit
def not_a_power_of_two(x_ptr, N: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, N), 1.0)

raised = None
with compile_only(90) as census:
    try:
        not_a_power_of_two[(1,)](torch.empty(3), N=3)
    except Exception as exc:
        raised = type(exc).__name__
print(json.dumps([raised, census.problems()]))
""")
    env = compiler_env()
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    raised, problems = json.loads(done.stdout.strip().splitlines()[-1])
    assert raised == "CompilationError"
    assert len(problems) == 1, problems
    assert problems[0].startswith("not_a_power_of_two (load): CompilationError"), problems
    assert "arange's range must be a power of 2" in problems[0]


def test_more_shared_memory_than_the_gpu_has_or_a_spill_is_a_problem() -> None:
    census = Census(
        90,
        [
            Variant("decode 8", "k", 0.1, shared=232448, stack=0),
            Variant("decode 8", "big", 0.1, shared=232449, stack=0),
            Variant("profile", "spills", 0.1, shared=0, stack=8),
        ],
    )
    assert census.problems() == [
        "big (decode 8): 232449 bytes of shared memory, sm_90 has 232448",
        "spills (profile): 8 bytes of stack, spilled registers",
    ]
