"""A server's models. Each loaded one runs its engine under its own supervisor, in the fleet's
task group. A request names a model: it is loaded on demand, kept while in use and for its
keep_alive after, and the least recently used idle one is unloaded when the cap is reached."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

from loomllm.engine.engine import Engine
from loomllm.errors import LoomError
from loomllm.protocols.lora import LoRARequest
from loomllm.server.fleet.catalog import ModelEntry, check_names
from loomllm.server.fleet.supervisor import EngineSlot, drain, supervise
from loomllm.server.openai.api_error import ApiError

logger = logging.getLogger(__name__)

FOREVER = -1.0  # a keep_alive: loaded until evicted or the server stops
# How often idle models are looked at: a streamed answer ends without telling the fleet.
POLL_S = 0.25


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The model a request runs on: the name it answers under, its engine, and the LoRA
    adapter that name selects (None: the base model)."""

    name: str
    engine: Engine
    lora: LoRARequest | None = None


class LoadedEntry:
    """A model in the fleet: its engine's slot (empty while it restarts), its users, its
    keep_alive, and the scope that unloads it."""

    def __init__(self, entry: ModelEntry, keep_alive: float, slot: EngineSlot | None = None):
        self.entry = entry
        self.slot = slot or EngineSlot()
        self.keep_alive = keep_alive
        self.last_used = time.monotonic()
        self.leases = 0  # requests between choosing this model and handing it their work
        self.unloading = False
        # A model the fleet was given running (build_app over an Engine): never unloaded.
        self.static = slot is not None
        self.scope = anyio.CancelScope()
        self.done = anyio.Event()

    @property
    def name(self) -> str:
        return self.entry.name

    def is_idle(self) -> bool:
        """Running, with no request in it or about to enter it: safe to unload."""
        engine = self.slot.engine
        if self.leases or engine is None or self.unloading:
            return False
        try:
            stats = engine.stats()
        except LoomError:
            return False
        return stats.num_running + stats.num_waiting == 0

    def expires_at(self) -> float | None:
        """When (time.time()) an idle keep_alive would unload it; None: not by time."""
        if self.keep_alive < 0:
            return None
        return time.time() + self.keep_alive - (time.monotonic() - self.last_used)


@dataclass(slots=True)
class _Load:
    """A load in progress, which other requests for the same model wait on."""

    done: anyio.Event
    error: ApiError | None = None


class ModelFleet:
    """The models a server serves, loaded as requests name them.

    `models`: those named at the server's start; the first is the default, for requests that
    name none. `run()` loads them (up to `max_loaded`) and then unloads idle ones whose
    keep_alive ran out: FOREVER for the start models, `keep_alive` seconds for those loaded
    on demand. `cached()`, if given, lists hub models also loadable on demand (the HF cache),
    with `cached_options`. A model whose worker dies is restarted by its supervisor and
    fails only its own requests meanwhile. With a single model, that model gone for good
    sets `failed` (the server then exits 1, for a process supervisor to restart it); with
    several, it is unloaded and its next request loads it again.
    """

    def __init__(
        self,
        models: Sequence[ModelEntry],
        *,
        max_loaded: int | None = None,
        keep_alive: float = 300.0,
        cached: Callable[[], Awaitable[list[str]]] | None = None,
        cached_options: dict[str, Any] | None = None,
        restart_on_failure: bool = True,
        max_restarts: int = 5,
    ) -> None:
        if not models:
            raise ValueError("a server needs at least one model")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded_models must be at least 1, got {max_loaded}")
        check_names(list(models))
        self.models = {entry.name: entry for entry in models}
        self.default = models[0].name
        self.max_loaded = max_loaded
        self.keep_alive = keep_alive
        self._cached = cached
        self._cached_options = cached_options or {}
        self._restart_on_failure = restart_on_failure
        self._max_restarts = max_restarts
        self._loaded: dict[str, LoadedEntry] = {}
        self._loading: dict[str, _Load] = {}
        self._tg: TaskGroup | None = None
        self._wake = anyio.Event()
        self.draining = False
        self.failure: str | None = None  # why the server should stop
        self.failed = anyio.Event()
        # LoRA adapters by the name clients send: (their model's name, the request).
        self.adapters: dict[str, tuple[str, LoRARequest]] = {}
        self._lora_ids = itertools.count(1)
        for entry in models:
            for lora_name, path in entry.loras.items():
                self.add_adapter(lora_name, path, entry.name)

    @classmethod
    def of(cls, source: Engine | EngineSlot, name: str) -> ModelFleet:
        """A fleet of one running engine (or a slot a supervisor fills), served as `name`."""
        slot = source if isinstance(source, EngineSlot) else EngineSlot(source)
        entry = ModelEntry(name, slot.require().config.model)
        fleet = cls([entry])
        fleet._loaded[name] = LoadedEntry(entry, FOREVER, slot)
        return fleet

    # -- running ------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Load the start models, report started, then unload expired ones until cancelled.

        A start model that fails to load fails the start. Cancellation closes every engine;
        their workers stay warm for the engines' own keep_alive.
        """
        async with anyio.create_task_group() as tg:
            self._tg = tg
            start = [entry for entry in self.models.values() if entry.at_start]
            for entry in start[: self.max_loaded]:
                await self._load(entry, at_start=True)
            task_status.started()
            await self._unload_expired()

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests; running ones get `grace_s` to finish, then are aborted."""
        self.draining = True
        async with anyio.create_task_group() as tg:
            for loaded in list(self._loaded.values()):
                tg.start_soon(drain, loaded.slot, grace_s)

    # -- requests -----------------------------------------------------------------------

    @asynccontextmanager
    async def use(self, name: str | None) -> AsyncIterator[ServedModel]:
        """The model `name` (None: the default), loaded if it is not, kept loaded inside.

        ApiError: 404 for a model this server cannot serve, 503 while it restarts or the
        server drains, 500 when it fails to load.
        """
        entry, lora = await self.resolve(name)
        while True:
            if self.draining:
                raise ApiError(503, "the server is shutting down", None, "service_unavailable")
            loaded = self._loaded.get(entry.name)
            if loaded is not None and loaded.unloading:
                await loaded.done.wait()
                continue
            if loaded is not None:
                engine = loaded.slot.require()
                break
            pending = self._loading.get(entry.name)
            if pending is None:
                # Shielded: a load others may wait for goes on if this client leaves.
                with anyio.CancelScope(shield=True):
                    await self._load(entry)
                continue
            await pending.done.wait()
            if pending.error is not None:
                raise pending.error
        loaded.leases += 1
        try:
            yield ServedModel(lora.lora_name if lora else entry.name, engine, lora)
        finally:
            loaded.leases -= 1
            loaded.last_used = time.monotonic()
            self._wake.set()

    async def resolve(self, name: str | None) -> tuple[ModelEntry, LoRARequest | None]:
        """The model a request names (one of ours, or a hub model in the cache) and the
        LoRA adapter the name selects; else 404."""
        if name is None:
            return self.models[self.default], None
        key = name.removesuffix(":latest")  # Ollama's default tag
        if key in self.adapters:
            base, lora = self.adapters[key]
            return self.models[base], lora
        entry = self.models.get(key)
        if entry is None and self._cached is not None and key.count("/") == 1:
            if key in await self._cached():
                entry = ModelEntry(key, key, dict(self._cached_options), at_start=False)
                self.models.setdefault(key, entry)
        if entry is None:
            names = ", ".join(repr(n) for n in [*self.models, *self.adapters])
            raise ApiError(
                404,
                f"the model {name!r} does not exist; this server has {names}",
                "model",
                "NotFoundError",
                "model_not_found",
            )
        return entry, None

    def add_adapter(self, name: str, path: str, model: str | None = None) -> LoRARequest:
        """Serve the PEFT adapter at `path` as `name`, on `model` (None: the default one);
        ValueError where the name is taken, the folder holds no adapter, or the model runs
        without enable_lora. Its workers load it on its first request."""
        base = self.models.get(model or self.default)
        if base is None:
            raise ValueError(f"no model {model!r} to add LoRA adapter {name!r} to")
        if not base.options.get("enable_lora"):
            raise ValueError(f"model {base.name!r} runs without --enable-lora")
        if not name or name in self.models or name in self.adapters:
            raise ValueError(f"the name {name!r} is taken: a LoRA adapter needs its own")
        if not (Path(path) / "adapter_config.json").is_file():
            raise ValueError(f"{path} holds no PEFT adapter (adapter_config.json)")
        lora = LoRARequest(name, next(self._lora_ids), str(Path(path).resolve()))
        self.adapters[name] = (base.name, lora)
        return lora

    def remove_adapter(self, name: str) -> None:
        """Stop serving adapter `name`; KeyError if there is none (running requests finish)."""
        del self.adapters[name]

    def set_keep_alive(self, name: str, seconds: float) -> None:
        """Ollama's per-request keep_alive: `name` stays loaded `seconds` after its last use
        (negative: until evicted; 0: unloaded once idle)."""
        name = self.adapters[name][0] if name in self.adapters else name  # its model's
        loaded = self._loaded.get(name)
        if loaded is not None and not loaded.static:
            loaded.keep_alive = FOREVER if seconds < 0 else float(seconds)
            self._wake.set()

    # -- what is loaded -----------------------------------------------------------------

    def loaded(self) -> list[LoadedEntry]:
        """The loaded models (those restarting included), most recently used first."""
        return sorted(self._loaded.values(), key=lambda m: m.last_used, reverse=True)

    def running(self) -> list[ServedModel]:
        """The models whose engine runs now, in the order they were named."""
        order = list(self.models)
        found = [
            ServedModel(m.name, m.slot.engine)
            for m in self._loaded.values()
            if m.slot.engine is not None and not m.unloading
        ]
        return sorted(found, key=lambda served: order.index(served.name))

    async def available(self) -> list[ModelEntry]:
        """Every model a request may name: ours, then the cached hub models not among them."""
        found = list(self.models.values())
        if self._cached is not None:
            try:
                cached = await self._cached()
            except LoomError as exc:
                logger.warning("cannot list the cached hub models: %s", exc)
                cached = []
            found += [
                ModelEntry(key, key, dict(self._cached_options), at_start=False)
                for key in cached
                if key not in self.models
            ]
        return found

    # -- loading and unloading ----------------------------------------------------------

    async def _load(self, entry: ModelEntry, at_start: bool = False) -> None:
        """Load `entry`, unloading others first where the cap says so. Its failure is an
        ApiError(500) naming it, or at the server's start the engine's own error."""
        assert self._tg is not None, "the fleet is not running"
        pending = self._loading[entry.name] = _Load(anyio.Event())
        try:
            await self._make_room(entry.name)
            keep_alive = FOREVER if entry.at_start else self.keep_alive
            loaded = LoadedEntry(entry, keep_alive)
            try:
                await self._tg.start(self._run_model, loaded)
            except Exception as exc:
                pending.error = ApiError(
                    500, f"the model {entry.name!r} could not be loaded: {exc}", "model"
                )
                if at_start:
                    raise
                raise pending.error from exc
            self._loaded[entry.name] = loaded
            logger.info("model %s loaded (%s)", entry.name, entry.model)
        finally:
            del self._loading[entry.name]
            pending.done.set()

    async def _run_model(
        self, loaded: LoadedEntry, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        entry = loaded.entry

        def open_engine() -> Engine:
            engine = Engine(entry.model, **entry.options)
            if loaded.unloading:  # a restart racing an unload: its workers go too
                engine.set_keep_alive(0)
            return engine

        try:
            with loaded.scope:
                await supervise(
                    open_engine,
                    loaded.slot,
                    restart_on_failure=self._restart_on_failure,
                    max_restarts=self._max_restarts,
                    task_status=task_status,
                )
            if loaded.slot.failure is not None:
                logger.error("model %s unloaded: %s", entry.name, loaded.slot.failure)
                if len(self.models) == 1:
                    self.failure = loaded.slot.failure
                    self.failed.set()
        finally:
            if self._loaded.get(entry.name) is loaded:
                del self._loaded[entry.name]
            loaded.done.set()

    async def _unload(self, loaded: LoadedEntry, why: str) -> None:
        """Close the model's engine and stop its workers, freeing their memory."""
        if not loaded.unloading:
            loaded.unloading = True
            logger.info("unloading model %s: %s", loaded.name, why)
            if loaded.slot.engine is not None:
                loaded.slot.engine.set_keep_alive(0)
            loaded.scope.cancel()
        await loaded.done.wait()

    async def _make_room(self, name: str) -> None:
        """Unload the least recently used idle models until one more fits under the cap;
        while every loaded one is busy, wait."""
        if self.max_loaded is None:
            return
        while len(self._loaded) + len(self._loading) - 1 >= self.max_loaded:
            idle = [m for m in self._loaded.values() if not m.static and m.is_idle()]
            if not idle:
                await anyio.sleep(POLL_S)
                continue
            victim = min(idle, key=lambda m: m.last_used)
            why = f"least recently used, to load {name} (max_loaded_models={self.max_loaded})"
            await self._unload(victim, why)

    async def _unload_expired(self) -> None:
        assert self._tg is not None
        while True:
            now = time.monotonic()
            for loaded in list(self._loaded.values()):
                if loaded.static or loaded.unloading or loaded.keep_alive < 0:
                    continue
                if not loaded.is_idle():
                    loaded.last_used = now  # in use: its keep_alive counts from its end
                elif now - loaded.last_used >= loaded.keep_alive:
                    why = f"idle for keep_alive={loaded.keep_alive:g}s"
                    self._tg.start_soon(self._unload, loaded, why)
            with anyio.move_on_after(POLL_S):
                await self._wake.wait()
            self._wake = anyio.Event()
