"""Batched LoRA in Triton: each packed token's own adapter's update added to a linear's output,
y[t] += (x[t] @ A[s]^T) @ B[s]^T for s = the token's slot (-1: none), in two launches (shrink
to the rank, then expand) over all tokens whatever their adapters."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 64  # input features a shrink loop reads at once
BLOCK_N = 64  # output features an expand program writes


@triton.jit
def _shrink(
    x_ptr, a_ptr, slot_ptr, h_ptr, k_in, stride_xt, stride_as, stride_ar, stride_ht,
    RANK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """h[t] = A[slot[t]] @ x[t] (float32) for one token t; a token with no slot gets zeros."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    s = tl.maximum(slot, 0).to(tl.int64)
    limit = tl.where(slot >= 0, k_in, 0)  # a token with no slot reads nothing
    r = tl.arange(0, RANK)
    acc = tl.zeros([RANK], dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        inside = k < limit
        xk = tl.load(x_ptr + t * stride_xt + k, mask=inside, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + s * stride_as + r[:, None] * stride_ar + k[None, :],
            mask=inside[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(a * xk[None, :], axis=1)
    tl.store(h_ptr + t * stride_ht + r, acc)


@triton.jit
def _expand(
    h_ptr, b_ptr, slot_ptr, y_ptr, n_out, stride_ht, stride_bs, stride_bn, stride_yt,
    RANK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """y[t, block] += B[slot[t]][block] @ h[t] for one token t and a block of outputs."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    s = tl.maximum(slot, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = n < tl.where(slot >= 0, n_out, 0)  # a token with no slot writes nothing
    r = tl.arange(0, RANK)
    h = tl.load(h_ptr + t * stride_ht + r)
    b = tl.load(
        b_ptr + s * stride_bs + n[:, None] * stride_bn + r[None, :],
        mask=inside[:, None],
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(b * h[None, :], axis=1)
    y = tl.load(y_ptr + t * stride_yt + n, mask=inside, other=0.0)
    tl.store(y_ptr + t * stride_yt + n, (y.to(tl.float32) + delta).to(y.dtype), mask=inside)


def add_lora(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> None:
    """y [T, N] += each token's update: x [T, K], a [S, R, K], b [S, N, R] (R a power of two,
    unused ranks zero), slots [T] int32 (-1: the base model). In place."""
    tokens, k_in = x.shape
    n_out, rank = y.shape[1], a.shape[1]
    if rank & (rank - 1) or x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("add_lora needs a power-of-two rank and rows of contiguous features")
    if not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("add_lora needs contiguous adapter weights")
    h = torch.empty(tokens, rank, dtype=torch.float32, device=x.device)
    _shrink[(tokens,)](
        x, a, slots, h, k_in, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
        RANK=rank, BLOCK=BLOCK_K,
    )  # fmt: skip
    _expand[(tokens, triton.cdiv(n_out, BLOCK_N))](
        h, b, slots, y, n_out, h.stride(0), b.stride(0), b.stride(1), y.stride(0),
        RANK=rank, BLOCK=BLOCK_N,
    )  # fmt: skip
