"""--generation-config: the model's generation_config.json sampling defaults, for requests
that leave a field out (Engine and LLM without params, the server's missing fields), as vLLM
applies them; "vllm": none. asyncio and trio.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.servers import running

from loomllm import LLM, Engine, SamplingParams
from loomllm.engine.generation_defaults import sampling_defaults
from loomllm.server.bodies.openai_bodies import ChatBody, CompletionBody
from loomllm.server.openai.body_parsing import parse
from loomllm.server.openai.schemas import parse_chat, parse_completion

RECOMMENDED = {
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "do_sample": True,
    "max_new_tokens": 5,
    "bos_token_id": 0,
    "min_p": None,
}


def write_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_the_sampling_keys_are_read_and_bad_ones_left_out(tmp_path, caplog):
    model = write_config(tmp_path / "m", RECOMMENDED)
    assert sampling_defaults("auto", str(model)) == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "max_tokens": 5,
    }
    assert sampling_defaults("vllm", str(model)) == {}
    other = write_config(tmp_path / "other", {"repetition_penalty": 1.1})
    assert sampling_defaults(str(other), str(model)) == {"repetition_penalty": 1.1}
    bad = write_config(tmp_path / "bad", {"temperature": 0.7, "top_p": 2.0})
    assert sampling_defaults("auto", str(bad)) == {}
    assert "top_p" in caplog.text
    (tmp_path / "broken" / "generation_config.json").parent.mkdir()
    (tmp_path / "broken" / "generation_config.json").write_text("{")
    assert sampling_defaults("auto", str(tmp_path / "broken")) == {}
    assert sampling_defaults("auto", str(tmp_path)) == {}  # none there


def test_the_body_wins_over_the_defaults_and_max_new_tokens_caps():
    defaults = {"temperature": 0.0, "top_k": 20, "max_tokens": 10}
    params = parse_completion(
        parse(CompletionBody, {"prompt": "w5", "temperature": 1.0}), defaults
    ).common.params
    assert (params.temperature, params.top_k, params.max_tokens) == (1.0, 20, 10)
    chat = parse_chat(
        parse(ChatBody, {"messages": [{"role": "user", "content": "w5"}]}), defaults=defaults
    )
    assert (chat.common.params.temperature, chat.common.params.top_k) == (0.0, 20)
    assert chat.common.params.max_tokens == 10  # chat's absent max_tokens: the model's
    capped = parse_completion(
        parse(CompletionBody, {"prompt": "w5", "max_tokens": 99}), defaults
    ).common.params
    assert capped.max_tokens == 10  # as vLLM caps it
    short = parse_completion(
        parse(CompletionBody, {"prompt": "w5", "max_tokens": 3}), defaults
    ).common.params
    assert short.max_tokens == 3


@pytest.fixture(scope="module")
def greedy_model(tiny_model, tmp_path_factory) -> str:
    """The tiny model whose generation config asks for greedy decoding."""
    path = tmp_path_factory.mktemp("greedy-default") / "m"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "generation_config.json").read_text())
    write_config(path, {**config, "temperature": 0.0})
    return str(path)


PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.mark.anyio
async def test_engine_and_server_use_the_models_defaults(greedy_model, shared_manager):
    async with running(greedy_model, shared_manager) as (engine, client):
        assert engine.default_sampling_params() == SamplingParams(temperature=0.0)
        outs = [out async for out in engine.generate(PROMPT)]
        explicit = [out async for out in engine.generate(PROMPT, GREEDY)]
        assert outs[-1].outputs[0].token_ids == explicit[-1].outputs[0].token_ids
        body = {"prompt": PROMPT["prompt_token_ids"], "max_tokens": 16}
        answers = [(await client.post("/v1/completions", json=body)).json() for _ in range(2)]
        texts = {a["choices"][0]["text"] for a in answers}
        assert texts == {explicit[-1].outputs[0].text}  # greedy, so the same each time
    async with Engine(
        greedy_model,
        manager_socket=shared_manager.socket,
        dtype="float32",
        generation_config="vllm",
    ) as plain:
        assert plain.default_sampling_params() == SamplingParams()


def test_llm_without_params_uses_the_models_defaults(greedy_model, shared_manager):
    with LLM(greedy_model, manager_socket=shared_manager.socket, dtype="float32") as llm:
        (default,) = llm.generate(PROMPT, use_tqdm=False)
        (explicit,) = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    assert default.outputs[0].token_ids == explicit.outputs[0].token_ids
