"""End to end: one `loom serve` with three models (the command line's and a models file's)
and --max-loaded-models 1, through the official `ollama` and `openai` clients: a model loads
on demand, the least recently used one is evicted (gone from /api/ps and from
`engine-manager ps`), and its next request loads it again (asyncio and trio)."""

from __future__ import annotations

import ollama
import openai
import pytest
from support.models import make_tiny_model
from support.servers import loom_serve

pytestmark = pytest.mark.compute

GREEDY = {"temperature": 0, "num_predict": 5}
OPTIONS = ("--max-num-seqs", "43")  # workers of this file's own, reused by no other test


def workers(manager) -> dict[int, tuple[str, str]]:
    """`engine-manager ps`: {pid: (model, state)} of every worker."""
    result = manager.cli("ps")
    assert result.returncode == 0, result.stderr + result.stdout
    header, *lines = result.stdout.splitlines()
    names = header.split()
    rows = [dict(zip(names, line.split(), strict=False)) for line in lines]
    return {int(row["PID"]): (row["MODEL"], row["STATE"]) for row in rows}


def busy_workers(manager) -> dict[int, str]:
    """{pid: model} of the workers attached to an engine."""
    return {pid: model for pid, (model, state) in workers(manager).items() if state == "busy"}


def answer(client: ollama.Client, model: str) -> str:
    return client.generate(model=model, prompt="w5 w6", options=GREEDY, raw=True).response


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_three_models_one_loaded_at_a_time(tiny_model, shared_manager, tmp_path, loop):
    paths = {
        name: make_tiny_model(tmp_path / name, seed=seed) for seed, name in [(21, "b"), (22, "c")]
    }
    models_file = tmp_path / "models.toml"
    models_file.write_text(
        "".join(
            f'[models.{name}]\nmodel = "{path}"\nmax_num_seqs = 43\n'
            for name, path in paths.items()
        )
    )
    extra = ("--models-file", str(models_file), "--max-loaded-models", "1", *OPTIONS)
    with (
        loom_serve(tiny_model, shared_manager.socket, "tiny", loop, *extra) as server,
        ollama.Client(host=server.base_url) as client,
    ):
        assert [m.model for m in client.ps().models] == ["tiny"]
        assert sorted(m.model for m in client.list().models) == ["b", "c", "tiny"]
        tiny_pids = [
            pid for pid, model in busy_workers(shared_manager).items() if model == tiny_model
        ]
        assert len(tiny_pids) == 1
        first = answer(client, "tiny")

        b_answer = answer(client, "b")  # loads b; tiny, the only other, is evicted
        assert b_answer != first
        assert [m.model for m in client.ps().models] == ["b"]
        busy = busy_workers(shared_manager)
        assert tiny_pids[0] not in busy and paths["b"] in busy.values()
        assert tiny_pids[0] not in workers(shared_manager)  # stopped, not kept warm

        assert answer(client, "tiny") == first  # loaded again, the same answer; b evicted
        assert [m.model for m in client.ps().models] == ["tiny"]
        assert paths["b"] not in busy_workers(shared_manager).values()

        # The openai client picks models by name too, and /v1/models lists them all.
        api = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        listed = {m.id: m.model_extra["loaded"] for m in api.models.list().data}
        assert listed == {"tiny": True, "b": False, "c": False}
        text = api.completions.create(model="c", prompt="w5 w6", max_tokens=5, temperature=0)
        assert text.model == "c" and [m.model for m in client.ps().models] == ["c"]
        with pytest.raises(openai.NotFoundError, match="'nope'"):
            api.completions.create(model="nope", prompt="w5", max_tokens=1)
        assert answer(client, "b") == b_answer
