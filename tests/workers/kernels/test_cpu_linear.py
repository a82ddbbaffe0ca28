"""The CPU's quantized linear kernels against float64 math on the weights they hold, and the
per-machine kernel choice: its batch buckets, its cache, the kinds a weight allows."""

from __future__ import annotations

import json

import pytest
import torch

from loomllm.workers.kernels import cpu_kernel_choice
from loomllm.workers.kernels.cpu_linear import (
    BlockLinear,
    CodeBlocks,
    GroupwiseInt4,
    Int4Linear,
    Int8Linear,
    fits_int4,
    fits_int8,
    int4_values,
)


@pytest.fixture(autouse=True)
def idle_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The contention probe reads 0: a busy host (CI's, a build beside the tests) would make the
    kernel choice decline to cache, rightly, and the cache tests fail. The tests of contention
    give their own probe."""
    monkeypatch.setattr(cpu_kernel_choice, "waiting_ns", lambda: 0)


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


def test_int4_groups_hold_float16_scales_and_minimums_where_they_fit():
    """Quantized on load, a weight's groups stream as GGUF's Q4_1 do (float16 scales and
    offsets in the block kernel); a group beyond float16's range keeps float32 values, and
    its layer float32 scales, still within half a step."""
    torch.manual_seed(3)
    weight = torch.randn(32, 64) * 0.05
    groups = GroupwiseInt4.from_dense(weight)
    low = weight.view(32, 2, 32).amin(-1)
    for values in (groups.scale, low.half().float()):
        assert torch.equal(values.half().float(), values)
    layer = BlockLinear(CodeBlocks.from_int4(groups), ops=None)
    assert (layer.scales.dtype, layer.scales.shape[2]) == (torch.float16, 2)
    huge = weight.clone()
    huge[0, :32] = torch.linspace(-1e6, 1e6, 32)  # a scale and a minimum beyond float16
    wide = GroupwiseInt4.from_dense(huge)
    assert wide.scale[0, 0] == 2e6 / 15 and torch.equal(wide.scale[1:], groups.scale[1:])
    step = wide.scale.repeat_interleave(32, dim=1)
    assert ((wide.dequantize() - huge).abs() <= step / 2 + 1e-6 * huge.abs()).all()
    layer = BlockLinear(CodeBlocks.from_int4(wide), ops=None)
    assert layer.scales.dtype == torch.float32


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
    (cache,) = tmp_path.glob("*.json")
    assert cache.name == f"{cpu_kernel_choice.machine_key(torch.float32)}.json"
    assert list(json.loads(cache.read_text())) == ["64x32:dense,int4,int8"]

    def no_measuring(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(cpu_kernel_choice, "measure", no_measuring)
    assert cpu_kernel_choice.choose(shapes, torch.float32, tmp_path) == first
    # A different set of allowed kinds is a different question, and is measured.
    with pytest.raises(AssertionError, match="measured again"):
        cpu_kernel_choice.choose({(64, 32): frozenset({"dense", "int8"})}, torch.float32, tmp_path)


def contended_for(tries: int):
    """A fake waiting_ns: each timing of the first `tries` sees 1000 s of waiting, the rest
    none (it is read before and after each)."""
    readings = iter([0, 10**12] * tries)
    return lambda: next(readings, 0)


def counting_measure(monkeypatch) -> list[tuple]:
    measured: list[tuple] = []
    real = cpu_kernel_choice.measure
    monkeypatch.setattr(
        cpu_kernel_choice, "measure", lambda *args: measured.append(args) or real(*args)
    )
    return measured


def test_a_measurement_while_other_work_holds_the_cores_is_used_but_not_cached(
    tmp_path, monkeypatch, caplog
):
    """Threads kept waiting for a core slow the kernel with the most barriers most, so such a
    measurement would stick a wrong choice to the machine for good."""
    shapes = {(64, 32): frozenset({"dense", "int8", "int4"})}
    monkeypatch.setattr(cpu_kernel_choice, "_RETRY_PAUSE_S", 0.0)
    monkeypatch.setattr(cpu_kernel_choice, "waiting_ns", contended_for(cpu_kernel_choice._TRIES))
    measured = counting_measure(monkeypatch)
    with caplog.at_level("WARNING", logger=cpu_kernel_choice.__name__):
        choice = cpu_kernel_choice.choose(shapes, torch.float32, tmp_path)
    assert set(choice[(64, 32)]) <= shapes[(64, 32)]
    assert len(measured) == cpu_kernel_choice._TRIES
    assert not list(tmp_path.glob("*.json"))
    assert "64x32 measured while other work held the cores" in caplog.text
    # The next start measures again, and keeps a timing the cores were free for.
    monkeypatch.setattr(cpu_kernel_choice, "waiting_ns", lambda: 0)
    cpu_kernel_choice.choose(shapes, torch.float32, tmp_path)
    assert len(measured) == cpu_kernel_choice._TRIES + 1
    (cache,) = tmp_path.glob("*.json")
    assert list(json.loads(cache.read_text())) == ["64x32:dense,int4,int8"]


def test_a_measurement_tries_again_once_the_cores_come_free(tmp_path, monkeypatch):
    shapes = {(64, 32): frozenset({"dense", "int8", "int4"})}
    monkeypatch.setattr(cpu_kernel_choice, "_RETRY_PAUSE_S", 0.0)
    monkeypatch.setattr(cpu_kernel_choice, "waiting_ns", contended_for(1))
    measured = counting_measure(monkeypatch)
    cpu_kernel_choice.choose(shapes, torch.float32, tmp_path)
    assert len(measured) == 2
    (cache,) = tmp_path.glob("*.json")
    assert list(json.loads(cache.read_text())) == ["64x32:dense,int4,int8"]


def test_measurement_picks_the_fastest(monkeypatch):
    def timed(fn):
        kernel = fn.__defaults__[0]  # each timed call is `lambda k=kernel, x=x: k(x)`
        return {Int8Linear: 1.0, Int4Linear: 2.0}.get(type(kernel), 3.0)

    monkeypatch.setattr(cpu_kernel_choice, "_seconds_per_call", timed)
    choice = cpu_kernel_choice.measure((64, 32), ["dense", "int4", "int8"], torch.float32)
    assert choice == ("int8",) * len(cpu_kernel_choice.BATCH_SIZES)
    choice = cpu_kernel_choice.measure((64, 32), ["dense", "int4"], torch.float32)
    assert choice == ("int4",) * len(cpu_kernel_choice.BATCH_SIZES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows_are_computed_as_contiguous_ones(dtype):
    """The int8 kernel's bfloat16 path crashed on rows with a stride off its vector width."""
    torch.manual_seed(3)
    weight = torch.randn(48, 96)
    wide = torch.randn(4, 200).to(dtype)
    x = wide[:, :96]  # rows 200 apart
    for layer in (Int8Linear(weight, dtype), Int4Linear(GroupwiseInt4.from_dense(weight), dtype)):
        assert torch.equal(layer(x), layer(x.contiguous()))


def test_int4_values_are_what_the_kernel_computes_with_in_bfloat16():
    torch.manual_seed(5)
    groups = GroupwiseInt4.from_dense(torch.randn(64, 128) * 0.05)
    x = torch.randn(3, 128).to(torch.bfloat16)
    got = Int4Linear(groups, torch.bfloat16)(x)
    rounded = relative_error(got, reference(x, int4_values(groups, torch.bfloat16)))
    unrounded = relative_error(got, reference(x, groups.dequantize()))
    assert rounded < 1e-2 and rounded <= unrounded


def test_the_dense_kernel_is_timed_at_every_batch_size(monkeypatch):
    """A dense matmul far slower at one row is still timed at bigger batches."""
    seen = []

    def timed(fn):
        kernel = fn.__defaults__[0]
        is_dense = not isinstance(kernel, Int8Linear | Int4Linear)
        seen.append(is_dense)
        return 10.0 if is_dense else 1.0

    monkeypatch.setattr(cpu_kernel_choice, "_seconds_per_call", timed)
    cpu_kernel_choice.measure((64, 32), ["dense", "int8"], torch.float32)
    assert seen.count(True) == len(cpu_kernel_choice.BATCH_SIZES) * cpu_kernel_choice._ROUNDS


@pytest.mark.parametrize("content", ["[1, 2]", "not json", '{"64x32:dense,int8": 5}'])
def test_a_cache_file_of_another_shape_is_measured_over(content, tmp_path):
    cache = tmp_path / f"{cpu_kernel_choice.machine_key(torch.float32)}.json"
    cache.write_text(content)
    shapes = {(64, 32): frozenset({"dense", "int8"})}
    choice = cpu_kernel_choice.choose(shapes, torch.float32, tmp_path)[(64, 32)]
    assert set(choice) <= {"dense", "int8"}
    assert json.loads(cache.read_text())["64x32:dense,int8"] == list(choice)


def test_an_unwritable_cache_dir_measures_without_it(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    shapes = {(64, 32): frozenset({"dense", "int8"})}
    assert (64, 32) in cpu_kernel_choice.choose(shapes, torch.float32, blocked / "cache")
