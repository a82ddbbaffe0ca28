"""Benchmark models at real shapes, made here: random-weight GGUFs from llama.cpp's own converter
and `llama-quantize`, and requantizations of SmolLM2-135M for accuracy work.

Run: `make bench-models` (or `loom bench models` after `make bench-peers`). The random weights
come from random_llama.py, one layer at a time; every step runs as a child whose peak memory
is measured.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loomllm.benchmarks import random_llama, serving
from loomllm.benchmarks.random_llama import SHAPES, num_parameters

PROG = "loom bench models"
LLAMA_SRC = serving.DEFAULT_LLAMA_SERVER.parents[2]
DEFAULT_QUANTIZE = serving.DEFAULT_LLAMA_SERVER.with_name("llama-quantize")
DEFAULT_OUT = serving.PEERS / "models"
# sentencepiece, which the converter imports, installed by `make bench-models` with
# `pip --target`: the converter runs on our venv's torch and transformers, with this folder added.
DEFAULT_CONVERT_DEPS = serving.PEERS / "convert-deps"
SHAPE_QUANTS = ("Q4_K_M", "Q8_0")
# SmolLM2-135M's shipped Q4_1 requantized; F32 is its dequantized reference.
REQUANTS = ("Q4_K_M", "Q6_K", "F32")


@dataclass(frozen=True, slots=True)
class Target:
    """One GGUF file to make: a shape's random model or the shipped 135M, in `qtype`."""

    source: str  # a key of SHAPES, or "smollm2-135m"
    qtype: str

    @property
    def name(self) -> str:
        return f"{self.source}-{self.qtype.lower()}.gguf"


TARGETS = [
    *(Target("smollm2-135m", q) for q in REQUANTS),
    *(Target(shape, q) for shape in SHAPES for q in SHAPE_QUANTS),
]


@dataclass(frozen=True, slots=True)
class Stage:
    """One step of the making: its wall time and the peak RSS of its process."""

    what: str
    seconds: float
    peak_rss_bytes: int


def run_stage(what: str, cmd: list[str], log: Path, env: dict | None = None) -> Stage:
    """Run one tool with its output in `log`, measuring its own peak RSS; on failure, exit
    with the log's tail."""
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        sys.exit(f"{what} failed ({proc.returncode}); the end of {log}:\n{tail}")
    stage = Stage(what, time.monotonic() - started, usage.ru_maxrss * 1024)
    print(f"  {what}: {stage.seconds:.0f} s, peak RSS {gb(stage.peak_rss_bytes)}", flush=True)
    return stage


def gb(n: int) -> str:
    """Bytes as decimal gigabytes, for the log lines and the summary."""
    return f"{n / 1e9:.2f} GB"


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each type the GGUF at `path` holds."""
    from gguf import GGUFReader

    return dict(Counter(t.tensor_type.name for t in GGUFReader(path).tensors).most_common())


class Maker:
    """Makes the targets into `out`, skipping those already there."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.work = self.out / "work"
        self.logs = self.out / "logs"
        self.stages: list[Stage] = []

    def quantize(self, source: Path, target: Target, requantize: bool) -> None:
        part = self.out / (target.name + ".part")
        cmd = [str(self.args.llama_quantize), *(["--allow-requantize"] if requantize else [])]
        cmd += [str(source), str(part), target.qtype, str(self.args.threads)]
        log = self.logs / f"{target.name}.log"
        self.stages.append(run_stage(f"llama-quantize {target.name}", cmd, log))
        part.replace(self.out / target.name)

    def make_requants(self, targets: list[Target]) -> None:
        from loomllm.workers.models.sources import resolve_model

        shipped = Path(resolve_model("smollm2").path)
        for target in targets:
            self.quantize(shipped, target, requantize=True)

    def make_shape(self, key: str, targets: list[Target]) -> None:
        """Random weights → a bf16 GGUF by the converter → each quant type; the intermediates
        are deleted unless asked to keep them."""
        bf16 = self.work / f"{key}-bf16.gguf"
        if not bf16.exists():
            self.convert(key, bf16)
        for target in targets:
            self.quantize(bf16, target, requantize=False)
        if not self.args.keep_intermediate:
            bf16.unlink()

    def convert(self, key: str, bf16: Path) -> None:
        """The shape's random model as a bf16 GGUF, through a safetensors folder."""
        folder = self.work / f"{key}-hf"
        if not (folder / ".weights-written").exists():
            self.write_hf_folder(key, folder)
        converter = self.args.llama_src / "convert_hf_to_gguf.py"
        part = bf16.with_suffix(".gguf.part")
        cmd = [sys.executable, str(converter), str(folder), "--outfile", str(part)]
        cmd += ["--outtype", "bf16", "--model-name", SHAPES[key].title]
        paths = [str(self.args.convert_deps), os.environ.get("PYTHONPATH", "")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths)), HF_HUB_OFFLINE="1")
        log = self.logs / f"{key}-convert.log"
        self.stages.append(run_stage(f"convert_hf_to_gguf {key}", cmd, log, env))
        part.replace(bf16)
        if not self.args.keep_intermediate:
            shutil.rmtree(folder)

    def write_hf_folder(self, key: str, folder: Path) -> None:
        """random_llama's folder for the converter, written by a child process: its peak memory
        is measured as the tools' is, and this one stays small (a child's peak counts its
        parent's memory at the fork)."""
        shutil.rmtree(folder, ignore_errors=True)
        print(f"  writing {num_parameters(SHAPES[key]) / 1e9:.2f} B random weights", flush=True)
        cmd = [sys.executable, "-m", random_llama.__name__, key, str(folder)]
        cmd += ["--seed", str(self.args.seed)]
        log = self.logs / f"{key}-weights.log"
        self.stages.append(run_stage(f"random weights {key}", cmd, log))


def wanted(args: argparse.Namespace) -> list[Target]:
    if args.only is None:
        return TARGETS
    names = {n.removesuffix(".gguf") for n in args.only}
    unknown = names - {t.name.removesuffix(".gguf") for t in TARGETS}
    if unknown:
        raise SystemExit(f"--only: no target {', '.join(sorted(unknown))}; known: {known_names()}")
    return [t for t in TARGETS if t.name.removesuffix(".gguf") in names]


def known_names() -> str:
    return ", ".join(t.name.removesuffix(".gguf") for t in TARGETS)


def by_source(targets: list[Target]) -> Iterator[tuple[str, list[Target]]]:
    sources = dict.fromkeys(t.source for t in targets)
    for source in sources:
        yield source, [t for t in targets if t.source == source]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument(
        "--only",
        type=lambda s: s.split(","),
        default=None,
        help=f"comma-separated targets to make (default all): {known_names()}",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="llama-quantize's threads")
    p.add_argument("--llama-quantize", type=Path, default=DEFAULT_QUANTIZE)
    p.add_argument("--llama-src", type=Path, default=LLAMA_SRC, help="llama.cpp's source tree")
    p.add_argument("--convert-deps", type=Path, default=DEFAULT_CONVERT_DEPS)
    p.add_argument(
        "--keep-intermediate",
        action="store_true",
        help="keep the safetensors folder and the bf16 GGUF each shape is quantized from",
    )
    args = p.parse_args(argv)
    targets = wanted(args)
    if not args.llama_quantize.exists():
        sys.exit(f"no llama-quantize at {args.llama_quantize}: run `make bench-peers`")
    if not (args.convert_deps / "sentencepiece").exists():
        sys.exit(f"no sentencepiece under {args.convert_deps}: run `make bench-models`")

    maker = Maker(args)
    maker.work.mkdir(parents=True, exist_ok=True)
    maker.logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    for source, group in by_source(targets):
        missing = [t for t in group if not (args.out / t.name).exists()]
        if not missing:
            continue
        print(f"{source}: making {', '.join(t.name for t in missing)}", flush=True)
        if source in SHAPES:
            maker.make_shape(source, missing)
        else:
            maker.make_requants(missing)
    print_summary(args.out, targets, maker.stages, time.monotonic() - started)


def print_summary(out: Path, targets: list[Target], stages: list[Stage], seconds: float) -> None:
    print("\n| file | size | tensor types |\n|---|---|---|")
    for target in targets:
        path = out / target.name
        types = ", ".join(f"{n} {t}" for t, n in tensor_types(path).items())
        print(f"| {path} | {gb(path.stat().st_size)} | {types} |")
    if stages:
        peak = max(stages, key=lambda s: s.peak_rss_bytes)
        parent = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(
            f"\nmade in {seconds:.0f} s; the largest peak RSS of one step: "
            f"{gb(peak.peak_rss_bytes)} ({peak.what}); this process's own: {gb(parent)}"
        )


if __name__ == "__main__":
    main()
