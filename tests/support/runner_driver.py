"""Drive a real Scheduler over a ModelRunner as EngineCore does, with or without async scheduling.

`ahead`: each step is launched before the previous step's tokens are applied (the engine
applies them after sending the next step), so its decodes read those tokens from the
device. Returns every EngineCoreOutput per request.
"""

from __future__ import annotations

from collections.abc import Callable

from loomllm.core.scheduler import EngineCoreOutput, Scheduler
from loomllm.protocols.messages import SchedulerOutput
from loomllm.workers.runner.model_runner import ModelRunner


def drive(
    scheduler: Scheduler,
    runner: ModelRunner,
    ahead: bool,
    on_schedule: Callable[[SchedulerOutput], None] | None = None,
    max_steps: int = 300,
) -> dict[str, list[EngineCoreOutput]]:
    outputs: dict[str, list[EngineCoreOutput]] = {r: [] for r in scheduler.requests}

    def apply(so, step) -> None:
        for out in scheduler.update_from_output(so, step.result()):
            outputs[out.request_id].append(out)

    held = None
    for call_id in range(max_steps):
        if not scheduler.has_unfinished_requests() and held is None:
            return outputs
        so = scheduler.schedule()
        if on_schedule is not None:
            on_schedule(so)
        step = runner.launch(so, call_id) if so.num_scheduled_tokens else None
        if not ahead:
            if step is not None:
                apply(so, step)
            continue
        if held is not None:
            apply(*held)
        held = (so, step) if step is not None else None
    raise AssertionError("requests did not finish")
