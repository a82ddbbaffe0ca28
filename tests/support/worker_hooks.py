"""Functions the tests run on the workers with `Engine.collective_rpc`.

The workers cannot import the tests, so this module is pickled by value: cloudpickle sends
the functions' code, not a reference to this module.
"""

from __future__ import annotations

import sys

import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def fail_next_launch(worker) -> None:
    """The worker's next step raises in its launch; the steps after it run as before."""
    runner = worker.runner
    launch = runner.launch

    def failing(*args, **kwargs):
        runner.launch = launch
        raise RuntimeError("injected fault in the forward pass")

    runner.launch = failing


def launch_ahead(worker) -> None:
    """The worker replies to a step after launching the next, as it does on CUDA."""
    worker.runner.overlap_launches = True


def fail_next_result(worker) -> None:
    """Reading the next launched step's tokens back raises (a device error surfacing late:
    with launch-ahead, after the step behind it was launched)."""
    runner = worker.runner
    launch = runner.launch

    def launch_once(*args, **kwargs):
        runner.launch = launch
        step = launch(*args, **kwargs)

        def failing():
            raise RuntimeError("injected fault reading the step's tokens")

        step.result = failing
        return step

    runner.launch = launch_once


def script_answers(worker, scripts: dict[tuple[int, ...], list[int]]) -> None:
    """A request whose prompt ids are a key of `scripts` samples that key's ids in turn: its
    logits are made one-hot, so it draws them whatever its sampling parameters (the model's
    real step loop, detokenizer and server shape the answer). Undo: unscript_answers."""
    import torch

    runner = worker.runner
    sample = type(runner)._sample

    def scripted(logits, samplers, pending, spec=None):
        logits = logits.clone()
        for row, state in enumerate(samplers):
            script = scripts.get(tuple(state.prompt_token_ids))
            index = len(state.output_token_ids) + (id(state) in pending)
            if script is not None and index < len(script):
                logits[row] = -torch.inf
                logits[row, script[index]] = 0.0
        return sample(runner, logits, samplers, pending, spec)

    runner._sample = scripted


def unscript_answers(worker) -> None:
    vars(worker.runner).pop("_sample", None)  # the class's own again
