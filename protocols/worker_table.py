"""The manager's lists as text tables: `engine-manager ps`, `models` and `loom models` print these.

It sits beside the messages because both sides print them and neither may import the other.
"""

from __future__ import annotations

from collections.abc import Sequence

from loomllm.protocols.messages import CachedModel, WorkerInfo

PS_COLUMNS = ("GROUP", "RANK", "PID", "MODEL", "STATE", "MEMORY", "AGE", "KEEP_ALIVE", "EXPIRES")
MODELS_COLUMNS = ("MODEL", "DTYPE", "TP", "PIDS", "STATE", "MEMORY", "KEEP_ALIVE", "EXPIRES")
CACHED_COLUMNS = ("MODEL", "SIZE", "REVISIONS", "PATH")


def format_seconds(value: float) -> str:
    """A keep-alive or timeout: "forever" for a negative one, else e.g. "300s"."""
    return "forever" if value < 0 else f"{value:g}s"


def ps_table(workers: Sequence[WorkerInfo]) -> str:
    """One row per worker process, in the manager's order."""
    rows = [
        (
            w.group_id,
            str(w.rank),
            str(w.pid),
            w.model,
            w.state,
            _mib(w.rss_bytes),
            f"{w.age_s:.0f}s",
            format_seconds(w.keep_alive),
            _expires(w.expires_in_s),
        )
        for w in workers
    ]
    return _table(PS_COLUMNS, rows)


def models_table(workers: Sequence[WorkerInfo]) -> str:
    """One row per worker group: the model, how it is loaded, its pids in rank order.

    STATE is the manager's word: "busy" (attached to an engine), "idle" (warm, free to
    attach) or "loading"; EXPIRES is the keep-alive left to an idle group.
    """
    groups: dict[str, list[WorkerInfo]] = {}
    for w in workers:
        groups.setdefault(w.group_id, []).append(w)
    rows = []
    for ranks in groups.values():
        ranks.sort(key=lambda w: w.rank)
        w = ranks[0]
        rows.append(
            (
                w.model,
                w.dtype,
                str(w.world_size),
                ",".join(str(r.pid) for r in ranks),
                w.state,
                _mib(sum(r.rss_bytes for r in ranks)),
                format_seconds(w.keep_alive),
                _expires(w.expires_in_s),
            )
        )
    return _table(MODELS_COLUMNS, rows)


def cached_models_table(models: Sequence[CachedModel]) -> str:
    """One row per hub model in the HF cache: its size, cached commits (short) and folder."""
    rows = [
        (m.model, _mib(m.size_bytes), ",".join(r[:8] for r in m.revisions), m.path) for m in models
    ]
    return _table(CACHED_COLUMNS, rows)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.0f} MiB"


def _expires(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.0f}s"


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    """Left-aligned columns two spaces apart, no trailing blanks."""
    everything = [header, *rows]
    widths = [max(len(r[i]) for r in everything) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in everything
    )
