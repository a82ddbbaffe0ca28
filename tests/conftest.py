"""Shared fixtures: both anyio backends, tiny random models, and managers on temporary sockets.

The reliability suite's fault table (fault_report.py) prints at the end of the run.
Tests never touch the user's own daemon: every manager here lives under a fresh short
directory in /tmp (Unix socket paths are limited to 108 bytes), and teardown checks
that no process started for it is left behind.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

# No GPU here: Triton kernels run in Triton's interpreter, on CPU tensors. Set before any
# import of triton (it reads it when kernels are defined and when they run); subprocesses
# inherit it, harmlessly: their CPU path does not use Triton.
os.environ["TRITON_INTERPRET"] = "1"

# `make test` runs all but the `serial` tests on two pytest-xdist workers. Each worker, and
# every process it starts, keeps to one core: torch sizes its thread pools by the cores a
# process may run on, and two pools spinning over the same two cores ran a 35 s test past 300 s.
if xdist_worker := os.environ.get("PYTEST_XDIST_WORKER"):  # "gw0", "gw1", ...
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[int(xdist_worker.removeprefix("gw")) % len(cores)]})

from support.fault_report import REPORT, FaultReport, write_summary
from support.managers import ManagerHandle, new_manager_handle
from support.models import CHAT_TEMPLATE, make_char_model, make_tiny_model
from support.servers import running

from loomllm import Engine


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def manager() -> Iterator[ManagerHandle]:
    """A fresh manager socket for one test (started on demand by the test or an Engine)."""
    handle = new_manager_handle()
    yield handle
    handle.stop_and_check_clean()


@pytest.fixture
def other_manager() -> Iterator[ManagerHandle]:
    """A second fresh manager socket, for tests that run two managers side by side."""
    handle = new_manager_handle()
    yield handle
    handle.stop_and_check_clean()


@pytest.fixture(scope="session")
def shared_manager() -> Iterator[ManagerHandle]:
    """One running manager for the whole session, so tests share warm workers."""
    handle = new_manager_handle()
    handle.start()
    yield handle
    handle.stop_and_check_clean()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def chat_model(tiny_model, tmp_path_factory) -> str:
    """A copy of the tiny model with a simple chat template (CHAT_TEMPLATE)."""
    import json

    path = tmp_path_factory.mktemp("tiny-chat") / "m"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="session")
def char_model(tmp_path_factory) -> str:
    return make_char_model(tmp_path_factory.mktemp("char") / "m")


@pytest.fixture
async def engine(tiny_model, shared_manager):
    """An Engine on the tiny model (float32) under the shared manager."""
    async with Engine(tiny_model, manager_socket=shared_manager.socket, dtype="float32") as e:
        yield e


@pytest.fixture
async def server(tiny_model, shared_manager):
    """(engine, httpx client) of the OpenAI app served in-process over the tiny model."""
    async with running(tiny_model, shared_manager) as pair:
        yield pair


@pytest.fixture
async def char_server(char_model, shared_manager):
    """(engine, httpx client) of the OpenAI app served in-process over the character model."""
    async with running(char_model, shared_manager) as pair:
        yield pair


@pytest.fixture(scope="session")
def fault_report() -> FaultReport:
    return REPORT


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under xdist, the `compute` files first (`make test` hands out files in this order):
    the long ones start early, and the short ones even out the two workers' ends."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("compute") is None)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    write_summary(terminalreporter)
