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
    logprobs: torch.Tensor | None  # [B] float32; None: not computed (no row asked for them)
    top_logprobs: list[TopLogprobs | None]
    prompt_logprobs: list[PromptLogprobs]
    request_errors: list[RequestError] = field(default_factory=list)
    # [B] bool on the device: rows that had no token left to sample (their requests fail)
    stuck: torch.Tensor | None = None
    pooled: list[PooledOutput] = field(default_factory=list)  # a pooling runner's embeddings
    # Speculative decoding: per sampling request, its first row and its drafts; the rows
    # after the first sample after each draft (None: one row per request, no drafts).
    spec: list[tuple[int, list[int]]] | None = None
    # id() of each sampled request's state -> its row in `sampled`: by identity, since a
    # new request may take a finished one's id while this step is still unread.
    rows: dict[int, int] = field(init=False)
    _host: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] = field(init=False)
    _copied: Any = field(init=False, default=None)  # torch.cuda.Event of the copy
    _result: StepResult | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.rows = {id(state): row for row, state in enumerate(self.samplers)}
        if self.sampled.is_cuda:
            # Start the copy now, on the current stream, without blocking the host: the
            # next step's kernels queue up behind it and the host waits only in result().
            stuck = None if self.stuck is None else self.stuck.to("cpu", non_blocking=True)
            logprobs = self.logprobs
            self._host = (
                self.sampled.to("cpu", non_blocking=True),
                None if logprobs is None else logprobs.to("cpu", non_blocking=True),
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
            # None for each token where no request asked for logprobs.
            logprobs = [None] * len(token_ids) if self._host[1] is None else self._host[1].tolist()
            stuck = self._host[2].tolist() if self._host[2] is not None else None
            spec = self.spec or [(row, []) for row in range(len(self.samplers))]
            states, sampled, sampled_lps, tops, draft_lps = [], [], [], [], []
            for first, drafts in spec:
                state = self.samplers[first]
                # A draft stands where the row before it sampled that very token: what
                # decoding would have drawn there, with the same seed and history.
                accepted = 0
                while accepted < len(drafts) and token_ids[first + accepted] == drafts[accepted]:
                    accepted += 1
                last = first + accepted
                for token_id in [*drafts[:accepted], token_ids[last]]:
                    state.output_token_ids.append(token_id)
                    state.all_token_ids.append(token_id)
                states.append(state)
                sampled.append(token_ids[last])
                sampled_lps.append(logprobs[last])
                tops.append(self.top_logprobs[last])
                draft_lps.append(logprobs[first:last])
                if stuck is not None and any(stuck[first : last + 1]):
                    self.request_errors.append(RequestError(state.req_id, NOTHING_TO_SAMPLE))
            self._result = StepResult(
                self.call_id,
                [s.req_id for s in states],
                sampled,
                sampled_lps,
                tops,
                self.prompt_logprobs,
                request_errors=self.request_errors,
                pooled=self.pooled,
                draft_logprobs=draft_lps if self.spec is not None else [],
            )
        return self._result
