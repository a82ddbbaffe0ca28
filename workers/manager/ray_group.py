"""Worker ranks as Ray actors, for `distributed_executor_backend="ray"`: ranks on many machines.

The manager is the Ray driver (the user's process never imports ray); engines attach over TCP.
"""

from __future__ import annotations

import importlib
import logging
import secrets
from functools import partial
from typing import Any

import anyio

from loomllm.protocols.connection import MessageStream
from loomllm.protocols.messages import Attach
from loomllm.workers.manager.ray_handles import RankHandle, RayPlacement
from loomllm.workers.manager.worker_group import (
    GroupStartError,
    WorkerGroup,
    WorkerProcess,
    wait_group_ready,
)
from loomllm.workers.worker.ray_rank import RankActor

logger = logging.getLogger(__name__)

# A placement group waits for room in the cluster; none after this is a clear error.
PLACEMENT_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 60.0  # ray.init, and each actor's bind()
PROBE_TIMEOUT_S = 5.0  # a TCP connect to the cluster's address before ray.init


class RayDriver:
    """The manager's one connection to a Ray cluster, made when a Ray group is first asked."""

    def __init__(self) -> None:
        self._address: str | None = None
        self._lock = anyio.Lock()

    async def connect(self, address: str, node_ip_address: str | None = None) -> Any:
        """The `ray` module, connected to the cluster at `address` ("auto": the local
        node's) as a driver on the node at `node_ip_address` (None: Ray's guess);
        GroupStartError saying why when Ray is missing or no cluster answers."""
        async with self._lock:
            try:  # off the event loop: importing ray takes a second
                ray = await anyio.to_thread.run_sync(importlib.import_module, "ray")
            except ImportError as exc:
                raise GroupStartError(
                    "distributed_executor_backend='ray' needs Ray where the engine-manager "
                    f"runs, and loomllm on every node: pip install 'loomllm[ray]' ({exc})"
                ) from None
            if self._address is None:
                await _check_reachable(address)
                # ignore_reinit_error: an earlier init that outlived its timeout may have
                # connected meanwhile; then this one finds it done.
                init = partial(
                    ray.init,
                    address=address,
                    namespace="loomllm",
                    _node_ip_address=node_ip_address,
                    log_to_driver=False,
                    logging_level=logging.WARNING,
                    ignore_reinit_error=True,
                )
                try:
                    with anyio.fail_after(CONNECT_TIMEOUT_S):
                        await anyio.to_thread.run_sync(init, abandon_on_cancel=True)
                except Exception as exc:  # ConnectionError, TimeoutError, ...
                    raise GroupStartError(
                        f"no Ray cluster answers at address={address!r} ({type(exc).__name__}: "
                        f"{exc}); start one with `ray start --head`, or set RAY_ADDRESS"
                    ) from None
                self._address = address
                logger.info("connected to the Ray cluster at %s", address)
            elif address != self._address:
                raise GroupStartError(
                    f"this engine-manager is the driver of the Ray cluster at "
                    f"{self._address!r}; it cannot also use {address!r}"
                )
        return ray


async def _check_reachable(address: str) -> None:
    """Fail fast where nothing listens at host:port: ray.init would wait for minutes."""
    host, _, port = address.rpartition(":")
    if "://" in address or not port.isdigit():
        return  # "auto" (fails at once by itself), or a ray:// client address
    try:
        with anyio.fail_after(PROBE_TIMEOUT_S):
            stream = await anyio.connect_tcp(host, int(port))
    except (OSError, TimeoutError) as exc:
        raise GroupStartError(
            f"no Ray cluster answers at address={address!r} ({exc or 'timed out'}); start "
            "one with `ray start --head`, or set RAY_ADDRESS"
        ) from None
    await stream.aclose()


async def launch_ray_group(group: WorkerGroup, driver: RayDriver) -> None:
    """Place and start every rank of `group` in the cluster; return once all are READY.

    Each rank is a RankActor (worker/ray_rank.py) in a bundle of its own. Its lifeline is a
    TCP connection that the manager opens with a secret given to that actor alone; the ranks
    rendezvous for torch.distributed at rank 0's node.

    Anything that fails on the way is a GroupStartError naming the cause; the manager
    then stops the group, which removes its placement group and with it every actor.
    """
    options = group.spec.options
    ray = await driver.connect(options.ray_address or "auto", options.ray_node_ip_address)
    try:
        with anyio.fail_after(PLACEMENT_TIMEOUT_S + CONNECT_TIMEOUT_S):
            placed = await anyio.to_thread.run_sync(
                partial(_place_ranks, ray, group), abandon_on_cancel=True
            )
            for rank, (actor, serve_ref, bind, secret) in enumerate(placed):
                host, lifeline_port, _, pid = bind
                control = MessageStream(await anyio.connect_tcp(host, lifeline_port))
                handle = RankHandle(ray, actor, pid, serve_ref)
                group.ranks.append(WorkerProcess(rank, handle, control, None, None))
                await control.send(Attach(secret))
    except GroupStartError:
        raise
    except Exception as exc:  # Ray's errors, a lifeline that does not connect (TimeoutError)
        raise GroupStartError(
            f"the Ray ranks of {group.spec.model!r} did not start: {type(exc).__name__}: {exc} "
            "(is loomllm installed on every node?)"
        ) from None
    logger.info(
        "group %s: %d Ray rank(s) on %s",
        group.group_id,
        group.spec.world_size,
        sorted({host for _, _, (host, *_), _ in placed}),
    )
    await wait_group_ready(group)


def _place_ranks(ray: Any, group: WorkerGroup) -> list[tuple[Any, Any, tuple, bytes]]:
    """In a thread (Ray's calls block): reserve one bundle per rank, start a RankActor in
    each, bind its ports and start its serve() call; per rank (actor, serve ref, bind
    reply, lifeline secret)."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    world_size = group.spec.world_size
    on_gpu = group.spec.options.device != "cpu" and ray.cluster_resources().get("GPU", 0) > 0
    bundle = {"GPU": 1} if on_gpu else {"CPU": 1}
    # PACK: ranks share a node where they fit (fast collectives), spill over where not.
    pg = placement_group([bundle] * world_size, strategy="PACK")
    group.placement = RayPlacement(ray, pg)
    try:
        ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise GroupStartError(
            f"the Ray cluster has no room for {world_size} bundle(s) of {bundle} within "
            f"{PLACEMENT_TIMEOUT_S:g} s (available: {ray.available_resources()})"
        ) from None
    actor_class = ray.remote(RankActor)
    actors = [
        actor_class.options(
            num_cpus=0 if on_gpu else 1,
            num_gpus=1 if on_gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=rank
            ),
        ).remote()
        for rank in range(world_size)
    ]
    binds = ray.get(
        [a.bind.remote(rank == 0) for rank, a in enumerate(actors)], timeout=CONNECT_TIMEOUT_S
    )
    rank0_host, _, dist_port, _ = binds[0]
    dist_init = f"tcp://{rank0_host}:{dist_port}"
    placed = []
    for rank, (actor, bind) in enumerate(zip(actors, binds, strict=True)):
        secret = secrets.token_bytes(32)  # this rank's alone: its lifeline's key
        serve_ref = actor.serve.remote(
            group.spec.model, group.spec.options.to_json(), rank, world_size, dist_init, secret
        )
        placed.append((actor, serve_ref, tuple(bind), secret))
    return placed
