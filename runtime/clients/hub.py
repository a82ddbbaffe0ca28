"""Hub models for an engine: which names are hub ids, and their download by the engine-manager
(where the workers will load them) shown as a progress bar in this process."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from tqdm.auto import tqdm

from loomllm.clients.manager import ManagerClient
from loomllm.protocols.messages import Pulled, PullProgress

logger = logging.getLogger(__name__)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
TRUE = {"1", "true", "yes", "on"}


def is_hub_id(model: str) -> bool:
    """`org/name`, and no file or folder of that name here (a local path wins)."""
    return HUB_ID.match(model) is not None and not Path(model).expanduser().exists()


def offline() -> bool:
    """HF_HUB_OFFLINE set: engines use the HF cache as it is, and download nothing."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in TRUE


async def pull(
    manager: ManagerClient,
    model: str,
    revision: str | None,
    show_progress: bool = True,
    check_hub: bool = False,
) -> Pulled:
    """Have the manager download `model` at `revision` unless its cache has it, with a tqdm bar
    of the bytes here and log lines at the start and the end (what `loom serve` shows).
    `check_hub`: see PullModel."""
    token = os.environ.get("HF_TOKEN") or None
    bar: tqdm | None = None

    def progress(report: PullProgress) -> None:
        nonlocal bar
        if bar is None:
            logger.info("downloading %s from the Hub (in the engine-manager)", model)
            bar = tqdm(
                desc=f"Downloading {model}",
                unit="B",
                unit_scale=True,
                disable=not show_progress,
            )
        bar.total = report.total_bytes
        bar.update(report.done_bytes - bar.n)

    try:
        pulled = await manager.pull(model, revision, token, progress, check_hub)
    finally:
        if bar is not None:
            bar.close()
    if pulled.downloaded_bytes:
        logger.info("downloaded %s (%d bytes) into %s", model, pulled.downloaded_bytes, pulled.path)
    return pulled
