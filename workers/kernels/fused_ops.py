"""Triton kernels for a decoder layer's elementwise work on CUDA: RMSNorm, rotary, SiLU times up.

Each is one launch where transformers takes several; models/fused_layers.py swaps them in.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

from loomllm.workers.kernels.triton_interpreter import (
    cache_dtype_lookups,
    skip_dead_overflow_checks,
    skip_nested_patches,
)

# Every kernel module imports this one, so on the CPU (TRITON_INTERPRET=1) the interpreter's
# per-call costs are cut before any kernel runs (triton_interpreter.py says which).
skip_nested_patches()
cache_dtype_lookups()
skip_dead_overflow_checks()

# The kernels round where torch's eager ops round (to bf16 after each product and sum), so the
# rotary embedding matches transformers bit for bit, RMSNorm up to its float32 sum's order, and
# SiLU times up up to float32's exp, which Triton approximates on a GPU. In bf16 they match bit
# for bit under the interpreter, and within a unit in the last place on a GPU (`loom bench
# gpu-check` checks them there).
# The activations' dtypes whose rounding the kernels reproduce.
DTYPES = (torch.bfloat16, torch.float32)
# No fused multiply-adds: torch rounds a product before the sum it goes into.
NO_FMA = {"enable_fp_fusion": False}


def runs_here(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: of DTYPES, on a GPU (or Triton's interpreter)."""
    return all(
        (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and t.dtype in DTYPES
        for t in tensors
    )


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 `x` rounded to `dtype` and back, to nearest with ties to even, as torch rounds
    an op's output. bfloat16 in integer arithmetic, because the GPU compiler drops float
    round trips and Triton's interpreter truncates. NaN stays NaN (the carry would turn
    0x7FFFFFFF into -0.0)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:  # float32: the kernels take no other dtype (DTYPES)
        return x


@triton.jit
def dot_f32(a, b, EXACT: tl.constexpr):
    """a @ b with float32 accumulation; EXACT: float32 operands and no TF32 (float32 models,
    and the interpreter, whose numpy has no bfloat16 matmul)."""
    if EXACT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b.to(a.dtype)).to(tl.float32)


@triton.jit
def _normalize(x, w_ptr, cols, mask, n_cols, eps, X_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """transformers' Llama RMSNorm of the float32 row `x` (masked to `n_cols`), rounded where
    it rounds: the normalized row to the input's dtype before the weight."""
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = round_to(normed, X_DTYPE)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return round_to(w * normed, OUT_DTYPE)  # exact: the store only narrows


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 in long prompts
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    out = _normalize(
        x, w_ptr, cols, mask, n_cols, eps, x_ptr.dtype.element_ty, out_ptr.dtype.element_ty
    )
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 in long prompts
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = sum_ptr.dtype.element_ty
    total = round_to(x + r, dtype)  # torch's `residual + hidden_states`, rounded as it rounds
    tl.store(sum_ptr + row * stride_s + cols, total.to(dtype), mask=mask)
    out = _normalize(total, w_ptr, cols, mask, n_cols, eps, dtype, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm of `x` over its last dimension, in one kernel."""
    _check_dtypes("rms_norm", x, weight)
    x_rows = _rows(x)
    out = torch.empty(
        x_rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device
    )
    _rms_norm_kernel[(x_rows.shape[0],)](
        x_rows,
        weight,
        out,
        x_rows.stride(0),
        out.stride(0),
        x_rows.shape[1],
        eps,
        **_row_launch(x_rows),
    )
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) in one kernel: a decoder layer's residual add
    and the RMSNorm after it, each rounded as transformers' ops round them."""
    _check_dtypes("add_rms_norm", x, weight)
    if residual.dtype != x.dtype or residual.shape != x.shape:
        raise ValueError(
            f"add_rms_norm adds tensors of one shape and dtype, got {x.shape} "
            f"{x.dtype} and {residual.shape} {residual.dtype}"
        )
    x_rows, r_rows = _rows(x), _rows(residual)
    total = torch.empty(x_rows.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(
        x_rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device
    )
    _add_rms_norm_kernel[(x_rows.shape[0],)](
        x_rows,
        r_rows,
        weight,
        out,
        total,
        x_rows.stride(0),
        r_rows.stride(0),
        out.stride(0),
        total.stride(0),
        x_rows.shape[1],
        eps,
        **_row_launch(x_rows),
    )
    return out.view(x.shape), total.view(x.shape)


def _check_dtypes(name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype not in DTYPES or weight.dtype not in DTYPES:
        raise ValueError(f"{name} takes {DTYPES}, got {x.dtype} and {weight.dtype}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as rows [N, H] with dense rows: a view for the activations the kernels get."""
    if x.stride(-1) != 1:
        x = x.contiguous()  # the kernels read a row's elements side by side
    return x.reshape(-1, x.shape[-1])


def _row_launch(rows: torch.Tensor) -> dict[str, Any]:
    """A row-per-program kernel's block and warps for rows of this length."""
    block = triton.next_power_of_2(rows.shape[1])
    return {"BLOCK": block, "num_warps": min(max(block // 256, 1), 16), **NO_FMA}


class FusedRMSNorm(torch.nn.Module):
    """An RMSNorm module's weight and epsilon, computed by `rms_norm`."""

    def __init__(self, weight: torch.nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight  # the replaced module's own parameter: no copy
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


@triton.jit
def silu_times(gate, up, dtype: tl.constexpr):
    """silu(gate) * up of float32 values already rounded to `dtype`, as transformers' MLP
    rounds them: torch's silu, x / (1 + exp(-x)) in float32 (an IEEE division), rounded;
    then the product, rounded."""
    act = round_to(tl.div_rn(gate, 1.0 + tl.exp(-gate)), dtype)
    return round_to(act * up, dtype)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 in long prompts
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * stride_o + cols, silu_times(gate, up, dtype).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for `gate_up` = [..., 2I], gate first (a packed gate|up projection's
    output), in one kernel: [..., I], rounded as transformers' MLP rounds them."""
    if gate_up.dtype not in DTYPES:
        raise ValueError(f"silu_mul takes {DTYPES}, got {gate_up.dtype}")
    if gate_up.shape[-1] % 2:
        raise ValueError(
            f"silu_mul takes gate and up side by side, got {gate_up.shape[-1]} columns"
        )
    rows = _rows(gate_up)
    width = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], width), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width))
    _silu_mul_kernel[(rows.shape[0], triton.cdiv(width, block))](
        rows,
        out,
        rows.stride(0),
        out.stride(0),
        width,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 8),
        **NO_FMA,
    )
    return out.view(*gate_up.shape[:-1], width)


@triton.jit
def rotated(rows, d, mask, cos_row, sin_row, HEAD_DIM: tl.constexpr):
    """x * cos + rotate_half(x) * sin of the rows at `rows` ([R, 1] pointers, or one) along
    `d` [D] of the head, by the cos and sin rows: [R, D] float32, each product and the sum
    rounded to x's dtype as transformers' eager ops round them. float32 in a kernel that
    fuses multiply-adds (the decode kernel): within float32's last place, as x * c + xp * s
    may become one fma (the rotary kernels here do not fuse)."""
    dtype = rows.dtype.element_ty
    half = HEAD_DIM // 2
    partner = tl.where(d < half, d + half, d - half)  # rotate_half's source of each element
    x = tl.load(rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.where(d[None, :] < half, -xp, xp)
    c = tl.load(cos_row + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_row + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)[None, :]
    return round_to(round_to(x * c, dtype) + round_to(xp * s, dtype), dtype)


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    stride_xh,
    stride_oh,
    num_heads,
    cos_row,
    sin_row,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """The heads of one token, rotated (`rotated`) into out_ptr's."""
    heads = tl.arange(0, HEADS)[:, None]
    d = tl.arange(0, HEAD_DIM)
    mask = heads < num_heads
    out = rotated(x_ptr + heads * stride_xh, d, mask, cos_row, sin_row, HEAD_DIM)
    tl.store(out_ptr + heads * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


# A step's token count varies with its batch; specialized (as Triton does an int that is 1 or
# a multiple of 16), the decode-graph buckets would compile the kernel three times.
@triton.jit(do_not_specialize=["num_tokens"])
def _rope_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_cb,
    stride_ct,
    stride_qob,
    stride_qoh,
    stride_qot,
    stride_kob,
    stride_koh,
    stride_kot,
    num_tokens,
    num_q_heads,
    num_k_heads,
    HEAD_DIM: tl.constexpr,
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
):
    """One program per (batch row, token): its q and k heads rotated by its cos and sin."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // num_tokens
    t = pid % num_tokens
    cs = b * stride_cb + t * stride_ct
    _rotate_heads(
        q_ptr + b * stride_qb + t * stride_qt,
        q_out_ptr + b * stride_qob + t * stride_qot,
        stride_qh,
        stride_qoh,
        num_q_heads,
        cos_ptr + cs,
        sin_ptr + cs,
        Q_HEADS,
        HEAD_DIM,
    )
    _rotate_heads(
        k_ptr + b * stride_kb + t * stride_kt,
        k_out_ptr + b * stride_kob + t * stride_kot,
        stride_kh,
        stride_koh,
        num_k_heads,
        cos_ptr + cs,
        sin_ptr + cs,
        K_HEADS,
        HEAD_DIM,
    )


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb for q [B, H, T, D], k [B, KVH, T, D] (any strides,
    the last dimension dense; D a power of two) and cos, sin [B or 1, T, D] of their
    dtype, in one kernel."""
    batch, num_q_heads, num_tokens, head_dim = q.shape
    # Outputs token-major, as transformers' own ops leave a projection's transposed view:
    # attention's output keeps that layout, and the reshape after it stays a view.
    q_out = q.new_empty(batch, num_tokens, num_q_heads, head_dim).transpose(1, 2)
    k_out = k.new_empty(batch, num_tokens, k.shape[1], head_dim).transpose(1, 2)
    cos, sin = cos.expand(batch, num_tokens, head_dim), sin.expand(batch, num_tokens, head_dim)
    _rope_kernel[(batch * num_tokens,)](
        q,
        k,
        cos,
        sin,
        q_out,
        k_out,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        cos.stride(0),
        cos.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        q_out.stride(2),
        k_out.stride(0),
        k_out.stride(1),
        k_out.stride(2),
        num_tokens,
        num_q_heads,
        k.shape[1],
        HEAD_DIM=head_dim,
        Q_HEADS=triton.next_power_of_2(num_q_heads),
        K_HEADS=triton.next_power_of_2(k.shape[1]),
        **NO_FMA,
    )
    return q_out, k_out


@triton.jit
def _rope_cache_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_qot,
    stride_qoh,
    stride_cs,
    stride_ch,
    num_q_heads,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
):
    """One program per token: its q heads rotated into q_out, its k heads rotated into its
    cache slot, its v heads copied there."""
    t = tl.program_id(0).to(tl.int64)  # t * stride passes 2**31 in long prompts
    slot = tl.load(slots_ptr + t).to(tl.int64)
    cos_row, sin_row = cos_ptr + t * stride_ct, sin_ptr + t * stride_ct
    _rotate_heads(
        q_ptr + t * stride_qt,
        q_out_ptr + t * stride_qot,
        stride_qh,
        stride_qoh,
        num_q_heads,
        cos_row,
        sin_row,
        Q_HEADS,
        HEAD_DIM,
    )
    _rotate_heads(
        k_ptr + t * stride_kt,
        k_cache_ptr + slot * stride_cs,
        stride_kh,
        stride_ch,
        num_kv_heads,
        cos_row,
        sin_row,
        KV_HEADS,
        HEAD_DIM,
    )
    heads = tl.arange(0, KV_HEADS)[:, None]
    cols = tl.arange(0, HEAD_DIM)[None, :]
    mask = heads < num_kv_heads
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + cols, mask=mask)
    tl.store(v_cache_ptr + slot * stride_cs + heads * stride_ch + cols, v, mask=mask)


def rotary_into_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """`rotary` of q, k [T, heads, D] by cos, sin [T, D], and the rotated k and v written to
    their cache slots ([slots, KVH, D] caches, `slot_mapping` [T]), in one kernel instead of
    two (`rotary`, then triton_kernels.write_kv): the rotated q [T, H, D]. The same values as
    the pair, bit for bit; the caller checks `rotary_into_cache_fits` first."""
    num_tokens, num_q_heads, head_dim = q.shape
    q_out = q.new_empty(q.shape)
    _rope_cache_kernel[(num_tokens,)](
        q,
        k,
        v,
        cos,
        sin,
        q_out,
        k_cache,
        v_cache,
        slot_mapping,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        q_out.stride(0),
        q_out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        num_q_heads,
        k.shape[1],
        HEAD_DIM=head_dim,
        Q_HEADS=triton.next_power_of_2(num_q_heads),
        KV_HEADS=triton.next_power_of_2(k.shape[1]),
        **NO_FMA,
    )
    return q_out


def rotary_into_cache_fits(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> bool:
    """Whether `rotary_into_cache` takes these: one dtype throughout (it writes K and V
    without casting), a device it runs on, dense last dimensions, a power-of-two head size."""
    if q.dim() != 3 or k.dim() != 3:
        return False
    num_tokens, _, head_dim = q.shape
    return (
        runs_here(q)
        and k.shape == v.shape
        and k.shape[0] == num_tokens
        and k.shape[2] == head_dim
        and k_cache.shape[1:] == k.shape[1:]
        and v_cache.shape == k_cache.shape
        and v_cache.stride() == k_cache.stride()
        and cos.shape == sin.shape == (num_tokens, head_dim)
        and sin.stride() == cos.stride()
        and head_dim >= 2
        and head_dim & (head_dim - 1) == 0
        and len({t.dtype for t in (q, k, v, cos, sin, k_cache, v_cache)}) == 1
        and all(t.stride(-1) == 1 for t in (q, k, v, cos, k_cache))
    )


def _rotary_fits(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int
) -> bool:
    """Whether `rotary` computes this call: its layout, shapes, dtypes and a device it runs on."""
    if unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3:
        return False
    batch, _, num_tokens, head_dim = q.shape
    return (
        runs_here(q)
        and k.shape[0] == batch
        and k.shape[2:] == q.shape[2:]
        and cos.shape[0] in (1, batch)
        and cos.shape[1:] == (num_tokens, head_dim)
        and sin.shape == cos.shape
        and sin.stride() == cos.stride()
        and head_dim >= 2
        and head_dim & (head_dim - 1) == 0
        and k.dtype == cos.dtype == sin.dtype == q.dtype
        and q.stride(-1) == k.stride(-1) == cos.stride(-1) == 1
    )


def fused_rotary(original: Any) -> Any:
    """An apply_rotary_pos_emb that runs `rotary` where it fits, else `original`."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if _rotary_fits(q, k, cos, sin, unsqueeze_dim):
            return rotary(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    fused: Any = apply_rotary_pos_emb  # a function with a flag on it, which types cannot say
    fused.loom_fused = True
    return fused
