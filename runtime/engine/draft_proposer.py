"""Speculative decoding's draft model (vLLM's method "draft_model"): a second engine on a
smaller model, which drafts each decoding request's next tokens greedily before each step;
the target's workers verify them as they verify n-gram drafts."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import anyio

from loomllm.core.request import Request
from loomllm.errors import LoomError
from loomllm.protocols.sampling import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from loomllm.engine.engine import Engine

logger = logging.getLogger(__name__)


class DraftProposer:
    """Drafts with `draft`, an engine on a model with the target's vocabulary."""

    def __init__(self, draft: Engine) -> None:
        self.draft = draft
        self.num_failed = 0  # proposals that failed (the request then decodes undrafted)

    async def propose(self, rooms: list[tuple[Request, int]]) -> None:
        """Set each request's proposed_drafts: up to its room of the draft model's greedy
        tokens after the request's own, all requests batched in the draft engine."""

        async def one(request: Request, room: int) -> None:
            params = SamplingParams(
                max_tokens=room,
                temperature=0.0,
                ignore_eos=True,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            prompt = {"prompt_token_ids": list(request.all_token_ids)}
            try:
                async with self.draft.generate(prompt, params) as stream:
                    final = await anext(stream)
            except (ValueError, LoomError, StopAsyncIteration) as exc:
                self.num_failed += 1
                logger.debug("no drafts for %s: %s", request.request_id, exc)
                return
            request.proposed_drafts = final.outputs[0].token_ids[:room]

        async with anyio.create_task_group() as tg:
            for request, room in rooms:
                tg.start_soon(one, request, room)
