"""A GPU session's benchmarks as one command, most needed first, each within a time budget.

Run: `loom bench gpu-session --out DIR`, or on a bare host `python3 benchmarks/gpu_session.py`.
"""

from __future__ import annotations

# Standard library only: a GPU host runs this before the wheels it carries are installed.
import argparse
import dataclasses
import importlib.util
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

PROG = "loom bench gpu-session"
ROOT = Path(__file__).resolve().parent.parent
GRACE_S = 20  # after SIGINT, for a benchmark to stop its manager and free the GPU
BEST_TILING = "decode-tiling.txt"  # the attention step's fastest tiling


@dataclasses.dataclass
class Step:
    """One command of the session, and the least budget worth starting it with."""

    name: str
    what: str
    argv: list[str]
    needs_s: float
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    status: str = "not run"
    seconds: float = 0.0
    output: str = ""


def bench(*args: str) -> list[str]:
    return [sys.executable, "-m", "loomllm.cli.main", "bench", *args]


def plan(
    device: str, big: str, small: str, logs: Path, kernel_cache: Path, check_skip: str = ""
) -> list[Step]:
    """The session's steps in the order they run: correctness (gpu-check, less the checks in
    `check_skip`), then the issue's headline figures and what explains them, then what was
    measured before."""
    on = ["--device", device]
    skip = ["--skip", check_skip] if check_skip else []
    return [
        Step(
            "check",
            "kernels, graphs, engines and the models' features against their references",
            bench("gpu-check", *on, "--shape", small, *skip),
            300,  # 272 s on an H200, most of it building and loading the models' layers
        ),
        # Every tiling of the decode attention, alone at batch 64 and 256 over 1-2k-token
        # contexts; the fastest is what the steps after it run (LOOM_DECODE_TILING).
        Step(
            "attention",
            "the decode attention's tilings against reading its K/V at copy bandwidth",
            bench(
                "kernel",
                "decode-attention",
                *on,
                "--shape",
                big,
                "--best-to",
                str(logs / BEST_TILING),
            ),
            60,
        ),
        # Without the async-off run and the enforce_eager stream: neither is a target, and
        # the steps after this one need their time more.
        Step(
            "throughput",
            "workload (a) with async scheduling, offline and through loom serve; one stream",
            bench("gpu", *on, "--shape", big, "--skip", "async-off,continuous,generate,eager"),
            200,
        ),
        Step(
            "profile",
            "a decode step's kernels at batch 64 and 256, alone and with a 512-token prompt; "
            "each matmul's bandwidth; the floors",
            bench(
                "kernel",
                "decode-profile",
                *on,
                "--shape",
                big,
                "--batch-sizes",
                "64,256",
                "--runs",
                "graphs",
                "--tilings",
                "",
                # A step that admits a prompt too: workload (a)'s 160 such steps take twice
                # their FLOPs, and this says where.
                "--mixed-prompt",
                "512",
            ),
            75,
        ),
        # Workload (a) with room for all 500 requests at once: fewer steps carry prompts and
        # the longest request starts in the first one. `loom bench engine emulated` with the H200's
        # step times predicts about 4% less time than at 256; this measures it.
        Step(
            "seqs-512",
            "workload (a) offline with 512 sequences a batch, against 256 in the throughput step",
            bench(
                "gpu",
                *on,
                "--shape",
                big,
                "--max-num-seqs",
                "512",
                "--skip",
                "async-off,serve,continuous,generate,eager,stream",
            ),
            90,
        ),
        # An empty Triton cache: the cold start compiles every kernel, as a machine's first
        # start does (the steps before would otherwise have compiled them).
        Step(
            "start",
            "cold start and warm attaches, the imports timed",
            bench(
                "engine",
                "start",
                *on,
                "--shape",
                big,
                "--import-times",
                "--warm",
                "2",
                "--logs",
                str(logs / "start"),
            ),
            90,
            env={"TRITON_CACHE_DIR": str(kernel_cache)},
        ),
        Step(
            "small",
            "workload (a) at the small shape, where the host may bound it",
            bench(
                "gpu", *on, "--shape", small, "--skip", "async-off,serve,generate,continuous,stream"
            ),
            60,
        ),
        Step(
            "baseline",
            "loomllm against transformers' continuous batching, 128 requests",
            bench(
                "gpu",
                *on,
                "--shape",
                big,
                "--num-requests",
                "128",
                "--skip",
                "async-off,serve,generate,stream",
            ),
            240,
        ),
    ]


def take_best_tiling(step: Step, logs: Path, env: dict[str, str]) -> list[str]:
    """After the attention step, the steps after it run its fastest decode tiling (in `env`);
    the summary's line that says so."""
    best = logs / BEST_TILING
    if step.name != "attention" or not best.exists():
        return []
    env["LOOM_DECODE_TILING"] = best.read_text().strip()
    return [f"- decode tiling from the attention step on: {env['LOOM_DECODE_TILING']}"]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_step(step: Step, log: Path, limit_s: float, env: dict[str, str]) -> None:
    """Run one step with its output in `log`; interrupt it after `limit_s` seconds."""
    started = time.monotonic()
    with log.open("w") as out:
        # SIGINT back to its default in the step: a session started in the background
        # inherits it ignored, and Python then never raises KeyboardInterrupt for it.
        proc = subprocess.Popen(
            step.argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**env, **step.env},
            start_new_session=True,
            preexec_fn=_default_sigint,
        )
        try:
            rc = proc.wait(timeout=limit_s)
            step.status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            # SIGINT first: the benchmark's finally blocks stop its manager and workers.
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            step.status = f"interrupted after {limit_s:.0f} s"
    step.seconds = time.monotonic() - started
    step.output = log.read_text(errors="replace")


def run_steps(
    steps: Sequence[Step],
    logs: Path,
    budget_s: float,
    env: dict[str, str],
    after: Callable[[Step], None] = lambda step: None,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Each step in turn while the budget lasts, `after` called once each has run: one that
    needs more than is left is skipped; once one is interrupted, so are the rest (the budget
    is spent)."""
    deadline = clock() + budget_s
    for i, step in enumerate(steps):
        left = deadline - clock()
        if left < step.needs_s:
            step.status = f"skipped: {max(left, 0):.0f} s left, needs {step.needs_s:.0f}"
            continue
        run_step(step, logs / f"{i + 1:02d}-{step.name}.log", left, env)
        after(step)


def machine_lines(env: dict[str, str]) -> list[str]:
    """What the figures were measured on: the device, the driver, the packages."""
    lines = []
    for argv in (
        [
            "nvidia-smi",
            "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
            "--format=csv,noheader",
        ],
        [
            sys.executable,
            "-c",
            "import sys, torch, triton, transformers; "
            "print('python', sys.version.split()[0], '| torch', torch.__version__, "
            "'| triton', triton.__version__, '| transformers', transformers.__version__)",
        ],
        ["nproc"],
        ["git", "rev-parse", "--short", "HEAD"],
    ):
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
            )
            text = (done.stdout or done.stderr).strip() or f"exit {done.returncode}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            text = f"unavailable ({type(exc).__name__})"
        lines.append(f"- {argv[0] if argv[0] != sys.executable else 'packages'}: {text}")
    return lines


def install_wheels(wheels: Path, site: Path, env: dict[str, str]) -> str:
    """Install the carried wheels (`make gpu-wheels`) into `site`, put it on the children's
    PYTHONPATH; what was done, for the summary."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        if importlib.util.find_spec("loomllm") is None:
            raise SystemExit(
                f"{PROG}: no wheels in {wheels} and loomllm is not installed here: "
                "run `make gpu-wheels` and carry .whl/, or install this checkout"
            )
        return f"no wheels in {wheels}: the packages there are used as they are"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--find-links",  # setuptools, to build loomllm itself from this checkout
            str(wheels),
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            str(site),
            *map(str, found),
            str(ROOT),
        ],
        check=True,
        timeout=300,
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return f"{len(found)} wheels installed from {wheels}, and loomllm from {ROOT}"


def table(steps: Sequence[Step]) -> str:
    return "\n".join(
        ["| step | what | status | seconds |", "|---|---|---|---|"]
        + [f"| {s.name} | {s.what} | {s.status} | {s.seconds:.0f} |" for s in steps]
    )


def write_results(out: Path, steps: Sequence[Step], header: list[str], logs: Path) -> None:
    """summary.md and logs.tar.gz as they stand: rewritten after each step, so that a call
    cut off by its own time limit still brings back the steps it finished."""
    outputs = [
        f"## {s.name}: {s.status}\n\n`{' '.join(s.argv[3:])}`\n\n```\n"
        f"{s.output.strip()[-8000:]}\n```"
        for s in steps
        if s.output
    ]
    (out / "summary.md").write_text(
        "\n\n".join(["# GPU session", "\n".join(header), table(steps), *outputs]) + "\n"
    )
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(logs, arcname="logs")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-session"))
    p.add_argument(
        "--budget",
        type=float,
        default=540,
        help="seconds for all the steps; a step is started only while its need fits",
    )
    p.add_argument("--steps", help="comma-separated names: run only these, in plan order")
    p.add_argument(
        "--check-skip",
        default="",
        help="the check step's checks to leave out, comma-separated (gpu-check's --skip)",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--big", default="llama-8b", help="the shape of the headline figures")
    p.add_argument("--small", default="qwen-0.5b", help="the shape of the checks, host-bound")
    p.add_argument("--wheels", type=Path, default=ROOT / ".whl")
    p.add_argument("--list", action="store_true", help="print the plan and exit")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="loom-gpu-session-") as tmp:
        work = Path(tmp)
        steps = plan(
            args.device,
            args.big,
            args.small,
            work / "logs",
            work / "triton-cache",
            args.check_skip,
        )
        names = [s.name for s in steps]
        if args.steps:
            chosen = args.steps.split(",")
            if unknown := sorted(set(chosen) - set(names)):
                p.error(f"unknown steps {unknown}; the plan's: {','.join(names)}")
            steps = [s for s in steps if s.name in chosen]
        if args.list:
            for s in steps:
                print(f"{s.name} (needs {s.needs_s:.0f} s): {s.what}\n    {' '.join(s.argv[3:])}")
            return
        logs = work / "logs"
        logs.mkdir()
        args.out.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        header = [
            f"- budget: {args.budget:.0f} s",
            f"- wheels: {install_wheels(args.wheels, work / 'site', env)}",
            *machine_lines(env),
        ]
        print("\n".join(header), flush=True)

        def after(step: Step) -> None:
            header.extend(take_best_tiling(step, logs, env))
            write_results(args.out, steps, header, logs)
            # The output's end, as it comes: a reply that keeps only the tail still has it.
            tail = "\n".join(step.output.strip().splitlines()[-30:])
            print(f"\n## {step.name}: {step.status}, {step.seconds:.0f} s\n{tail}", flush=True)

        run_steps(steps, logs, args.budget, env, after)
        write_results(args.out, steps, header, logs)
    print(
        f"\n{table(steps)}\n{args.out / 'summary.md'}: each step's output; "
        f"logs.tar.gz: the whole logs"
    )
    # Skipped steps (the budget) are in the table; a failed or interrupted one is an error.
    sys.exit(1 if any(s.status.startswith(("failed", "interrupted")) for s in steps) else 0)


if __name__ == "__main__":
    main()
