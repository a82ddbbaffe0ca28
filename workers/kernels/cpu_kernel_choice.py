"""Which CPU linear kernel (dense, int8, int4, a8) is fastest for each weight shape and batch size
on this machine: measured once at a worker's start, then cached per machine in the cache dir.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F

from loomllm.workers.device.cpu_features import cpu_identity
from loomllm.workers.device.cpu_threads import CONTENDED_WAITING, waiting_ns
from loomllm.workers.kernels import cpu_native
from loomllm.workers.kernels.cpu_linear import (
    BlockLinear,
    CodeBlocks,
    GroupwiseInt4,
    Int4Linear,
    Int8Linear,
    fits_int4,
    fits_int8,
)

logger = logging.getLogger(__name__)

# a8's rounding differs from the other kinds', so a layer runs it at every batch size or at
# none: a request's tokens then do not depend on the batch it ran in.
ACTIVATION_KINDS = frozenset({"a8"})
# The batch sizes a choice is made for; a step of M rows uses the nearest one.
BATCH_SIZES = (1, 8, 32, 128)
_MEASURE_S = 0.03  # each candidate's timing, over all rounds
_ROUNDS = 5
_PRUNE_RATIO = 4.0
_CACHE_FORMAT = 6  # bumped whenever the measurement changes
_TRIES = 4  # timings of a shape while other work holds the cores, a pause apart
_RETRY_PAUSE_S = 1.0

Shape = tuple[int, int]  # (in_features, out_features)
Choice = tuple[str, ...]  # the kind for each of BATCH_SIZES


@functools.lru_cache(maxsize=1024)  # every linear layer of every step asks
def batch_index(rows: int) -> int:
    """Which of BATCH_SIZES a step of `rows` rows is closest to, on a log scale."""
    ratio = [abs(math.log(max(rows, 1) / size)) for size in BATCH_SIZES]
    return ratio.index(min(ratio))


def machine_key(dtype: torch.dtype) -> str:
    """What a measurement depends on: the CPU, its flags, torch, the threads, the dtype, and
    the C++ ops' sources (the a8 kernel's)."""
    text = f"{cpu_identity()}\0{torch.__version__}\0{torch.get_num_threads()}\0{dtype}"
    text += f"\0{cpu_native.build_key()}"
    return hashlib.sha256(f"{text}\0{_CACHE_FORMAT}".encode()).hexdigest()[:16]


def _seconds_per_call(fn: Callable[[], object]) -> float:
    """The mean time of `fn` over at least _MEASURE_S / _ROUNDS seconds of calls."""
    calls, started = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - started
        if elapsed >= _MEASURE_S / _ROUNDS:
            return elapsed / calls


def measure(shape: Shape, kinds: Iterable[str], dtype: torch.dtype) -> Choice:
    """The fastest of `kinds` at each batch size, timed on random weights of `shape`. A
    quantized kernel far slower than the best at one batch size is not timed at the bigger
    ones: their cost grows with the rows faster than the dense matmul's, which is always
    timed. a8 runs at every batch size or at none: at every one where it was timed at all of
    them and that costs less, summed over the batch sizes as a fraction of each one's
    fastest, than the best of the others at each."""
    in_features, out_features = shape
    weight = torch.randn(out_features, in_features) * 0.02
    kinds = set(kinds)
    kernels: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for kind in sorted(kinds):
        if kind == "dense":
            dense = weight.to(dtype)

            def run_dense(x: torch.Tensor, dense: torch.Tensor = dense) -> torch.Tensor:
                return F.linear(x, dense)

            kernels[kind] = run_dense
        elif kind == "int8" and fits_int8(in_features):
            kernels[kind] = Int8Linear(weight, dtype)
        elif kind == "int4" and fits_int4(in_features, out_features):
            kernels[kind] = Int4Linear(GroupwiseInt4.from_dense(weight), dtype)
        elif kind == "a8" and fits_int4(in_features, out_features) and cpu_native.loaded():
            # Timed with the width of the weights it would run: 4 bits unless only int8 fits.
            groups = GroupwiseInt4.from_dense(weight)
            blocks = CodeBlocks.from_int4(groups)
            if "int4" not in kinds and "int8" in kinds:
                codes = Int8Linear(weight, torch.float32).codes
                scale = weight.abs().amax(dim=1, keepdim=True).expand_as(groups.scale) / 127
                # Timed as GGUF's Q8_0 runs: its scales in float16.
                blocks = CodeBlocks.from_int8(codes, scale.half().float())
            kernels[kind] = BlockLinear(blocks, cpu_native.loaded())
    timings: list[dict[str, float]] = []
    for rows in BATCH_SIZES:
        x = torch.randn(rows, in_features).to(dtype)
        calls = {kind: (lambda k=k, x=x: k(x)) for kind, k in kernels.items()}
        for call in calls.values():
            call()  # warm-up: one-time costs (packing caches, first-touch pages) are not timed
        # The best of a few interleaved rounds: another process busy for a moment (a zygote
        # importing, the engine) slows a round, not every round of one kernel.
        timed = {kind: math.inf for kind in calls}
        for _ in range(_ROUNDS):
            for kind, call in calls.items():
                timed[kind] = min(timed[kind], _seconds_per_call(call))
        timings.append(timed)
        best = min(timed.values())
        kernels = {
            k: v for k, v in kernels.items() if k == "dense" or timed[k] <= _PRUNE_RATIO * best
        }
    return _pick(timings)


def _measure_uncontended(
    shape: Shape, kinds: frozenset[str], dtype: torch.dtype
) -> tuple[list[str], float]:
    """`measure`, tried again while other work holds the cores (a worker's own engine loads
    its tokenizer as the worker starts): (the choice, the threads' worth that waited for a
    core during its timing, on average). Threads kept waiting slow the kernel with the most
    barriers most, so a contended timing picks the wrong kernel."""
    for attempt in range(_TRIES):
        if attempt:
            time.sleep(_RETRY_PAUSE_S)
        waited, began = waiting_ns(), time.monotonic_ns()
        found = list(measure(shape, sorted(kinds), dtype))
        waiting = (waiting_ns() - waited) / max(time.monotonic_ns() - began, 1)
        if waiting < CONTENDED_WAITING:
            break
    return found, waiting


def _pick(timings: list[dict[str, float]]) -> Choice:
    """The kind for each batch size from its timings (`measure`'s rule)."""
    weight_only = tuple(
        min((k for k in timed if k not in ACTIVATION_KINDS), key=timed.__getitem__)
        for timed in timings
    )
    fastest = [min(timed.values()) for timed in timings]
    cost = sum(
        timed[k] / best for timed, k, best in zip(timings, weight_only, fastest, strict=True)
    )
    for kind in sorted(ACTIVATION_KINDS):
        if all(kind in timed for timed in timings):
            own = sum(timed[kind] / best for timed, best in zip(timings, fastest, strict=True))
            if own < cost:
                return (kind,) * len(timings)
    return weight_only


def choose(
    shapes: dict[Shape, frozenset[str]], dtype: torch.dtype, cache_dir: Path | None
) -> dict[Shape, Choice]:
    """For each shape, the kernel to run at each of BATCH_SIZES among the kinds its weights
    allow; measurements are read from and added to `cache_dir/<machine>.json`."""
    cache_file = cache_dir / f"{machine_key(dtype)}.json" if cache_dir else None
    if cache_file is None:
        return _choose(shapes, dtype, {})[0]
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        lock = open(cache_file.with_suffix(".lock"), "w")  # closed by the `with` below
    except OSError as exc:
        logger.warning("CPU kernel cache %s unusable (%s): measuring without it", cache_file, exc)
        return _choose(shapes, dtype, {})[0]
    with lock:
        # One worker measures at a time: two at once would share the cores they time.
        fcntl.flock(lock, fcntl.LOCK_EX)
        choices, cached, measured = _choose(shapes, dtype, _read_cache(cache_file))
        if measured:
            try:
                tmp = cache_file.with_suffix(f".tmp-{os.getpid()}")
                tmp.write_text(json.dumps(cached, indent=1, sort_keys=True))
                os.replace(tmp, cache_file)  # readers see the old file or the new one
            except OSError as exc:
                logger.warning("could not write the CPU kernel cache %s: %s", cache_file, exc)
    return choices


def _read_cache(cache_file: Path) -> dict[str, list[str]]:
    """The cached choices; nothing where the file is missing or not what this module wrote."""
    try:
        cached = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(cached, dict):
        return {}
    return {
        key: value
        for key, value in cached.items()
        if isinstance(value, list) and all(isinstance(kind, str) for kind in value)
    }


def _choose(
    shapes: dict[Shape, frozenset[str]], dtype: torch.dtype, cached: dict[str, list[str]]
) -> tuple[dict[Shape, Choice], dict[str, list[str]], bool]:
    """(the choices, the cache with any new measurements, whether anything was measured)."""
    choices: dict[Shape, Choice] = {}
    measured = False
    contended: list[str] = []  # the shapes measured while other work held the cores
    worst = 0.0  # the most threads' worth that waited for a core in one of their timings
    started = time.perf_counter()
    for shape, kinds in shapes.items():
        if len(kinds) == 1:
            choices[shape] = (next(iter(kinds)),) * len(BATCH_SIZES)
            continue
        key = f"{shape[0]}x{shape[1]}:{','.join(sorted(kinds))}"
        found = cached.get(key)
        if found is None or len(found) != len(BATCH_SIZES) or not set(found) <= kinds:
            found, waiting = _measure_uncontended(shape, kinds, dtype)
            if waiting < CONTENDED_WAITING:
                cached[key] = found
                measured = True
            else:
                # This worker runs what it measured; the next start measures again.
                contended.append(f"{shape[0]}x{shape[1]}")
                worst = max(worst, waiting)
        choices[shape] = tuple(found)
    if measured or contended:
        logger.info("CPU linear kernels measured in %.1f s", time.perf_counter() - started)
    if contended:
        logger.warning(
            "CPU linear kernels for %s measured while other work held the cores (up to %.1f "
            "threads' worth waited for one, %d tries each): not cached, measured again at the "
            "next start",
            ", ".join(contended),
            worst,
            _TRIES,
        )
    return choices, cached, measured


def describe(choices: dict[Shape, Choice]) -> str:
    """One line a shape: `576x960: int8@1 int8@8 dense@32 dense@128`."""
    return "; ".join(
        f"{k}x{n}: " + " ".join(f"{kind}@{m}" for kind, m in zip(choice, BATCH_SIZES, strict=True))
        for (k, n), choice in sorted(choices.items())
    )
