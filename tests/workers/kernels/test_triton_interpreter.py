"""Triton's interpreter with helper calls that skip re-patching (kernels/triton_interpreter.py):
same results, one patching a launch however many helper calls it makes, nothing left patched;
its dtype lookups from a table, with the answers of its own; and no overflow checks that
nothing reads."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

import loomllm.workers.kernels.fused_ops  # noqa: F401  (it puts the skipping in place, as kernel modules do)
from loomllm.workers.kernels.triton_interpreter import (
    cache_dtype_lookups,
    skip_dead_overflow_checks,
    skip_nested_patches,
)


@triton.jit
def _double(x):
    return x * 2


@triton.jit
def _doubling_kernel(x_ptr, out_ptr, N: tl.constexpr, TIMES: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    for _ in tl.static_range(TIMES):
        x = _double(x)
    tl.store(out_ptr + offs, x)


def launch(times: int) -> torch.Tensor:
    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty_like(x)
    _doubling_kernel[(1,)](x, out, N=8, TIMES=times)
    return out


def test_helper_calls_inside_a_launch_patch_nothing(monkeypatch):
    assert skip_nested_patches()  # in place already, and asking again keeps it
    patched = []
    patch_builtin = interpreter._patch_builtin

    def counted(*args):
        patched.append(args[0])
        return patch_builtin(*args)

    monkeypatch.setattr(interpreter, "_patch_builtin", counted)
    load = tl.load
    counts = []
    for times in (1, 8):
        patched.clear()
        assert torch.equal(launch(times), torch.arange(8.0) * 2**times)
        counts.append(len(patched))
    # The launch's own patching only: 8 helper calls cost what 1 does.
    assert counts[0] == counts[1] > 0
    assert tl.load is load  # the launch restored what it patched


HELPER = """
import triton
from triton.language import core

@triton.jit
def larger(a, b):
    return core.maximum(a, b)
"""

KERNEL = """
import triton
import triton.language as tl
from core_helper import larger

@triton.jit
def larger_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, larger(tl.load(a_ptr + offs), tl.load(b_ptr + offs)))
"""


def test_a_helper_reaching_triton_language_core_is_patched_too(tmp_path, monkeypatch):
    """The kernel reaches triton.language, its helper triton.language.core (as Triton's own
    helpers do): the launch patched both, and restored both."""
    (tmp_path / "core_helper.py").write_text(textwrap.dedent(HELPER))
    (tmp_path / "core_kernel.py").write_text(textwrap.dedent(KERNEL))
    monkeypatch.syspath_prepend(str(tmp_path))
    import core_kernel

    a, b = torch.tensor([1.0, 5.0, -2.0, 0.0]), torch.tensor([3.0, 4.0, -1.0, 0.5])
    out = torch.empty_like(a)
    maximum = tl.core.maximum
    core_kernel.larger_kernel[(1,)](a, b, out, N=4)
    assert torch.equal(out, torch.maximum(a, b))
    assert tl.core.maximum is maximum


def test_dtype_lookups_answer_as_the_interpreters_own():
    assert cache_dtype_lookups()  # in place already, and asking again keeps it
    cached = interpreter._get_np_dtype
    shipped = cached.__wrapped__
    scalars = [
        tl.int1,
        tl.int8,
        tl.uint8,
        tl.int16,
        tl.uint16,
        tl.int32,
        tl.uint32,
        tl.int64,
        tl.uint64,
        tl.float16,
        tl.bfloat16,
        tl.float32,
        tl.float64,
        tl.float8e5,
        tl.float8e4nv,
    ]
    every = [
        *scalars,
        *(tl.block_type(t, [4, 2]) for t in scalars),
        *(tl.pointer_type(t) for t in scalars),
        tl.block_type(tl.pointer_type(tl.float32), [8]),
    ]
    for _ in range(2):  # the table fills, then answers
        assert [cached(t) for t in every] == [shipped(t) for t in every]
    # A dtype's equal but separate object gets its answer; one without a numpy type, none.
    assert cached(tl.dtype("bf16")) == shipped(tl.bfloat16)
    with pytest.raises(KeyError):
        cached(tl.void)
    with pytest.raises(KeyError):
        shipped(tl.void)


@triton.jit
def _times_65536_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) * 65536)


def times_65536(options) -> torch.Tensor:
    """An int32 product past 2**31 under these interpreter options."""
    builder = interpreter.interpreter_builder
    kept, builder.options = builder.options, options
    try:
        x = torch.tensor([1, 40000, -40000, 7], dtype=torch.int32)
        out = torch.empty_like(x)
        _times_65536_kernel[(1,)](x, out, N=4)
        return out
    finally:
        builder.options = kept


def test_overflow_checks_outside_debug_mode_were_dead_work():
    assert skip_dead_overflow_checks()  # in place already
    options = interpreter.interpreter_builder.options
    assert not options.sanitize_overflow and not options.debug
    # With the checks and without: the same wrapped product, nothing asserted.
    checked = times_65536(dataclasses.replace(options, sanitize_overflow=True))
    assert torch.equal(times_65536(options), checked)
    assert checked.tolist() == [65536, 40000 * 65536 - 2**32, 2**32 - 40000 * 65536, 458752]
    # In debug mode they assert: left on there.
    debug = dataclasses.replace(options, sanitize_overflow=True, debug=True)
    with pytest.raises(Exception, match="overflow"):
        times_65536(debug)


def test_without_the_interpreter_nothing_changes(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not skip_nested_patches() and not cache_dtype_lookups()
    assert not skip_dead_overflow_checks()


@pytest.fixture(autouse=True)
def interpreted():
    assert getattr(interpreter._patch_lang, "skips_nested", False)
