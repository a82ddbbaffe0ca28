"""The CPU's quantized linear kernels against float64 math on the weights they hold, and the
per-machine kernel choice: its batch buckets, its cache, the kinds a weight allows."""

from __future__ import annotations

import json

import pytest
import torch

from loomllm.workers.kernels import cpu_kernel_choice
from loomllm.workers.kernels.cpu_linear import (
    GroupwiseInt4,
    Int4Linear,
    Int8Linear,
    fits_int4,
    fits_int8,
)


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.double() @ weight.double().t()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def test_int4_groups_round_trip_within_half_a_step():
    torch.manual_seed(0)
    weight = torch.randn(48, 96)
    groups = GroupwiseInt4.from_dense(weight)
    assert groups.codes.dtype == torch.int32 and 0 <= groups.codes.min() <= groups.codes.max() <= 15
    step = groups.scale.repeat_interleave(32, dim=1)
    assert ((groups.dequantize() - weight).abs() <= step / 2 + 1e-6).all()
    constant = GroupwiseInt4.from_dense(torch.full((16, 32), 0.25))
    assert torch.equal(constant.dequantize(), torch.full((16, 32), 0.25))


@pytest.mark.parametrize(("dtype", "bound"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_int4_linear_computes_with_its_groups(dtype, bound, rows):
    torch.manual_seed(1)
    groups = GroupwiseInt4.from_dense(torch.randn(64, 128))
    x = torch.randn(rows, 128).to(dtype)
    got = Int4Linear(groups, dtype)(x)
    assert got.dtype == dtype and got.shape == (rows, 64)
    assert relative_error(got, reference(x, groups.dequantize())) < bound
    batched = Int4Linear(groups, dtype)(x.view(1, rows, 128))  # [1, T, K] as the model calls it
    assert torch.equal(batched[0], got)


@pytest.mark.parametrize(("dtype", "bound"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_int8_linear_computes_with_its_codes(dtype, bound):
    torch.manual_seed(2)
    weight = torch.randn(40, 96)
    layer = Int8Linear(weight, dtype)
    if dtype == torch.float32:  # (in bf16 the scales themselves are rounded)
        assert (layer.dequantize() - weight).abs().max() <= weight.abs().max() / 127 / 2 + 1e-6
    x = torch.randn(5, 96).to(dtype)
    assert relative_error(layer(x), reference(x, layer.dequantize())) < bound


def test_quantized_kernels_need_whole_groups():
    assert fits_int4(576, 960) and not fits_int4(100, 64) and not fits_int4(64, 24)
    assert fits_int8(576) and not fits_int8(72)


@pytest.mark.parametrize(
    ("rows", "bucket"), [(0, 1), (1, 1), (2, 1), (3, 8), (8, 8), (20, 32), (32, 32), (500, 128)]
)
def test_a_step_uses_the_nearest_measured_batch_size(rows, bucket):
    assert cpu_kernel_choice.BATCH_SIZES[cpu_kernel_choice.batch_index(rows)] == bucket


def test_choices_are_measured_once_per_machine_then_read_from_the_cache(tmp_path, monkeypatch):
    shapes = {(64, 32): frozenset({"dense", "int8", "int4"}), (32, 16): frozenset({"dense"})}
    first = cpu_kernel_choice.choose(shapes, torch.float32, tmp_path)
    assert set(first) == set(shapes) and first[(32, 16)] == ("dense",) * 4
    assert all(set(choice) <= shapes[shape] for shape, choice in first.items())
    (cache,) = tmp_path.iterdir()
    assert cache.name == f"{cpu_kernel_choice.machine_key(torch.float32)}.json"
    assert list(json.loads(cache.read_text())) == ["64x32:dense,int4,int8"]

    def no_measuring(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(cpu_kernel_choice, "measure", no_measuring)
    assert cpu_kernel_choice.choose(shapes, torch.float32, tmp_path) == first
    # A different set of allowed kinds is a different question, and is measured.
    with pytest.raises(AssertionError, match="measured again"):
        cpu_kernel_choice.choose({(64, 32): frozenset({"dense", "int8"})}, torch.float32, tmp_path)


def test_measurement_picks_the_fastest(monkeypatch):
    def timed(fn):
        kernel = fn.__defaults__[0]  # each timed call is `lambda k=kernel, x=x: k(x)`
        return {Int8Linear: 1.0, Int4Linear: 2.0}.get(type(kernel), 3.0)

    monkeypatch.setattr(cpu_kernel_choice, "_seconds_per_call", timed)
    choice = cpu_kernel_choice.measure((64, 32), ["dense", "int4", "int8"], torch.float32)
    assert choice == ("int8",) * len(cpu_kernel_choice.BATCH_SIZES)
    choice = cpu_kernel_choice.measure((64, 32), ["dense", "int4"], torch.float32)
    assert choice == ("int4",) * len(cpu_kernel_choice.BATCH_SIZES)
