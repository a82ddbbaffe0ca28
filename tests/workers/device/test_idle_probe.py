"""DeviceIdleProbe's accounting on the CPU (the host's clock, scripted here): busy and idle
time, eager steps, steps with prompts, and the gaps long enough to be stalls."""

from __future__ import annotations

import pytest
import torch

from loomllm.workers.device.idle_probe import DeviceIdleProbe


def test_gaps_of_a_millisecond_or_more_count_as_stalls():
    # Three steps of 5 ms: busy 0-5, 5.2-10.2 (a replay), 13.2-18.2 ms. The gaps: 0.2 ms
    # (host work a step) and 3 ms (a stall).
    clock = iter([0.0, 5.0, 5.2, 10.2, 13.2, 18.2])
    probe = DeviceIdleProbe(torch.device("cpu"), clock=lambda: next(clock) / 1e3)
    for replayed, with_prompts in ((False, True), (True, False), (False, False)):
        probe.step_started()
        probe.step_ended(replayed, with_prompts)
    device = probe.result()
    assert device.steps == 3 and device.busy_s == pytest.approx(0.015)
    assert device.idle_s == pytest.approx(0.0032)
    assert device.eager_steps == 2 and device.eager_busy_s == pytest.approx(0.010)
    assert device.prompt_steps == 1 and device.prompt_busy_s == pytest.approx(0.005)
    assert device.stalls == 1 and device.stall_s == pytest.approx(0.003)
    assert device.longest_gap_s == pytest.approx(0.003)


def test_one_step_has_no_gap():
    probe = DeviceIdleProbe(torch.device("cpu"))
    probe.step_started()
    probe.step_ended(False)
    device = probe.result()
    assert device.steps == 1 and device.idle_s == 0 and device.stalls == 0
    assert device.longest_gap_s == 0 and device.idle_fraction == 0
