"""What one decoder layer of a decode step launches on a device, counted in Triton's
interpreter: aten ops that compute, and Triton kernels."""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from loomllm.core.request import Request
from loomllm.core.scheduler import Scheduler, SchedulerConfig
from loomllm.protocols.sampling import SamplingParams
from loomllm.workers.kernels import fused_ops
from loomllm.workers.runner.model_runner import ModelRunner

# aten ops that launch no kernel: views, allocations, dtype arithmetic.
NO_LAUNCH = {
    "view",
    "transpose",
    "t",
    "unsqueeze",
    "squeeze",
    "expand",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "alias",
    "_unsafe_view",
    "as_strided",
    "permute",
    "detach",
    "unbind",
    "reshape",
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "promote_types",
    "is_same_size",
}


class CountLaunches(TorchDispatchMode):
    """Counts what a forward launches on a device: aten ops that compute (a `to` that
    returns its input computes nothing) and Triton kernels, not the interpreter's own ops."""

    def __init__(self, monkeypatch) -> None:
        super().__init__()
        self.launches: collections.Counter = collections.Counter()
        self.in_kernel = self.active = False
        interpreted = type(fused_ops._silu_mul_kernel)  # the interpreter's kernel class
        run = interpreted.run

        def counted_run(kernel, *args, **kwargs):
            if not self.active:
                return run(kernel, *args, **kwargs)
            self.launches[kernel.fn.__name__] += 1
            self.in_kernel = True
            try:
                return run(kernel, *args, **kwargs)
            finally:
                self.in_kernel = False

        monkeypatch.setattr(interpreted, "run", counted_run)

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not (self.in_kernel or name in NO_LAUNCH or (name == "to" and out is args[0])):
            self.launches[name] += 1
        return out


def decode_layer_launches(
    monkeypatch, model: torch.nn.Module, config: Any, requests: int = 2, prompt_len: int = 3
) -> collections.Counter:
    """The launches of `model`'s second layer in a decode-only step of `requests` requests
    (contexts of one page by default: one split), run by a bf16 Triton-backend model
    runner."""
    runner = ModelRunner(
        model,
        config,
        device=torch.device("cpu"),
        dtype=torch.bfloat16,
        block_size=16,
        num_blocks=8,
        attention_backend="triton",
    )
    scheduler = Scheduler(SchedulerConfig(4, 64, 64, 16, 8))
    for i in range(requests):
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        prompt = [5 + (j + i) % 50 for j in range(prompt_len)]
        scheduler.add_request(Request(f"r{i}", prompt, params, frozenset(), 64, 0.0))
    so = scheduler.schedule()  # the prompts
    scheduler.update_from_output(so, runner.execute(so, 0))
    so = scheduler.schedule()
    assert set(so.num_scheduled_tokens.values()) == {1}  # decodes only
    layer = model.model.layers[1]
    counter = CountLaunches(monkeypatch)
    forward = layer.forward

    def counted(*args, **kwargs):
        with counter:
            return forward(*args, **kwargs)

    monkeypatch.setattr(layer, "forward", counted)
    runner.execute(so, 1)
    return counter.launches
