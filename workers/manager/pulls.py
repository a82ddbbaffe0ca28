"""The manager's Hugging Face Hub work: downloads, one per model and revision at a time, their
progress sent to every client that asked; and the list of what the HF cache holds."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskGroup

from loomllm.protocols.connection import MessageStream
from loomllm.protocols.messages import (
    CachedModel,
    CachedModelList,
    ErrorReply,
    Pulled,
    PullModel,
    PullProgress,
)
from loomllm.workers.models import hub
from loomllm.workers.models.sources import ModelLoadError

logger = logging.getLogger(__name__)
REPORT_EVERY_S = 0.2


@dataclass
class _Pull:
    progress: hub.Progress = field(default_factory=hub.Progress)
    done: anyio.Event = field(default_factory=anyio.Event)
    result: Pulled | ErrorReply | None = None


class Pulls:
    """Downloads in flight, by (model, revision): a second asker follows the first's."""

    def __init__(self) -> None:
        self.running: dict[tuple[str, str | None], _Pull] = {}

    async def cached_models(self) -> CachedModelList:
        """The hub models in the HF cache (a scan of its folders, in a thread)."""
        found = await anyio.to_thread.run_sync(hub.cached_models)
        return CachedModelList([CachedModel(**entry) for entry in found])

    async def wait_until_none(self) -> None:
        """Return once no download is in flight."""
        while self.running:
            await next(iter(self.running.values())).done.wait()

    async def serve(self, ms: MessageStream, request: PullModel, tg: TaskGroup) -> object:
        """Report the download's progress to `ms` until it ends; its final reply. The
        download runs in `tg`, so a client that leaves does not stop it for the others."""
        key = (request.model, request.revision)
        pull = self.running.get(key)
        if pull is None:
            pull = self.running[key] = _Pull()
            tg.start_soon(self._download, key, pull, request.token, request.check_hub)
        sent = (-1, -1)
        while not pull.done.is_set():
            with anyio.move_on_after(REPORT_EVERY_S):
                await pull.done.wait()
            now = pull.progress.read()
            if now != sent and not pull.done.is_set():
                await ms.send(PullProgress(*now))
                sent = now
        assert pull.result is not None
        now = pull.progress.read()
        if isinstance(pull.result, Pulled) and now[1] > 0 and now != sent:
            # The last report is the whole: a download quicker than REPORT_EVERY_S, or one
            # whose sizes came late, still ends a client's progress bar at 100%.
            await ms.send(PullProgress(*now))
        return pull.result

    async def _download(
        self, key: tuple[str, str | None], pull: _Pull, token: str | None, check_hub: bool
    ) -> None:
        model, revision = key
        logger.info("downloading %s%s from the Hub", model, f" ({revision})" if revision else "")
        try:
            path = await anyio.to_thread.run_sync(
                hub.download,
                model,
                revision,
                token,
                pull.progress,
                check_hub,
                abandon_on_cancel=True,
            )
            pull.result = Pulled(path, pull.progress.read()[0])
            logger.info("downloaded %s into %s", model, path)
        except ModelLoadError as exc:
            pull.result = ErrorReply("pull_failed", str(exc))
        except Exception as exc:  # a network or disk error: this download fails, not the daemon
            logger.exception("downloading %s failed", model)
            pull.result = ErrorReply("pull_failed", f"{type(exc).__name__}: {exc}")
        finally:
            if pull.result is None:  # cancelled: the manager is stopping
                pull.result = ErrorReply("pull_failed", "the engine-manager stopped")
            del self.running[key]
            pull.done.set()
