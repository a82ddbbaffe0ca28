"""Cold start and warm attach: a new process's `Engine(model)` to its first token.

Cold: no manager runs yet; warm: a new process attaches to a kept worker.
Run: `loom bench engine start`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loomllm.benchmarks.gpu_bench import SHAPES, write_model_dir
from loomllm.protocols.choices import MODEL_IMPLS
from loomllm.protocols.rundir import log_path, workers_dir

PROG = "loom bench engine start"
CHILD = """
import json, sys, time
import anyio
from loomllm import Engine, SamplingParams

model, dtype, device, model_impl = sys.argv[1:5]

async def main():
    entered = time.perf_counter()
    async with Engine(model, load_format="dummy", dtype=dtype, device=device,
                      model_impl=model_impl, keep_alive=600) as engine:
        attached = time.perf_counter()
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        async for _ in engine.generate({"prompt_token_ids": [5, 6, 7]}, params):
            pass
        first = time.perf_counter()
        reused = engine.reused_warm_workers
    print(json.dumps({"attach_s": attached - entered, "first_token_s": first - entered,
                      "reused": reused}))

anyio.run(main)
"""


IMPORTS = """
import json, sys, time
started = time.perf_counter()
for name in sys.argv[1:]:
    __import__(name)
print(json.dumps(time.perf_counter() - started))
"""


def import_times() -> None:
    """Print whether bytecode is cached, then the imports' wall time in fresh interpreters."""
    import importlib.util

    from loomllm.workers.worker.zygote import PRELOAD, PRELOAD_LATER

    # Before the timed imports, which may write the bytecode they did not find.
    spec = importlib.util.find_spec("transformers.modeling_utils")
    cached = (
        spec is not None
        and spec.origin is not None
        and Path(importlib.util.cache_from_source(spec.origin)).is_file()
    )
    print(
        f"bytecode: written by this interpreter: {not sys.dont_write_bytecode}; "
        f"transformers.modeling_utils has a cached .pyc: {cached}"
    )
    # The zygote skips what is not installed (gguf on a GPU host, say); so does the timing.
    later = [n for n in PRELOAD_LATER if importlib.util.find_spec(n.partition(".")[0])]
    if missing := sorted(set(PRELOAD_LATER) - set(later)):
        print(f"not installed, not timed: {', '.join(missing)}")
    sets = [
        ("torch", ["torch"]),
        ("the zygote's list", list(PRELOAD)),
        ("and transformers' modeling code", [*PRELOAD, *later]),
    ]
    for what, names in sets:
        done = subprocess.run(
            [sys.executable, "-c", IMPORTS, *names], capture_output=True, text=True, timeout=300
        )
        seconds = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
        print(
            f"imports, {what}: "
            + (f"{seconds:.2f} s" if seconds is not None else f"failed: {done.stderr[-300:]}")
        )


def run_child(
    model: str, args: argparse.Namespace, env: dict[str, str], model_impl: str
) -> dict[str, float]:
    """One new process to its first token: its own figures and the launch-to-token time."""
    launched = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, model, args.dtype, args.device, model_impl],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the engine process failed:\n{done.stderr[-3000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    # The child's exit (releasing its engine) is after its first token: not counted.
    figures["process_s"] = time.perf_counter() - launched
    return figures


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--warm", type=int, default=3, help="warm attaches after the cold start")
    p.add_argument("--logs", type=Path, help="copy the manager's and workers' logs to this folder")
    p.add_argument(
        "--import-times",
        action="store_true",
        help="first time the workers' imports in fresh interpreters",
    )
    p.add_argument(
        "--model-impl",
        default="auto",
        help="one or two model_impl values, comma-separated, each run in turn "
        "(auto, loom, transformers)",
    )
    args = p.parse_args(argv)
    impls = args.model_impl.split(",")
    if not set(impls) <= set(MODEL_IMPLS) or len(impls) > 2:
        p.error(f"--model-impl takes one or two of {', '.join(MODEL_IMPLS)}, comma-separated")
    if args.import_times:
        import_times()
    print(f"{args.shape}, {args.dtype} on {args.device}: a new process to its first token")
    print(
        "| start | model_impl | reused warm workers | Engine() entered to attached s | "
        "to first token s | process launch to first token s |"
    )
    print("|---|---|---|---|---|---|")
    colds = [start_sequence(args, impl) for impl in impls]
    if len(impls) == 2:
        print(
            f"cold start, process launch to first token: {impls[1]} / {impls[0]} = "
            f"{colds[1] / colds[0]:.2f}"
        )


def start_sequence(args: argparse.Namespace, model_impl: str) -> float:
    """A cold start and `args.warm` warm attaches, printed as table rows; the cold start's
    launch-to-first-token seconds."""
    with tempfile.TemporaryDirectory(prefix="loom-start-", dir="/tmp") as tmp:
        model = write_model_dir(args.shape, Path(tmp))
        # A manager of its own: none runs at the cold start, and none outlives the run.
        env = {**os.environ, "LOOM_MANAGER_SOCKET": str(Path(tmp) / "m.sock")}
        try:
            runs = [("cold", run_child(model, args, env, model_impl))]
            runs += [
                (f"warm {i + 1}", run_child(model, args, env, model_impl)) for i in range(args.warm)
            ]
        finally:
            subprocess.run(
                [sys.executable, "-P", "-m", "loomllm.workers.manager", "stop"],
                env=env,
                capture_output=True,
                timeout=120,
            )
            if args.logs:  # the worker's log says what the KV profiling pass and capture did
                socket = Path(env["LOOM_MANAGER_SOCKET"])
                logs = args.logs / model_impl
                logs.mkdir(parents=True, exist_ok=True)
                for log in [log_path(socket), *workers_dir(socket).glob("*.log")]:
                    shutil.copy(log, logs)
    for name, f in runs:
        print(
            f"| {name} | {model_impl} | {f['reused']} | {f['attach_s']:.2f} | "
            f"{f['first_token_s']:.2f} | {f['process_s']:.2f} |"
        )
    cold_reused, *warm = (f["reused"] for _, f in runs)
    if cold_reused or not all(warm):
        raise SystemExit("the cold start found warm workers, or a warm one did not")
    return runs[0][1]["process_s"]


if __name__ == "__main__":
    main()
