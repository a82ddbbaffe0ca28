"""scheduling_policy="priority" end to end: lower priority runs first, through Engine, LLM
and the server; under FCFS a priority is refused (400 naming it), and nothing else is lost.
asyncio and trio.
"""

from __future__ import annotations

import anyio
import pytest
from support.servers import assert_error, running

from loomllm import LLM, Engine, SamplingParams

pytestmark = pytest.mark.anyio

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


async def test_lower_priority_runs_first(tiny_model, shared_manager):
    async with Engine(
        tiny_model,
        manager_socket=shared_manager.socket,
        dtype="float32",
        scheduling_policy="priority",
        max_num_seqs=1,
    ) as engine:
        finished: list[str] = []
        tokens: dict[str, list[int]] = {}

        async def run(stream, name: str) -> None:
            async for out in stream:
                tokens[name] = out.outputs[0].token_ids
            finished.append(name)

        async with anyio.create_task_group() as tg:
            # Queued together (no await between them): the first step sees all four.
            for name, priority in [("b", 1), ("d", 3), ("a", 0), ("c", 2)]:
                prompt = {"prompt_token_ids": [5, 6, 7]}
                tg.start_soon(run, engine.generate(prompt, GREEDY, priority=priority), name)
        assert finished == ["a", "b", "c", "d"]
        assert len({tuple(t) for t in tokens.values()}) == 1  # the same prompt, greedy


async def test_fcfs_refuses_a_priority_and_keeps_serving(chat_model, shared_manager):
    async with running(chat_model, shared_manager) as (engine, client):
        with pytest.raises(ValueError, match="priority 2 needs scheduling_policy='priority'"):
            engine.generate("w5", GREEDY, priority=2)
        with pytest.raises(ValueError, match="priority must be an integer"):
            engine.generate("w5", GREEDY, priority=1.5)
        body = {"prompt": "w5 w6", "max_tokens": 2, "priority": 1}
        assert_error(await client.post("/v1/completions", json=body), 400, "priority")
        chat = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 2, "priority": -1}
        assert_error(await client.post("/v1/chat/completions", json=chat), 400, "priority")
        ok = await client.post("/v1/completions", json={**body, "priority": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        doc = (await client.get("/openapi.json")).json()["components"]["schemas"]
        assert doc["CompletionBody"]["properties"]["priority"]["enum"] == [0, None]


async def test_the_server_takes_a_priority_under_the_priority_policy(chat_model, shared_manager):
    policy = {"scheduling_policy": "priority"}
    async with running(chat_model, shared_manager, policy) as (_, client):
        body = {"prompt": "w5 w6", "max_tokens": 2, "priority": -7}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        chat = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 2, "priority": 4}
        response = await client.post("/v1/chat/completions", json=chat)
        assert response.status_code == 200, response.text
        assert_error(
            await client.post("/v1/completions", json={**body, "priority": "high"}), 400, "priority"
        )
        doc = (await client.get("/openapi.json")).json()["components"]["schemas"]
        assert doc["CompletionBody"]["properties"]["priority"]["type"] == ["integer", "null"]


def test_llm_takes_one_priority_or_one_each(tiny_model, shared_manager):
    prompts = [{"prompt_token_ids": [5 + i, 6]} for i in range(3)]
    with LLM(
        tiny_model,
        manager_socket=shared_manager.socket,
        dtype="float32",
        scheduling_policy="priority",
    ) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=[2, 0, 1])
        assert [o.prompt_token_ids for o in outputs] == [p["prompt_token_ids"] for p in prompts]
        assert len(llm.generate(prompts, GREEDY, use_tqdm=False, priority=3)) == 3
        with pytest.raises(ValueError, match="got 2 priorities for 3 prompts"):
            llm.generate(prompts, GREEDY, use_tqdm=False, priority=[1, 2])
