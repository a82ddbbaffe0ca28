"""ModelRunner: the worker's persistent batch, input packing, forward pass, KV cache and sampling.

Each step: apply the SchedulerOutput diff, pack all tokens into one [1, T] batch, run, sample.
"""

from __future__ import annotations

import logging
from array import array
from typing import TypeVar

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
from loomllm.workers.attention.metadata import PrefillRow, context_metadata, paged_metadata
from loomllm.workers.device.idle_probe import DeviceIdleProbe, DeviceTime
from loomllm.workers.device.transfer import device_tensor
from loomllm.workers.runner.cuda_graphs import DecodeGraphs
from loomllm.workers.runner.lora import LoRALoadError, LoRAManager
from loomllm.workers.runner.mixed_graphs import MAX_MIXED_TOKENS, MixedGraphs
from loomllm.workers.runner.pending_step import PendingStep
from loomllm.workers.runner.pooler import PoolRow, hidden_states, pool
from loomllm.workers.runner.request_state import CachedRequestState
from loomllm.workers.sample.prompt_logprobs import score_prompt_chunks
from loomllm.workers.sample.sampler import SamplerOutput, SamplingMetadata, sample
from loomllm.workers.sample.structured_output import GrammarCompiler, fill_bitmasks
from loomllm.workers.sample.token_filters import TokenFilters, bad_word_bans

logger = logging.getLogger(__name__)
G = TypeVar("G", DecodeGraphs, MixedGraphs)
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
        self.vocab_size: int = (getattr(config, "text_config", None) or config).vocab_size
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
        shared = dict(
            device=self.device,
            block_size=self.block_size,
            scratch_block=self.num_blocks,
            max_num_seqs=max_num_seqs,
            max_blocks=min(self.num_blocks, -(-max_model_len // self.block_size)),
        )
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
        fill_at: list[int] = []  # packed index of each input id the previous step sampled
        fill_from: list[int] = []  # its row in previous.sampled
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_idx: list[int] = []  # packed index of the last token of each sampling request
        samplers: list[CachedRequestState] = []
        prompt_idx: list[int] = []  # packed index of each position scored for prompt_logprobs
        scored: list[tuple[CachedRequestState, int, int]] = []  # (state, first position, count)
        decode_idx: list[int] = []
        decode_ctx: list[array[int]] = []
        decode_states: list[CachedRequestState] = []
        prefills: list[PrefillRow] = []
        prefill_states: list[CachedRequestState] = []
        pool_rows: list[PoolRow] = []
        triton = self.attention_backend == "triton"
        bs = self.block_size
        fresh = {r.req_id for r in so.new_requests}  # new, or back after a preemption
        cached = so.cached
        drafts_of: dict[str, list[int]] = {}
        if cached.draft_token_ids:  # a column only where the engine speculates
            drafts_of = dict(zip(cached.req_ids, cached.draft_token_ids, strict=True))
        # Speculative decoding: each sampling request's first row, and its drafts.
        spec: list[tuple[int, list[int]]] = []
        lora_tokens: dict[int, list[int]] = {}  # adapter slot -> its packed tokens
        for req_id, num_new in so.num_scheduled_tokens.items():
            state = self.requests[req_id]
            if state.lora_id is not None and self.lora is not None:
                slot = self.lora.slots[state.lora_id]
                lora_tokens.setdefault(slot, []).extend(
                    range(len(input_ids), len(input_ids) + num_new)
                )
            drafts = drafts_of.get(req_id) or []
            start, end = state.num_computed_tokens, state.num_computed_tokens + num_new
            known_end = end - len(drafts)  # the drafts follow the request's own tokens
            token_start = len(input_ids)
            num_known = len(state.all_token_ids)
            input_ids.extend(state.all_token_ids[start:known_end])
            if known_end > num_known:
                # Its last input is the token the previous step sampled: still on the device.
                if end != num_known + 1 or id(state) not in pending:
                    raise RuntimeError(
                        f"step {so.step_id}: request {req_id!r} computes "
                        f"position {known_end - 1}, but holds {num_known} tokens"
                    )
                fill_at.append(len(input_ids))
                fill_from.append(pending[id(state)])
                input_ids.append(0)
                num_known += 1
            input_ids.extend(drafts)
            positions.extend(range(start, end))
            blocks = state.block_ids
            state.slots.extend(blocks[p // bs] * bs + p % bs for p in range(len(state.slots), end))
            slots.extend(state.slots[start:end])
            # The torch backend gathers each context by slot, Triton's kernels read the
            # block table. A `fresh` one-token row is a prompt chunk: attend_rotating says why.
            if num_new == 1 and req_id not in fresh:
                decode_idx.append(token_start)
                decode_states.append(state)
                if not triton:
                    decode_ctx.append(state.slots[:end])
            else:
                ctx = (
                    torch.zeros(0, dtype=torch.long)
                    if triton
                    else torch.frombuffer(state.slots[:end], dtype=torch.long)
                )
                prefills.append(PrefillRow(token_start, num_new, ctx))
                prefill_states.append(state)
            if state.sampling_params.prompt_logprobs is not None and not state.output_token_ids:
                # Position p predicts prompt token p + 1: the last prompt position samples.
                num_scored = min(end, len(state.prompt_token_ids) - 1) - start
                if num_scored > 0:
                    prompt_idx.extend(range(token_start, token_start + num_scored))
                    scored.append((state, start, num_scored))
            if known_end == num_known:  # prompt complete: this step samples
                # After its last token, and after each draft, to verify it.
                first = len(input_ids) - len(drafts) - 1
                spec.append((len(samplers), drafts))
                sample_idx.extend(range(first, first + len(drafts) + 1))
                samplers.extend([state] * (len(drafts) + 1))
            if self.pooling is not None:
                pool_rows.append(
                    PoolRow(state, token_start, start, num_new, known_end == num_known)
                )
            state.num_computed_tokens = end
        if not input_ids:
            return self._launched(call_id, [], None, [])
        if self.lora is not None:
            self.lora.set_step(lora_tokens, len(input_ids), self.device)
        graphs, mixed, rows = self.decode_graphs, self.mixed_graphs, decode_states + prefill_states
        replay_mixed = (
            mixed is not None
            and bool(prefills)
            and not prompt_idx
            and mixed.fits(len(input_ids), len(rows), max(len(st.block_ids) for st in rows))
        )
        meta = None  # a mixed-step graph builds its metadata from the rows themselves
        if triton and not replay_mixed:
            meta = paged_metadata(
                self.kv_caches,
                self.device,
                self.block_size,
                slots,
                decode_idx,
                [st.block_ids for st in decode_states],
                [st.num_computed_tokens for st in decode_states],  # already advanced
                prefills,
                [st.block_ids for st in prefill_states],
                [st.num_computed_tokens for st in prefill_states],
            )
        elif not triton:
            meta = context_metadata(
                self.kv_caches, self.device, slots, decode_idx, decode_ctx, prefills
            )
        dev = self.device
        ids = device_tensor(input_ids, torch.long, dev)
        if fill_at:
            assert previous is not None
            ids[device_tensor(fill_at, torch.long, dev)] = previous.sampled[
                device_tensor(fill_from, torch.long, dev)
            ]
        if self.idle_probe is not None:
            self.idle_probe.step_started()
        if self.pooling is not None:
            positions_t = device_tensor([positions], torch.long, dev)
            types = None
            if any(row.state.token_type_ids for row in pool_rows):
                segments = [0] * len(input_ids)
                for row in pool_rows:
                    if row.state.token_type_ids:
                        at, until = row.start, row.start + row.num_tokens
                        segments[row.token_start : row.token_start + row.num_tokens] = (
                            row.state.token_type_ids[at:until]
                        )
                types = device_tensor([segments], torch.long, dev)
            hidden = hidden_states(self.model, ids[None], positions_t, meta, types)
            pooled = pool(hidden, pool_rows, self.pooling, getattr(self.model, "classify", None))
            placeholders = torch.zeros(len(samplers), dtype=torch.long, device=dev)
            nothing: list[None] = [None] * len(samplers)
            sampled = SamplerOutput(placeholders, placeholders.float(), nothing, nothing)
            if self.idle_probe is not None:
                self.idle_probe.step_ended(False, with_prompts=True)
            return self._launched(call_id, samplers, sampled, [], pooled)
        replay = (
            graphs is not None
            and meta is not None
            and meta.paged is not None
            and not prefills
            and not prompt_idx
            and len(decode_idx) <= graphs.max_batch
            and meta.paged.decode_tables.shape[1] <= graphs.max_blocks
        )
        if replay_mixed:
            # Every row through the prefill kernel, a decode as a one-token prompt chunk.
            logits = mixed.forward(
                ids,
                positions,
                device_tensor(slots, torch.long, dev),
                [st.block_ids for st in rows],
                decode_idx + [p.token_start for p in prefills],
                [1] * len(decode_idx) + [p.num_tokens for p in prefills],
                [st.num_computed_tokens for st in rows],
                sample_idx,
            )
        elif replay:
            # Decode only: packed token i is decode row i, and the rows that sample are
            # those whose prompt is complete (a 1-token prompt chunk does not).
            paged = meta.paged
            logits = graphs.forward(
                ids,
                device_tensor(positions, torch.long, dev),
                meta.slot_mapping,
                paged.decode_tables,
                paged.decode_lens,
            )
            if len(sample_idx) < len(decode_idx):
                logits = logits[device_tensor(sample_idx, torch.long, dev)]
        else:
            logits = self.model(
                input_ids=ids[None],
                position_ids=device_tensor([positions], torch.long, dev),
                use_cache=False,
                attn_metadata=meta,
                logits_to_keep=device_tensor(sample_idx + prompt_idx, torch.long, dev),
            ).logits[0]  # [num_samplers + num_prompt_positions, V]
        prompt_lps = score_prompt_chunks(logits[len(sample_idx) :], scored) if scored else []
        if previous is not None and any(
            id(s) in pending and _needs_output_ids(s.sampling_params) for s in samplers
        ):
            previous.result()  # penalties count the output ids: they must be on the host
            pending = {}
        sampled = None
        speculated = len(samplers) > len(spec)  # some request samples after drafts
        if samplers:
            sampled = self._sample(
                logits[: len(sample_idx)], samplers, pending, spec if speculated else None
            )
        if self.idle_probe is not None:
            replayed = (replay and graphs.captured) or (replay_mixed and mixed.captured)
            self.idle_probe.step_ended(replayed, with_prompts=bool(prefills))
        return self._launched(
            call_id, samplers, sampled, prompt_lps, spec=spec if speculated else None
        )

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
            top = [
                None if ids is None else TopLogprobs(ids, lps)
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
