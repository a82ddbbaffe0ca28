"""Models from the Hugging Face Hub: what serving needs of a repository, downloaded into the
HF cache with huggingface_hub (resuming what an interrupted download left), and the cache
listed."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loomllm.workers.models.sources import ModelLoadError

logger = logging.getLogger(__name__)

# What serving reads: the weights, the configs, the tokenizer and its templates.
SERVING_FILES = [
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
    "additional_chat_templates/*",
]


@dataclass
class Progress:
    """Bytes of a download so far, written by its thread and read by the manager's loop."""

    done: int = 0
    total: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, done: int = 0, total: int = 0) -> None:
        with self.lock:
            self.done += done
            self.total += total

    def read(self) -> tuple[int, int]:
        with self.lock:
            return self.done, self.total


def download(
    repo_id: str, revision: str | None, token: str | None, progress: Progress, check_hub: bool
) -> str:
    """The snapshot directory of `repo_id` at `revision` with SERVING_FILES in it, fetched
    where they are not cached (blocking: run it in a thread). Without `check_hub` a complete
    cached snapshot is taken with no network call, as an engine's start wants it.
    ModelLoadError says what went wrong in words a user can act on."""
    if not check_hub and (cached := complete_snapshot(repo_id, revision)) is not None:
        return cached
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        DryRunError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        try:
            planned = snapshot_download(
                repo_id, revision=revision, token=token, allow_patterns=SERVING_FILES, dry_run=True
            )
        except DryRunError as exc:  # the Hub answered no, or is out of reach
            cause = exc.__cause__
            if isinstance(cause, HfHubHTTPError):
                raise cause from None  # not found, private or gated: said below
            if (cached := complete_snapshot(repo_id, revision)) is not None:
                return cached  # out of reach: what the cache holds will do
            raise ModelLoadError(
                f"could not reach the Hub for {where}, and it is not in the HF cache: "
                f"{cause or exc}"
            ) from None
        if not any(f.filename.endswith(".safetensors") for f in planned):
            raise ModelLoadError(
                f"hub model {where} has no safetensors weights, the only format loomllm reads "
                "from the Hub"
            )
        _finish_partial_downloads(repo_id, planned, token, progress)
        path = snapshot_download(
            repo_id,
            revision=revision,
            token=token,
            allow_patterns=SERVING_FILES,
            tqdm_class=_recording(progress),
        )
    except GatedRepoError as exc:
        raise ModelLoadError(
            f"hub model {where} is gated: accept its terms on the Hub and set HF_TOKEN ({exc})"
        ) from None
    except RepositoryNotFoundError:
        raise ModelLoadError(
            f"hub model {repo_id!r} was not found (or is private: set HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"hub model {repo_id!r} has no revision {revision!r}") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise ModelLoadError(
                f"hub model {where} was refused ({status}): it is private or gated; set "
                "HF_TOKEN to a token that may read it"
            ) from None
        raise ModelLoadError(f"could not download hub model {where}: {exc}") from None
    except LocalEntryNotFoundError as exc:
        raise ModelLoadError(f"could not download hub model {where}: {exc}") from None
    return str(path)


def _finish_partial_downloads(
    repo_id: str, planned: list[Any], token: str | None, progress: Progress
) -> None:
    """Finish, from where they stop, the files of `planned` that a killed download left
    partly written, so that snapshot_download finds them whole and links them.

    huggingface_hub writes each file to a temporary `<etag>.<random>.incomplete` beside its
    blob, under the file's lock, and starts a new one in each process. Holding that lock, no
    other process is writing one, so what is there was left by a process that died."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get, repo_folder_name
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    folder = repo_folder_name(repo_id=repo_id, repo_type="model")
    blobs = Path(constants.HF_HUB_CACHE) / folder / "blobs"
    if not any(blobs.glob("*.incomplete")):
        return
    for planned_file in planned:
        if not planned_file.will_download:
            continue
        url = hf_hub_url(repo_id, planned_file.filename, revision=planned_file.commit_hash)
        meta = get_hf_file_metadata(url, token=token)
        if meta.etag is None or not any(blobs.glob(f"{meta.etag}.*.incomplete")):
            continue
        lock = Path(constants.HF_HUB_CACHE) / ".locks" / folder / f"{meta.etag}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        with WeakFileLock(str(lock)):
            partials = sorted(
                blobs.glob(f"{meta.etag}.*.incomplete"), key=lambda p: p.stat().st_size
            )
            for dead in partials[:-1]:
                dead.unlink()
            if not partials or (blobs / meta.etag).exists():
                continue
            partial = partials[-1]
            done = partial.stat().st_size
            logger.info(
                "resuming %s of %s at byte %d of %s",
                planned_file.filename,
                repo_id,
                done,
                meta.size,
            )
            progress.add(done=done, total=meta.size or 0)
            with partial.open("r+b") as out:
                out.seek(done)
                http_get(
                    meta.location,
                    out,
                    resume_size=done,
                    headers=build_hf_headers(token=token),
                    expected_size=meta.size,
                    tqdm_class=_counting(progress),
                )
            if _matches(partial, meta.etag):
                partial.replace(blobs / meta.etag)
            else:  # not the file the Hub names: fetched again from the start
                logger.warning("resumed %s does not match its etag", planned_file.filename)
                partial.unlink()


def _matches(path: Path, etag: str) -> bool:
    """Whether the file is the one the Hub's etag names: an LFS file's sha256, or a git
    blob's sha1; True for an etag of another form, which cannot be checked."""
    if len(etag) == 64:
        digest = hashlib.sha256()
    elif len(etag) == 40:
        digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    else:
        return True
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest() == etag


def _counting(progress: Progress) -> type:
    """A tqdm class that shows nothing and adds the bytes it is told of to `progress`."""
    from tqdm.auto import tqdm

    class Counting(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "disable": True})

        def update(self, n: float | None = 1) -> bool | None:
            progress.add(done=int(n or 0))
            return None

    return Counting


def complete_snapshot(repo_id: str, revision: str | None) -> str | None:
    """The cached snapshot of `repo_id` at `revision` if it holds a config, a tokenizer and
    every safetensors shard (a download cut short holds fewer), else None. No network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError):
        return None
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
    else:
        shards = {p.name for p in path.glob("*.safetensors")}
    tokenizer = any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model"))
    complete = (path / "config.json").is_file() and tokenizer and shards
    return str(path) if complete and all((path / s).is_file() for s in shards) else None


def _recording(progress: Progress) -> type:
    """A tqdm class that shows nothing and adds snapshot_download's byte counts (bytes written
    to the cache, resumed ones included) to `progress`."""
    from tqdm.auto import tqdm

    class Recording(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "disable": True})
            desc = str(kwargs.get("desc") or "")
            self.counts = kwargs.get("unit") == "B" and desc.startswith("Reconstructing")
            self.recorded_total = 0

        def update(self, n: float | None = 1) -> bool | None:
            if self.counts:
                # snapshot_download adds each file's size to `total` as the file starts.
                total = int(self.total or 0)
                progress.add(done=int(n or 0), total=total - self.recorded_total)
                self.recorded_total = total
            return None

    return Recording


def cached_models() -> list[dict[str, Any]]:
    """The hub models in the HF cache: id, size, cached commits and folder."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir()
    except CacheNotFound:
        return []
    return [
        {
            "model": repo.repo_id,
            "size_bytes": repo.size_on_disk,
            "revisions": sorted(r.commit_hash for r in repo.revisions),
            "path": str(Path(repo.repo_path)),
        }
        for repo in sorted(info.repos, key=lambda r: r.repo_id)
        if repo.repo_type == "model"
    ]
