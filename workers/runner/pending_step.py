"""PendingStep: a launched step's sampled tokens, kept on the device until the host needs them.

With async scheduling the next step's decodes read them there while they copy to the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from loomllm.protocols.messages import (
    PooledOutput,
    PromptLogprobs,
    RequestError,
    StepResult,
    TopLogprobs,
)

NOTHING_TO_SAMPLE = (
    "nothing is left to sample: structured_outputs, allowed_token_ids and "
    "min_tokens (which bans eos) together exclude every token"
)


@dataclass(eq=False)
class PendingStep:
    """One launched step; `result()` waits for the copy and builds its StepResult once."""

    call_id: int
    samplers: list[Any]  # the CachedRequestState of each sampled row, in row order
    sampled: torch.Tensor  # [B] int64 on the device: what the next step's decodes read
    logprobs: torch.Tensor  # [B] float32
    top_logprobs: list[TopLogprobs | None]
    prompt_logprobs: list[PromptLogprobs]
    request_errors: list[RequestError] = field(default_factory=list)
    # [B] bool on the device: rows that had no token left to sample (their requests fail)
    stuck: torch.Tensor | None = None
    pooled: list[PooledOutput] = field(default_factory=list)  # a pooling runner's embeddings
    # id() of each sampled request's state -> its row in `sampled`: by identity, since a
    # new request may take a finished one's id while this step is still unread.
    rows: dict[int, int] = field(init=False)
    _host: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] = field(init=False)
    _copied: Any = field(init=False, default=None)  # torch.cuda.Event of the copy
    _result: StepResult | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.rows = {id(state): row for row, state in enumerate(self.samplers)}
        if self.sampled.is_cuda:
            # Start the copy now, on the current stream, without blocking the host: the
            # next step's kernels queue up behind it and the host waits only in result().
            stuck = None if self.stuck is None else self.stuck.to("cpu", non_blocking=True)
            self._host = (
                self.sampled.to("cpu", non_blocking=True),
                self.logprobs.to("cpu", non_blocking=True),
                stuck,
            )
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host = (self.sampled, self.logprobs, self.stuck)

    @property
    def is_resolved(self) -> bool:
        return self._result is not None

    def wait(self) -> None:
        """Block until the tokens are on the host (any thread may wait)."""
        if self._copied is not None:
            self._copied.synchronize()

    def result(self) -> StepResult:
        """The step's StepResult; the first call reads the tokens into the requests' state."""
        if self._result is None:
            self.wait()
            token_ids = self._host[0].tolist()
            for state, token_id in zip(self.samplers, token_ids, strict=True):
                state.output_token_ids.append(token_id)
                state.all_token_ids.append(token_id)
            if self._host[2] is not None:
                self.request_errors += [
                    RequestError(state.req_id, NOTHING_TO_SAMPLE)
                    for state, stuck in zip(self.samplers, self._host[2].tolist(), strict=True)
                    if stuck
                ]
            self._result = StepResult(
                self.call_id,
                [s.req_id for s in self.samplers],
                token_ids,
                self._host[1].tolist(),
                self.top_logprobs,
                self.prompt_logprobs,
                request_errors=self.request_errors,
                pooled=self.pooled,
            )
        return self._result
