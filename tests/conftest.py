"""Shared fixtures: both anyio backends, tiny random models, and managers on temporary sockets.

The reliability suite's fault table (fault_report.py) prints at the end of the run.
Tests never touch the user's own daemon: every manager here lives under a fresh short
directory in /tmp (Unix socket paths are limited to 108 bytes), and teardown checks
that no process started for it is left behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

from fault_report import REPORT, FaultReport, write_summary

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@dataclass
class ManagerHandle:
    """A manager under a temporary socket, driven through the real `engine-manager` CLI."""

    socket: Path

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "LOOM_MANAGER_SOCKET": str(self.socket)}

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "loomllm.workers.manager", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def start(self, *args: str) -> None:
        result = self.cli("start", *args)
        assert result.returncode == 0, result.stderr + result.stdout

    def pid(self) -> int:
        out = self.cli("status").stdout
        return int(out.split("pid ")[1].split(",")[0])

    def worker_states(self) -> dict[int, str]:
        """{pid: state} of every worker rank, from `engine-manager ps`."""
        lines = self.cli("ps").stdout.splitlines()[1:]
        return {int(line.split()[2]): line.split()[4] for line in lines}

    def processes(self) -> list[int]:
        """pids of every process whose command line names this manager's directory."""
        return pids_mentioning(str(self.socket.parent))

    def stop_and_check_clean(self) -> None:
        self.cli("stop")
        deadline = time.monotonic() + 10
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.processes()
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.socket.parent, ignore_errors=True)
        assert not left, f"processes left behind: {left}"


def pids_mentioning(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            pids.append(int(entry))
    return pids


def new_manager_handle() -> ManagerHandle:
    return ManagerHandle(Path(tempfile.mkdtemp(prefix="loom-", dir="/tmp")) / "m.sock")


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


TINY_VOCAB = 256


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0) -> str:
    """Save a tiny random-weight decoder of architecture `arch`, with a tokenizer, to `path`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    model_cls(config_cls(**common, **extra)).save_pretrained(path)
    save_tiny_tokenizer(path)
    return str(path)


def save_tiny_tokenizer(path: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary: token i is the word "w{i}"."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(TINY_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": "w1",
        "eos_token": "w2",
        "unk_token": "w0",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


CHAT_TEMPLATE = (
    "{% for m in messages %}w{{ 10 + loop.index }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w9{% endif %}"
)


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


# SmolLM2's KV bytes a block in float32: K and V, 30 layers, 16 tokens, 3 KV heads x 64.
SMOLLM2_BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4


def preempting_smollm2(
    manager: ManagerHandle, num_blocks: int, max_num_batched_tokens: int, async_scheduling: bool
) -> Any:
    """A blocking LLM on SmolLM2 (float32) whose KV cache holds `num_blocks` blocks of 16
    tokens: a batch of a few prompts is preempted and recomputed, its prompts chunked."""
    from loomllm import LLM

    return LLM(
        "smollm2",
        manager_socket=manager.socket,
        dtype="float32",
        max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_memory=num_blocks * SMOLLM2_BLOCK_BYTES,
        max_model_len=160,
        async_scheduling=async_scheduling,
    )


@pytest.fixture(scope="session")
def char_model(tmp_path_factory) -> str:
    """A tiny random llama whose tokens are single characters (ids 3 to 127: ASCII), with a
    chat template: a vocabulary that can spell JSON, for structured outputs and tool calls."""
    import json

    import torch
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    path = tmp_path_factory.mktemp("char") / "m"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {**{t: i for i, t in enumerate(specials)}, **{chr(i): i for i in range(3, 128)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "chat_template": template,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    return str(path)


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
