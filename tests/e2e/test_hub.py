"""Hub models downloaded by the engine-manager from a local stand-in for the Hub (HF_ENDPOINT):
progress, an asker leaving, a dropped connection, two askers, revisions, tokens, the offline
error, `loom pull`, `engine-manager models`, the example; a failure costs nothing else."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from support.fake_hub import COMMIT, FakeHub, oid
from support.managers import new_manager_handle
from support.models import make_tiny_model
from support.paths import REPO_ROOT
from support.streams import final

from loomllm import Engine, SamplingParams
from loomllm.clients.manager import ManagerClient, connect_manager
from loomllm.errors import ModelPullError, WorkerStartError

pytestmark = [pytest.mark.anyio, pytest.mark.compute]

REPO = "org/tiny"
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model_files(tmp_path_factory) -> Path:
    return Path(make_tiny_model(tmp_path_factory.mktemp("hub-model")))


@contextlib.contextmanager
def serving_hub(model_files: Path, cache: Path, token: str | None = None):
    """(fake hub, a manager downloading from it into `cache`)."""
    with FakeHub(REPO, model_files, token) as fake:
        manager = new_manager_handle(
            {
                "HF_ENDPOINT": fake.url,
                "HF_HUB_CACHE": str(cache),
                "HF_HUB_DISABLE_TELEMETRY": "1",
                "HF_TOKEN": "",  # never the developer's own
            }
        )
        manager.start()
        try:
            yield fake, manager
        finally:
            manager.stop_and_check_clean()


@pytest.fixture
def hub_site(model_files, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with serving_hub(model_files, tmp_path / "hf-cache") as site:
        yield site


async def pull(manager, model=REPO, revision=None, reports=None):
    """ManagerClient.pull, as `loom pull` asks (its error itself, not in a group)."""
    client = ManagerClient(await connect_manager(manager.socket, "cli"), lambda died: None)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(client.run)
            try:
                return await client.pull(
                    model, revision, None, (reports if reports is not None else []).append
                )
            finally:
                await client.aclose()
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None


async def test_an_engine_downloads_a_hub_model_showing_progress(hub_site, capsys, caplog):
    fake, manager = hub_site
    caplog.set_level(logging.INFO, logger="loomllm.clients.hub")
    async with Engine(REPO, manager_socket=manager.socket, dtype="float32") as e:
        out = await final(e, {"prompt_token_ids": [5, 6]}, GREEDY)
    assert len(out.outputs[0].token_ids) == 4
    assert set(fake.requests.values()) == {1}  # each file once
    assert "model.safetensors" in fake.requests and "config.json" in fake.requests
    assert f"Downloading {REPO}" in capsys.readouterr().err  # the tqdm bar, here
    assert f"downloading {REPO} from the Hub" in caplog.text
    # A second engine finds it cached: nothing is fetched again, and the Hub is not asked.
    api_calls = fake.api_calls
    async with Engine(REPO, manager_socket=manager.socket, dtype="float32") as e:
        await final(e, {"prompt_token_ids": [5, 6]}, GREEDY)
    assert set(fake.requests.values()) == {1}
    assert fake.api_calls == api_calls


async def test_an_interrupted_download_goes_on_and_a_cut_is_retried(hub_site):
    """The asker leaving (Ctrl-C on `loom pull`, an engine cancelled) does not stop the
    manager's download: asking again follows it, nothing is fetched twice. A connection
    that drops mid-file is retried."""
    fake, manager = hub_site
    fake.seconds_per_file = 0.5
    fake.cut_once.add("tokenizer.json")
    reports = []
    with anyio.move_on_after(0.3):  # the asker gives up before the download is done
        await pull(manager, reports=reports)
    pulled = await pull(manager, reports=reports)
    assert fake.requests["model.safetensors"] == 1 and fake.requests["tokenizer.json"] == 2
    for name, data in fake.files.items():
        assert (Path(pulled.path) / name).read_bytes() == data
    assert reports and all(r.done_bytes <= r.total_bytes for r in reports)
    assert reports[-1].total_bytes == sum(len(data) for data in fake.files.values())


@pytest.mark.parametrize("written", ["its first third", "wrong bytes"])
async def test_what_a_killed_download_left_is_finished_from_where_it_stops(
    hub_site, tmp_path, written
):
    """A killed daemon leaves each file it was fetching as a temporary file written part way.
    The next download fetches only the rest, and checks the whole against the Hub's etag:
    a file that does not match is fetched again from the start."""
    fake, manager = hub_site
    data = fake.files["model.safetensors"]
    blobs = tmp_path / "hf-cache" / "models--org--tiny" / "blobs"
    blobs.mkdir(parents=True)
    part = data[: len(data) // 3] if written == "its first third" else b"x" * (len(data) // 3)
    (blobs / f"{oid(data)}.0badf00d.incomplete").write_bytes(part)
    (blobs / f"{oid(data)}.00000000.incomplete").write_bytes(part[:10])  # an older one
    reports = []
    pulled = await pull(manager, reports=reports)
    assert (Path(pulled.path) / "model.safetensors").read_bytes() == data
    assert not list(blobs.glob("*.incomplete"))
    if written == "its first third":
        assert fake.ranges == [("model.safetensors", len(part))]
        assert fake.requests["model.safetensors"] == 1
    else:
        assert fake.ranges == [("model.safetensors", len(part))]  # tried, then fetched whole
        assert fake.requests["model.safetensors"] == 2
    assert reports[-1].done_bytes <= reports[-1].total_bytes


async def test_two_askers_at_once_download_it_once(hub_site):
    fake, manager = hub_site
    results = []

    async def one() -> None:
        results.append(await pull(manager))

    async with anyio.create_task_group() as tg:
        tg.start_soon(one)
        tg.start_soon(one)
    assert results[0].path == results[1].path
    assert set(fake.requests.values()) == {1}


async def test_revisions_and_unknown_models(hub_site):
    fake, manager = hub_site
    assert (await pull(manager, revision=COMMIT)).path.endswith(COMMIT)
    with pytest.raises(ModelPullError, match="has no revision 'v9'"):
        await pull(manager, revision="v9")
    with pytest.raises(ModelPullError, match="'org/nope' was not found"):
        await pull(manager, model="org/nope")
    assert (await pull(manager)).downloaded_bytes == 0  # the manager goes on; cached


async def test_a_private_model_takes_the_askers_token(model_files, tmp_path, monkeypatch):
    """The engine's HF_TOKEN reaches the manager's download (whose own environment has none)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with serving_hub(model_files, tmp_path / "hf-cache", token="secret") as (fake, manager):
        with pytest.raises(ModelPullError, match=r"refused \(401\): it is private or gated"):
            await pull(manager)
        monkeypatch.setenv("HF_TOKEN", "secret")
        async with Engine(REPO, manager_socket=manager.socket, dtype="float32") as e:
            await final(e, {"prompt_token_ids": [5]}, GREEDY)
        assert fake.requests["model.safetensors"] == 1


async def test_offline_is_the_clear_error_and_the_manager_goes_on(
    hub_site, monkeypatch, tiny_model
):
    fake, manager = hub_site
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WorkerStartError, match=r"download it first: `loom pull org/tiny`"):
        async with Engine(REPO, manager_socket=manager.socket):
            pass
    assert not fake.requests  # nothing was downloaded
    async with Engine(tiny_model, manager_socket=manager.socket, dtype="float32") as e:
        await final(e, {"prompt_token_ids": [5]}, GREEDY)


def test_loom_pull_the_models_list_and_the_example(hub_site):
    fake, manager = hub_site
    env = {**manager.env}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loomllm.cli.main",
            "pull",
            REPO,
            "--manager-socket",
            str(manager.socket),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(f"snapshots/{COMMIT}")
    listed = manager.cli("models").stdout
    assert REPO in listed and COMMIT[:8] in listed
    refused = subprocess.run(
        [sys.executable, "-m", "loomllm.cli.main", "pull", "not-a-hub-id"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "is not a hub id" in refused.stderr
    example = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "hub_model.py"), REPO],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert example.returncode == 0, example.stderr
    assert example.stdout.strip()
    assert set(fake.requests.values()) == {1}


def test_ollama_pull_downloads_through_the_manager_with_progress(hub_site, model_files):
    """Ollama's /api/pull on `loom serve`: the served engine's manager downloads the model,
    the official client sees the bytes come in and success; an unknown one is a 404."""
    import ollama
    from support.servers import loom_serve

    fake, manager = hub_site
    fake.seconds_per_file = 0.3  # slow enough for progress reports to come in
    with loom_serve(str(model_files), manager.socket, "tiny") as server:
        with ollama.Client(host=server.base_url) as client:
            steps = list(client.pull(REPO, stream=True))
            assert steps[0].status == "pulling manifest" and steps[-1].status == "success"
            progress = [(s.completed, s.total) for s in steps if s.total is not None]
            assert progress[-1][1] == sum(len(data) for data in fake.files.values())
            assert all(done <= total for done, total in progress)
            assert [done for done, _ in progress] == sorted(done for done, _ in progress)
            assert client.pull(REPO).status == "success"  # cached: nothing fetched again
            with pytest.raises(ollama.ResponseError) as err:
                client.pull("org/nope")
            assert err.value.status_code == 404 and "org/nope" in err.value.error
            with pytest.raises(ollama.ResponseError) as err:
                client.pull("not a hub id")
            assert err.value.status_code == 400
    assert set(fake.requests.values()) == {1}  # each file once
