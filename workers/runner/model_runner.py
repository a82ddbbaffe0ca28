"""ModelRunner: the worker's persistent batch, input packing, forward pass, KV cache and sampling.

Each step: apply the SchedulerOutput diff, pack all tokens into one [1, T] batch, run, sample.
"""

from __future__ import annotations

import enum
import logging
from typing import Any, TypedDict, TypeVar, cast

import torch

from loomllm.protocols.choices import ATTENTION_BACKENDS
from loomllm.protocols.lora import LoRARequest
from loomllm.protocols.messages import (
    NewRequestData,
    PooledOutput,
    Pooling,
    PromptLogprobs,
    RequestError,
    SchedulerOutput,
    StepResult,
    TopLogprobs,
)
from loomllm.protocols.sampling import SamplingParams
from loomllm.workers.attention import paged as attention
from loomllm.workers.attention.bidirectional import route_encoder
from loomllm.workers.attention.geometry import kv_geometry
from loomllm.workers.attention.metadata import AttentionMetadata, context_metadata, paged_metadata
from loomllm.workers.device.idle_probe import DeviceIdleProbe, DeviceTime
from loomllm.workers.device.transfer import device_tensor
from loomllm.workers.runner.cuda_graphs import DecodeGraphs
from loomllm.workers.runner.lora import LoRALoadError, LoRAManager
from loomllm.workers.runner.mixed_graphs import MAX_MIXED_TOKENS, MixedGraphs
from loomllm.workers.runner.packed_step import PackedStep, pack_step
from loomllm.workers.runner.pending_step import PendingStep
from loomllm.workers.runner.pooler import hidden_states, pool
from loomllm.workers.runner.request_state import CachedRequestState
from loomllm.workers.sample.prompt_logprobs import score_prompt_chunks
from loomllm.workers.sample.sampler import SamplerOutput, SamplingMetadata, sample
from loomllm.workers.sample.structured_output import GrammarCompiler, fill_bitmasks
from loomllm.workers.sample.token_filters import TokenFilters, bad_word_bans

logger = logging.getLogger(__name__)
G = TypeVar("G", DecodeGraphs, MixedGraphs)


class _GraphArgs(TypedDict):
    """What decode and mixed-step graphs are both built with (ModelRunner.enable_graphs)."""

    device: torch.device
    block_size: int
    scratch_block: int
    max_num_seqs: int
    max_blocks: int


class Forward(enum.Enum):
    """How a step's forward runs (ModelRunner._route)."""

    EAGER = "eager"
    DECODE_GRAPH = "decode graph"  # decodes alone, replayed at a bucketed batch size
    MIXED_GRAPH = "mixed graph"  # prompt chunks beside decodes, at a bucketed token count


# What a step runs with: worker/state.py resolves "auto" to one of these before.
RESOLVED_BACKENDS = tuple(b for b in ATTENTION_BACKENDS if b != "auto")


class ModelRunner:
    """Runs steps for one worker rank; owns the model and the KV cache."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: object,
        *,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        num_blocks: int,
        attention_backend: str = "torch",
        tp_size: int = 1,
        pooling: Pooling | None = None,
        lora: LoRAManager | None = None,
    ) -> None:
        if attention_backend not in RESOLVED_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(RESOLVED_BACKENDS)}, "
                f"got {attention_backend!r}"
            )
        if attention_backend == "triton" and (block_size < 16 or block_size & (block_size - 1)):
            raise ValueError(
                f"block_size must be a power of two >= 16 for the Triton "
                f"attention backend, got {block_size}"
            )
        # An encoder's attention is bidirectional, within a step's own tokens: no cache.
        self.encoder = pooling is not None and not pooling.causal
        if self.encoder:
            route_encoder(model)
        else:
            attention.route_transformers_model(model)
        self.attention_backend = attention_backend
        # Set: every request is a prompt to embed, its hidden states pooled where the prompt
        # ends and a placeholder token sampled, which ends it.
        self.pooling = pooling
        self.lora = lora  # the adapters, where the worker runs with enable_lora
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        # A transformers config: its fields are set from the checkpoint's JSON, untyped.
        text_config: Any = getattr(config, "text_config", None) or config
        self.vocab_size: int = text_config.vocab_size
        num_layers, num_kv_heads, head_dim = kv_geometry(config, tp_size)
        # Slot-major, one row a token. The Triton backend's cache has one block more than
        # the scheduler's, scratch for the padded rows of decode graphs (cuda_graphs.py).
        scratch = 1 if attention_backend == "triton" else 0
        slots = 0 if self.encoder else (num_blocks + scratch) * block_size
        shape = (slots, num_kv_heads, head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(num_layers)
        ]
        self.requests: dict[str, CachedRequestState] = {}
        self._last: PendingStep | None = None  # the step launched last
        # CUDA's launch returns before the device is done, so the next step can be
        # launched before this one's tokens are read (workers/worker/main.py DataServer). On
        # the CPU a launch computes the whole step: nothing to overlap in the worker.
        self.overlap_launches = device.type == "cuda"
        self.idle_probe: DeviceIdleProbe | None = None  # set by start_idle_probe()
        self.decode_graphs: DecodeGraphs | None = None  # set by enable_graphs()
        self.mixed_graphs: MixedGraphs | None = None  # set by enable_graphs()
        self.grammars: GrammarCompiler | None = None  # for structured_outputs (worker/state.py)
        # Requests this launch could not take (RequestError), reported with its result.
        self._request_errors: list[RequestError] = []

    @staticmethod
    def bytes_per_block(
        config: object, block_size: int, dtype: torch.dtype, tp_size: int = 1
    ) -> int:
        """The KV cache's bytes for one block: K and V of every layer."""
        num_layers, num_kv_heads, head_dim = kv_geometry(config, tp_size)
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element

    def enable_graphs(
        self,
        max_num_seqs: int,
        max_model_len: int,
        capture: bool,
        max_step_tokens: int = MAX_MIXED_TOKENS,
    ) -> None:
        """Run decode-only steps padded to bucketed batch sizes and mixed steps (of up to
        `max_step_tokens`) padded to token buckets, replaying CUDA graphs when `capture`
        (else eagerly over the same padded buffers: the CPU tests). Triton backend only:
        the torch backend's metadata has no fixed shape."""
        if self.attention_backend != "triton":
            raise ValueError("CUDA graphs need the Triton attention backend")
        shared = _GraphArgs(
            device=self.device,
            block_size=self.block_size,
            scratch_block=self.num_blocks,
            max_num_seqs=max_num_seqs,
            max_blocks=min(self.num_blocks, -(-max_model_len // self.block_size)),
        )
        graphs: DecodeGraphs | None  # None: its capture failed
        mixed: MixedGraphs | None
        graphs = DecodeGraphs(self.model, self.kv_caches, **shared)
        mixed = MixedGraphs(self.model, self.kv_caches, **shared, max_tokens=max_step_tokens)
        if capture:
            # One pool, the largest graphs first: a graph's intermediates may share memory
            # with another's output, so a step's logits are used before the next replay.
            pool = torch.cuda.graph_pool_handle()
            mixed = _captured(mixed, pool, "mixed-step")
            graphs = _captured(graphs, pool, "decode")
        self.decode_graphs, self.mixed_graphs = graphs, mixed

    def start_idle_probe(self) -> None:
        """Measure the device's busy and idle time from the next step on (benchmarks)."""
        self.idle_probe = DeviceIdleProbe(self.device)

    def stop_idle_probe(self) -> DeviceTime:
        """The device's busy and idle time since `start_idle_probe`; the probe stops."""
        assert self.idle_probe is not None, "start_idle_probe() first"
        probe, self.idle_probe = self.idle_probe, None
        return probe.result()

    def reset(self) -> None:
        """Forget every request (the attached engine went away, or a step failed)."""
        self.requests.clear()
        self._last = None
        self._request_errors = []  # their requests are gone with the rest

    # -- persistent batch ----------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.new_requests:
            self.requests[new.req_id] = self._new_state(new)
        cached = so.cached
        for req_id, new_block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.requests[req_id]
            if new_block_ids:
                state.block_ids.extend(new_block_ids)
            state.num_computed_tokens = num_computed

    def _new_state(self, new: NewRequestData) -> CachedRequestState:
        params = new.sampling_params
        state = CachedRequestState(
            new.req_id,
            list(new.prompt_token_ids),
            list(new.output_token_ids),
            params,
            sorted(set(new.eos_token_ids) | set(params.stop_token_ids)),
            list(new.block_ids),
            new.num_computed_tokens,
        )
        state.token_type_ids = new.token_type_ids
        if new.lora is not None:
            self._load_lora(state, new.lora)
        state.filters = TokenFilters.of(params, self.vocab_size, self.device)
        if params.structured_outputs is not None:
            assert self.grammars is not None, (
                "the worker gives every runner its compiler (worker/state.py)"
            )
            # The grammar compiles while the step runs; if it fails, only its request fails,
            # at its first sample.
            state.grammar = self.grammars.request_grammar(
                params.structured_outputs, new.eos_token_ids
            )
        return state

    def _load_lora(self, state: CachedRequestState, lora: LoRARequest) -> None:
        """Give the request its adapter's slot; one that cannot load fails it alone (it
        runs on the base model until the engine drops it)."""
        if self.lora is None:
            why = f"LoRA {lora.lora_name!r}: this worker runs without enable_lora"
            self._request_errors.append(RequestError(state.req_id, why))
            return
        in_use = {s.lora_id for s in self.requests.values() if s.lora_id is not None}
        try:
            self.lora.slot_for(lora, in_use)
        except LoRALoadError as exc:
            self._request_errors.append(RequestError(state.req_id, str(exc)))
            return
        state.lora_id = lora.lora_int_id

    # -- one step --------------------------------------------------------------------------

    def execute(self, so: SchedulerOutput, call_id: int) -> StepResult:
        """Run one step to its end: `launch` it and read its tokens back."""
        return self.launch(so, call_id).result()

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput, call_id: int) -> PendingStep:
        """Run one step's forward and sampling; its tokens stay on the device until
        `result()`. The step launched before it must have had `result()` called or be
        the one whose tokens this step's decodes read (async scheduling: sampled by the
        worker, not yet known to the engine)."""
        previous, self._last = self._last, None
        if previous is not None and previous.is_resolved:
            previous = None
        self._update_states(so)
        pending = previous.rows if previous is not None else {}
        packed = pack_step(
            so,
            self.requests,
            pending,
            self.block_size,
            contexts=self.attention_backend != "triton",
            lora_slots=self.lora.slots if self.lora is not None else None,
            pooling=self.pooling is not None,
        )
        if not packed.input_ids:
            return self._launched(call_id, [], None, [])
        if self.lora is not None:
            self.lora.set_step(packed.lora_tokens, len(packed.input_ids), self.device)
        route = self._route(packed)
        # A mixed-step graph builds its metadata from the rows themselves.
        meta = None if route is Forward.MIXED_GRAPH else self._attention_metadata(packed)
        ids = self._input_ids(packed, previous)
        if self.idle_probe is not None:
            self.idle_probe.step_started()
        if self.pooling is not None:
            return self._pool(call_id, packed, ids, meta)
        logits = self._forward(route, packed, ids, meta)
        return self._sample_step(call_id, packed, logits, previous, pending, route)

    def _route(self, packed: PackedStep) -> Forward:
        """How the step's forward runs: a captured graph where its shape fits one."""
        mixed, graphs = self.mixed_graphs, self.decode_graphs
        if mixed is not None and packed.prefills and not packed.prompt_idx:
            widest = max(len(state.block_ids) for state in packed.rows)
            if mixed.fits(len(packed.input_ids), len(packed.rows), widest):
                return Forward.MIXED_GRAPH
        if (
            graphs is not None
            and not packed.prefills
            and not packed.prompt_idx
            and len(packed.decode_idx) <= graphs.max_batch
            and max(len(state.block_ids) for state in packed.decode_states) <= graphs.max_blocks
        ):
            return Forward.DECODE_GRAPH
        return Forward.EAGER

    def _attention_metadata(self, packed: PackedStep) -> AttentionMetadata:
        """The Triton kernels read block tables; the torch backend gathers each context."""
        if self.attention_backend != "triton":
            return context_metadata(
                self.kv_caches,
                self.device,
                packed.slots,
                packed.decode_idx,
                packed.decode_ctx,
                packed.prefills,
            )
        return paged_metadata(
            self.kv_caches,
            self.device,
            self.block_size,
            packed.slots,
            packed.decode_idx,
            [state.block_ids for state in packed.decode_states],
            [state.num_computed_tokens for state in packed.decode_states],  # advanced
            packed.prefills,
            [state.block_ids for state in packed.prefill_states],
            [state.num_computed_tokens for state in packed.prefill_states],
        )

    def _input_ids(self, packed: PackedStep, previous: PendingStep | None) -> torch.Tensor:
        """The packed ids on the device, with the previous step's samples filled in."""
        dev = self.device
        ids = device_tensor(packed.input_ids, torch.long, dev)
        if packed.fill_at:
            assert previous is not None
            ids[device_tensor(packed.fill_at, torch.long, dev)] = previous.sampled[
                device_tensor(packed.fill_from, torch.long, dev)
            ]
        return ids

    def _pool(
        self,
        call_id: int,
        packed: PackedStep,
        ids: torch.Tensor,
        meta: AttentionMetadata | None,
    ) -> PendingStep:
        """A pooling step: the rows' hidden states pooled, a placeholder token sampled."""
        assert self.pooling is not None
        dev = self.device
        types = None
        if any(row.state.token_type_ids for row in packed.pool_rows):
            segments = [0] * len(packed.input_ids)
            for row in packed.pool_rows:
                if row.state.token_type_ids:
                    at, until = row.start, row.start + row.num_tokens
                    segments[row.token_start : row.token_start + row.num_tokens] = (
                        row.state.token_type_ids[at:until]
                    )
            types = device_tensor([segments], torch.long, dev)
        positions = device_tensor([packed.positions], torch.long, dev)
        hidden = hidden_states(self.model, ids[None], positions, meta, types)
        classify = getattr(self.model, "classify", None)
        pooled = pool(hidden, packed.pool_rows, self.pooling, classify)
        placeholders = torch.zeros(len(packed.samplers), dtype=torch.long, device=dev)
        no_ids: list[list[int] | None] = [None] * len(packed.samplers)
        no_lps: list[list[float] | None] = [None] * len(packed.samplers)
        sampled = SamplerOutput(placeholders, placeholders.float(), no_ids, no_lps)
        if self.idle_probe is not None:
            self.idle_probe.step_ended(False, with_prompts=True)
        return self._launched(call_id, packed.samplers, sampled, [], pooled)

    def _forward(
        self,
        route: Forward,
        packed: PackedStep,
        ids: torch.Tensor,
        meta: AttentionMetadata | None,
    ) -> torch.Tensor:
        """Logits [samplers + scored prompt positions, V], by `route`."""
        dev = self.device
        if route is Forward.MIXED_GRAPH:
            assert self.mixed_graphs is not None
            # Every row through the prefill kernel, a decode as a one-token prompt chunk.
            rows, decodes = packed.rows, len(packed.decode_idx)
            return self.mixed_graphs.forward(
                ids,
                packed.positions,
                device_tensor(packed.slots, torch.long, dev),
                [state.block_ids for state in rows],
                packed.decode_idx + [p.token_start for p in packed.prefills],
                [1] * decodes + [p.num_tokens for p in packed.prefills],
                [state.num_computed_tokens for state in rows],
                packed.sample_idx,
            )
        assert meta is not None
        if route is Forward.DECODE_GRAPH:
            assert self.decode_graphs is not None and meta.paged is not None
            # Decode only: packed token i is decode row i, and the rows that sample are
            # those whose prompt is complete (a 1-token prompt chunk does not).
            logits = self.decode_graphs.forward(
                ids,
                device_tensor(packed.positions, torch.long, dev),
                meta.slot_mapping,
                meta.paged.decode_tables,
                meta.paged.decode_lens,
            )
            if len(packed.sample_idx) < len(packed.decode_idx):
                logits = logits[device_tensor(packed.sample_idx, torch.long, dev)]
            return logits
        return self.model(
            input_ids=ids[None],
            position_ids=device_tensor([packed.positions], torch.long, dev),
            use_cache=False,
            attn_metadata=meta,
            logits_to_keep=device_tensor(packed.sample_idx + packed.prompt_idx, torch.long, dev),
        ).logits[0]

    def _sample_step(
        self,
        call_id: int,
        packed: PackedStep,
        logits: torch.Tensor,
        previous: PendingStep | None,
        pending: dict[int, int],
        route: Forward,
    ) -> PendingStep:
        """Score the prompt positions, sample the rows that sample, and hand the step on."""
        samplers, num_samples = packed.samplers, len(packed.sample_idx)
        scored = packed.scored
        prompt_lps = score_prompt_chunks(logits[num_samples:], scored) if scored else []
        if previous is not None and any(
            id(s) in pending and _needs_output_ids(s.sampling_params) for s in samplers
        ):
            previous.result()  # penalties count the output ids: they must be on the host
            pending = {}
        spec = packed.spec if packed.speculated else None
        sampled = None
        if samplers:
            sampled = self._sample(logits[:num_samples], samplers, pending, spec)
        if self.idle_probe is not None:
            graphs: DecodeGraphs | MixedGraphs | None = None
            if route is not Forward.EAGER:
                graphs = self.decode_graphs if route is Forward.DECODE_GRAPH else self.mixed_graphs
            replayed = graphs is not None and graphs.captured
            self.idle_probe.step_ended(replayed, with_prompts=bool(packed.prefills))
        return self._launched(call_id, samplers, sampled, prompt_lps, spec=spec)

    def _launched(
        self,
        call_id: int,
        samplers: list[CachedRequestState],
        sampled: SamplerOutput | None,
        prompt_lps: list[PromptLogprobs],
        pooled: list[PooledOutput] | None = None,
        spec: list[tuple[int, list[int]]] | None = None,
    ) -> PendingStep:
        errors, self._request_errors = self._request_errors, []
        if sampled is None:
            none = torch.empty(0, dtype=torch.long)
            step = PendingStep(call_id, [], none, none.float(), [], prompt_lps, errors)
        else:
            # A row's top logprobs are None exactly where its top ids are (the sampler's).
            top = [
                None if ids is None else TopLogprobs(ids, cast("list[float]", lps))
                for ids, lps in zip(sampled.top_token_ids, sampled.top_logprobs, strict=True)
            ]
            step = PendingStep(
                call_id,
                samplers,
                sampled.sampled_token_ids,
                sampled.logprobs,
                top,
                prompt_lps,
                errors,
                sampled.stuck,
                pooled or [],
                spec,
            )
        self._last = step
        return step

    def _sample(
        self,
        logits: torch.Tensor,
        samplers: list[CachedRequestState],
        pending: dict[int, int],
        spec: list[tuple[int, list[int]]] | None = None,
    ) -> SamplerOutput:
        """`pending`: requests whose last sampled token is still on the device (it counts
        for min_tokens; penalties wait for it on the host, see `launch`). `spec`: each
        sampling request's first row and its drafts (speculative decoding); the row after
        draft j samples as if drafts 0..j were the request's own: its penalties, bans and
        seeded draw are those decoding would give that position once they are accepted."""
        outputs = [s.output_token_ids for s in samplers]
        for first, drafts in spec or ():
            for j in range(1, len(drafts) + 1):
                outputs[first + j] = outputs[first] + drafts[:j]
        # The index of the token each row samples: its output so far, on the host or not.
        indexes = [len(out) + (id(s) in pending) for s, out in zip(samplers, outputs, strict=True)]
        banned = []
        for s, out, index in zip(samplers, outputs, indexes, strict=True):
            bans = s.banned_until_min_tokens if index < s.sampling_params.min_tokens else []
            if s.sampling_params.bad_words_token_ids:  # rare: most rows skip the walk
                bans = bans + bad_word_bans(s.sampling_params.bad_words_token_ids, out)
            banned.append(bans)
        meta = SamplingMetadata.from_params(
            [s.sampling_params for s in samplers],
            indexes,
            [s.prompt_token_ids for s in samplers],
            outputs,
            banned,
            [s.filters for s in samplers],
        )
        meta.token_bitmask, meta.bitmask_rows, failed = fill_bitmasks(samplers, logits.shape[-1])
        self._request_errors += [RequestError(req_id, why) for req_id, why in failed]
        return sample(logits, meta)


def _captured(graphs: G, pool: object, kind: str) -> G | None:
    """`graphs` captured in `pool`, or None (logged) if the capture failed: a model whose
    forward cannot be captured (a host sync, a dynamic shape) serves eagerly."""
    try:
        with torch.inference_mode():
            graphs.capture(pool)
    except Exception:
        logger.exception("%s CUDA graph capture failed: those steps run eager", kind)
        return None
    return graphs


def _needs_output_ids(params: SamplingParams) -> bool:
    """Penalties count the output ids, a grammar's matcher advances by them, a bad word of
    several tokens ends them."""
    return bool(
        params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or params.structured_outputs
        or any(len(seq) > 1 for seq in params.bad_words_token_ids)
    )
