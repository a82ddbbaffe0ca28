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
