"""The CPU's C++ ops (torch.ops.loom_cpu) behind a stand-in that counts each op's calls."""

from __future__ import annotations

import collections
from typing import Any


class CountingOps:
    """The C++ ops, counting the calls of each: `calls["decode_layers"]`, ..."""

    def __init__(self, ops: Any) -> None:
        self.ops, self.calls = ops, collections.Counter()

    def __getattr__(self, name: str) -> Any:
        op = getattr(self.ops, name)

        def counted(*args: Any) -> Any:
            self.calls[name] += 1
            return op(*args)

        return counted
