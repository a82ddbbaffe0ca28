"""Linear layers' matmuls for the few rows of a small decode batch, in Triton, where faster.

`pick` times it against cuBLAS on the worker's own GPU at start and turns it on per weight shape.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
import triton
import triton.language as tl

from loomllm.workers.kernels.fused_ops import dot_f32, round_to, silu_mul, silu_times

logger = logging.getLogger(__name__)

MAX_ROWS = 8  # decode batches up to this many rows (graph buckets 1, 2, 4, 8)
ROWS_PAD = 16  # tl.dot's minimum rows on GPUs
H100_L2 = 50 * 2**20  # bytes: the L2 cache assumed where torch does not say the device's


@dataclasses.dataclass(frozen=True)
class MatmulTiling:
    """How the kernel splits the work: output features a program (at least 16, tl.dot's
    minimum), input features a load, loads in flight a program, warps a program."""

    block_n: int
    block_k: int
    num_stages: int
    num_warps: int = 4

    @classmethod
    def parse(cls, text: str) -> MatmulTiling:
        """ "16x256x4x4" (block_n x block_k x stages x warps; the warps may be left out)."""
        return cls(*map(int, text.split("x")))

    def __str__(self) -> str:
        return f"{self.block_n}x{self.block_k}x{self.num_stages}x{self.num_warps}"


# 16 features a program: 256 programs for a 4096-wide output; 256 a load: a 512-byte run of
# each bf16 weight row; 4 loads in flight: what keeps the memory busy.
PLAIN = MatmulTiling(16, 256, 4)
# The gated kernel loads two weight tiles a step: with 3 stages it takes the plain one's
# 48 KB of shared memory and spills no register on an A100, where 4 stages spill.
GATED = MatmulTiling(16, 256, 3)


@triton.jit(do_not_specialize=["rows"])
def _skinny_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    rows,
    n_out,
    k_in,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    EXACT: tl.constexpr,
    GATED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out = x @ w.T (+ b). One program per BLOCK_N output features walks the whole input
    dimension with the few rows alongside, so each weight row is read once and no split-K
    reduction kernel follows: a small decode batch's matmuls are bandwidth-bound.

    GATED: w (and b) hold gate's n_out rows then up's, and out =
    silu(x @ gate.T) * (x @ up.T), each product rounded as fused_ops.silu_mul
    rounds it: the same bits as this kernel's plain output through silu_mul."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, ROWS)
    n_ok = n < n_out
    m_ok = m < rows
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    up_rows = w_rows + n_out * stride_wn.to(tl.int64)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    acc_up = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:  # no mask along the rows: vector loads
            x_mask = m_ok[:, None]
            w_mask = n_ok[:, None]
        else:
            x_mask = m_ok[:, None] & (k < k_in)[None, :]
            w_mask = n_ok[:, None] & (k < k_in)[None, :]
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0)
        w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0)
        acc += dot_f32(x, tl.trans(w), EXACT)
        if GATED:
            up = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0)
            acc_up += dot_f32(x, tl.trans(up), EXACT)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_ptr + n_out + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    out = round_to(acc, dtype)  # to nearest, in the interpreter too
    if GATED:
        out = silu_times(out, round_to(acc_up, dtype), dtype)
    tl.store(
        out_ptr + m[:, None] * stride_om + n[None, :],
        out.to(dtype),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiling: MatmulTiling = PLAIN,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [..., K] of at most MAX_ROWS rows (weight [N, K],
    bias [N], all of x's dtype; the last dimensions dense). It rounds once from a float32 sum,
    as cuBLAS does, but sums in another order, so its bits are not cuBLAS's."""
    return _launch(x, weight, bias, gated=False, tiling=tiling)


def skinny_silu_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiling: MatmulTiling = GATED,
) -> torch.Tensor:
    """`fused_ops.silu_mul(skinny_linear(x, weight, bias))` in one kernel, bit for bit: a
    packed gate|up projection (weight [2I, K], gate's rows first) and its activation,
    [..., I]. The gate|up output is never written."""
    if weight.shape[0] % 2:
        raise ValueError(
            f"skinny_silu_linear takes gate and up rows stacked, got {weight.shape[0]} rows"
        )
    return _launch(x, weight, bias, gated=True, tiling=tiling)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gated: bool,
    tiling: MatmulTiling,
) -> torch.Tensor:
    k_in = x.shape[-1]
    x2 = x.reshape(-1, k_in)
    rows, n_out = x2.shape[0], weight.shape[0] // (2 if gated else 1)
    if rows > MAX_ROWS or weight.shape[1] != k_in or x2.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(
            f"skinny_linear takes up to {MAX_ROWS} dense rows of the weight's "
            f"width: x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    out = x2.new_empty(rows, n_out)
    exact = x.dtype == torch.float32 or bool(triton.knobs.runtime.interpret)
    _skinny_kernel[(triton.cdiv(n_out, tiling.block_n),)](
        x2,
        weight,
        weight if bias is None else bias,
        out,
        rows,
        n_out,
        k_in,
        x2.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=k_in % tiling.block_k == 0,
        EXACT=exact,
        GATED=gated,
        ROWS=ROWS_PAD,
        BLOCK_N=tiling.block_n,
        BLOCK_K=tiling.block_k,
        num_stages=tiling.num_stages,
        num_warps=tiling.num_warps,
    )
    return out.view(*x.shape[:-1], n_out)


def graph_seconds(fn: Callable[[], Any], reps: int = 20) -> float:
    """Device seconds of one `fn()`, `reps` of them replayed from a CUDA graph (a decode
    step's launches cost no host time either)."""
    fn()  # compiles, and lets cuBLAS pick its kernel before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


class TimedLinear(Protocol):
    """What `pick` reads and sets of a linear layer (models/llama/model.py's Linear)."""

    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def bias(self) -> torch.Tensor | None: ...

    @property
    def gated(self) -> bool: ...

    skinny: bool


def pick(
    linears: Iterable[TimedLinear],
    seconds: Callable[[Callable[[], Any]], float] = graph_seconds,
) -> dict[tuple, tuple[float, float]]:
    """Which kernel wins depends on the GPU and the shape, so this times them on the worker's
    own device, in CUDA graphs with weights read from memory, as decode steps run them.

    Time cuBLAS and the skinny kernel on each distinct bf16 weight shape of `linears`
    (modules with `weight`, `bias`, a `skinny` flag and a `gated` one: a gate|up projection
    that a step runs with SiLU times up, `skinny_silu_linear` against cuBLAS then
    fused_ops.silu_mul), at 1 and MAX_ROWS rows; set `skinny` on those of the shapes it
    runs faster at both (a shape it fails on keeps cuBLAS, logged). Returns {(N, K, has
    bias, gated): (cuBLAS time / its time at 1 row, the same at MAX_ROWS, or 0.0 where it
    lost at 1 row)} for every shape timed."""
    by_shape: dict[tuple, list[TimedLinear]] = {}
    for linear in linears:
        # bf16 only: float32 models keep cuBLAS's sums, which their float32 checks compare
        # against eager steps (the kernel computes float32 too, for the interpreter).
        if linear.weight.dtype == torch.bfloat16:
            key = (*linear.weight.shape, linear.bias is not None, linear.gated)
            by_shape.setdefault(key, []).append(linear)
    speedups = {}
    for key, group in by_shape.items():
        try:
            speedups[key] = _speedups(group[0].weight, group[0].bias, key[3], seconds)
        except Exception:  # a kernel this GPU or Triton cannot build: cuBLAS, as without it
            logger.exception(
                "the skinny matmul failed on %s weights: cuBLAS runs them", list(key[:2])
            )
            continue
        faster = min(speedups[key]) > 1.0
        for linear in group:
            linear.skinny = faster
        one, most = speedups[key]
        logger.info(
            "matmul of %s weights%s%s: %s (cuBLAS time / Triton's: x%.2f at 1 row%s)",
            list(key[:2]),
            " with bias" * key[2],
            ", SiLU * up after" * key[3],
            "Triton" if faster else "cuBLAS",
            one,
            f", x{most:.2f} at {MAX_ROWS}" if most else "",
        )
    return speedups


def linear_silu_mul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """cuBLAS's gate|up projection, then fused_ops.silu_mul's kernel: what
    `skinny_silu_linear` replaces."""
    return silu_mul(torch.nn.functional.linear(x, weight, bias))


def _speedups(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gated: bool,
    seconds: Callable[[Callable[[], Any]], float],
) -> tuple[float, float]:
    """cuBLAS's time / the skinny kernel's, at 1 row and at MAX_ROWS (0.0: not timed, as
    the kernel lost at 1 row already: a cold start spends no time on it)."""
    theirs, ours_fn = (
        (linear_silu_mul, skinny_silu_linear)
        if gated
        else (torch.nn.functional.linear, skinny_linear)
    )
    ratios = []
    for rows in (1, MAX_ROWS):
        x = torch.randn(rows, weight.shape[1], device=weight.device).to(weight.dtype)
        cublas = matmul_seconds(theirs, x, weight, bias, seconds)
        ours = matmul_seconds(ours_fn, x, weight, bias, seconds)
        ratios.append(cublas / max(ours, 1e-12))
        if ratios[0] <= 1.0:
            return ratios[0], 0.0
    return ratios[0], ratios[1]


def matmul_seconds(
    matmul: Callable[..., torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    seconds: Callable[[Callable[[], Any]], float] = graph_seconds,
) -> float:
    """Device seconds of `matmul(x, weight, bias)` with the weight read from memory, as a
    decode step reads it: the timed call cycles through copies of it that overflow the
    GPU's L2 cache twice, because a weight replayed alone can stay in L2 and read faster
    than any decode step reads it."""
    l2 = (
        getattr(torch.cuda.get_device_properties(weight.device), "L2_cache_size", H100_L2)
        if weight.is_cuda
        else 0
    )
    size = weight.numel() * weight.element_size()
    weights = [weight] + [weight.clone() for _ in range(-(-2 * l2 // size) - 1)]
    return seconds(functools.partial(_each, matmul, x, weights, bias)) / len(weights)


def _each(
    matmul: Callable[..., torch.Tensor],
    x: torch.Tensor,
    weights: list[torch.Tensor],
    bias: torch.Tensor | None,
) -> None:
    for weight in weights:
        matmul(x, weight, bias)
