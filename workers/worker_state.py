"""What a worker process holds: its rank, the loaded model, and the attached engine's state.

`Worker` is the object that `Engine.collective_rpc(fn)` hands to `fn` on every rank.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from protocols.messages import ModelInfo

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Worker:
    rank: int
    world_size: int
    device: str
    loaded: Any  # workers.model_loader.LoadedModel
    model_info: ModelInfo
    loaded_at: float  # time.time() when the weights finished loading
    # Per-engine state (requests, their KV blocks, user RPC scratch): dropped whenever
    # the attached engine goes away, so the next engine starts clean.
    session: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(
        cls, model: str, options: dict[str, Any], rank: int, world_size: int, dist_init_file: str
    ) -> Worker:
        import torch

        from workers.model_loader import load_model

        device = options.get("device", "auto")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        started = time.monotonic()
        loaded = load_model(model, dtype=options.get("dtype", "auto"), device=device)
        if world_size > 1:
            torch.distributed.init_process_group(
                backend="nccl" if device == "cuda" else "gloo",
                init_method=f"file://{dist_init_file}",
                rank=rank,
                world_size=world_size,
            )
        info = ModelInfo(
            model=model,
            model_dir=str(loaded.model_dir),
            vocab_size=loaded.vocab_size,
            max_model_len=loaded.max_model_len,
            num_layers=loaded.num_layers,
            num_kv_heads=loaded.num_kv_heads,
            head_dim=loaded.head_dim,
            dtype=loaded.dtype,
            device=loaded.device,
            load_seconds=time.monotonic() - started,
        )
        logger.info("loaded %s on %s in %.1fs", model, device, info.load_seconds)
        return cls(rank, world_size, device, loaded, info, time.time())

    def reset_session(self) -> None:
        self.session.clear()

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
