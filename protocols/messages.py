"""Every message that crosses a process boundary, as frozen dataclasses with type codes.

Three conversations, each opened by Hello/Welcome: engine-manager, manager-worker, engine-worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from loomllm.protocols.codec import message
from loomllm.protocols.lora import LoRARequest
from loomllm.protocols.sampling import SamplingParams
from loomllm.protocols.worker_options import WorkerOptions

# Raise it whenever a message, a field or a type code changes: the handshake then refuses a
# peer from another release instead of misreading its frames.
PROTOCOL_VERSION = 15


# -- handshake and errors (all connections) -------------------------------------------


@message(1)
@dataclass(frozen=True, slots=True)
class Hello:
    protocol_version: int
    role: str  # "engine", "cli" or "worker": for logs and `ps`
    pid: int


@message(2)
@dataclass(frozen=True, slots=True)
class Welcome:
    protocol_version: int
    server: str  # "manager" or "worker"
    pid: int


@message(3)
@dataclass(frozen=True, slots=True)
class ErrorReply:
    """A request the server refused; `kind` is a stable machine-readable word."""

    kind: str
    message: str


@message(4)
@dataclass(frozen=True, slots=True)
class Ack:
    pass


# -- engine <-> manager -----------------------------------------------------------------
# Control: acquire and release workers, status, ps, unload, stop.


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker group is: two engines with equal specs may share warm workers."""

    model: str
    world_size: int
    options: WorkerOptions


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Facts about the loaded model that the engine needs (sent in READY)."""

    model: str
    model_dir: str  # HF-format directory: config, tokenizer files (weights, unless a GGUF's)
    vocab_size: int
    max_model_len: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    device: str
    load_seconds: float
    num_kv_blocks: int  # paged KV cache size the worker allocated, in blocks
    block_size: int  # tokens per KV block
    pooling: Pooling | None = None  # runner="pooling": how the worker pools; else None
    weights_path: str = ""  # where the weights are read from: a GGUF file; "": model_dir


@dataclass(frozen=True, slots=True)
class Pooling:
    """How a pooling worker turns a prompt's hidden states into one embedding."""

    method: str  # "last" (the last token's), "mean" (over the prompt) or "cls" (the first)
    normalize: bool  # to unit length
    size: int  # the embedding's length
    # Leading slices that are embeddings of their own (Matryoshka training): `dimensions`
    # may cut the embedding to any length where this is true.
    matryoshka: bool
    # False for an encoder (BERT): its attention is bidirectional, so a prompt is computed
    # whole, in one step, and keeps no KV.
    causal: bool = True
    # A classifier's (method "classify": the pool is its head's logits, `size` of them):
    # what sentence-transformers' CrossEncoder applies to a pair's logit to score it,
    # "sigmoid" or "none"; its labels, by index.
    score_activation: str = "sigmoid"
    labels: list[str] = field(default_factory=list)


@message(10)
@dataclass(frozen=True, slots=True)
class AcquireWorkers:
    spec: WorkerSpec
    keep_alive: float  # seconds to stay warm after release; 0 = exit, -1 = forever
    engine_id: str


@message(11)
@dataclass(frozen=True, slots=True)
class WorkersAcquired:
    group_id: str
    sockets: list[str]  # data socket path of each rank, in rank order
    pids: list[int]
    model_info: ModelInfo
    reused: bool  # True when warm workers were attached instead of launched
    # The secret this engine presents in Attach: the workers serve only its holder.
    lease_token: bytes = field(repr=False)


@message(12)
@dataclass(frozen=True, slots=True)
class ReleaseWorkers:
    group_id: str
    # Seconds the group stays warm from now on, in place of what AcquireWorkers asked; None
    # keeps that. 0 stops it before the Ack (a server unloading a model frees its memory).
    keep_alive: float | None = None


@message(13)
@dataclass(frozen=True, slots=True)
class WorkerDied:
    """Pushed by the manager to the engine that owns the dead worker."""

    group_id: str
    rank: int
    pid: int
    exit_code: int | None
    signal: int | None
    stderr_tail: str


@message(14)
@dataclass(frozen=True, slots=True)
class StatusRequest:
    pass


@message(15)
@dataclass(frozen=True, slots=True)
class ManagerStatus:
    pid: int
    uptime_s: float
    socket: str
    num_clients: int
    num_workers: int
    max_workers: int
    max_keep_alive: float
    idle_timeout: float


@message(16)
@dataclass(frozen=True, slots=True)
class ListWorkers:
    pass


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    group_id: str
    rank: int
    pid: int
    model: str
    state: str  # "loading", "busy" (attached to an engine) or "idle" (warm)
    rss_bytes: int
    age_s: float
    keep_alive: float
    expires_in_s: float | None  # idle workers only; None = pinned or busy
    world_size: int  # ranks in its group (tensor-parallel size)
    dtype: str  # the loaded weights' dtype; the requested one ("auto", ...) while loading


@message(17)
@dataclass(frozen=True, slots=True)
class WorkerList:
    workers: list[WorkerInfo]


@message(18)
@dataclass(frozen=True, slots=True)
class UnloadModel:
    model: str


@message(19)
@dataclass(frozen=True, slots=True)
class Unloaded:
    num_workers: int


@message(20)
@dataclass(frozen=True, slots=True)
class ShutdownManager:
    pass


# Models from the Hugging Face Hub, downloaded where the workers run: the manager answers a
# PullModel with PullProgress reports, then Pulled (or an ErrorReply).


@message(21)
@dataclass(frozen=True, slots=True)
class PullModel:
    model: str  # a hub id, "org/name"
    revision: str | None  # a branch, tag or commit; None: the default branch
    token: str | None  # the asker's Hugging Face token, for gated or private repositories
    # True (`loom pull`): ask the Hub for the revision's files even when the cache holds them;
    # False (an engine's start): a complete cached snapshot is used as it is, with no network.
    check_hub: bool


@message(22)
@dataclass(frozen=True, slots=True)
class PullProgress:
    done_bytes: int
    total_bytes: int  # of what this download fetches (files already cached not counted)


@message(23)
@dataclass(frozen=True, slots=True)
class Pulled:
    path: str  # the snapshot directory in the HF cache
    downloaded_bytes: int  # 0: everything was cached already


@message(24)
@dataclass(frozen=True, slots=True)
class ListCachedModels:
    pass


@dataclass(frozen=True, slots=True)
class CachedModel:
    model: str  # the hub id
    size_bytes: int
    revisions: list[str]  # the cached commits
    path: str  # the repository's folder in the HF cache


@message(25)
@dataclass(frozen=True, slots=True)
class CachedModelList:
    models: list[CachedModel]


# -- manager <-> worker -----------------------------------------------------------------
# Lifecycle: the worker's READY (or why it failed) and its leases; EOF tells the worker to exit.


@message(30)
@dataclass(frozen=True, slots=True)
class WorkerReady:
    rank: int
    pid: int
    socket: str
    model_info: ModelInfo


@message(31)
@dataclass(frozen=True, slots=True)
class WorkerFailed:
    """The worker could not start (bad model, out of memory); it exits after this."""

    rank: int
    message: str


@message(32)
@dataclass(frozen=True, slots=True)
class Lease:
    """The manager lent the worker to a new engine (or took it back: an empty token).

    From now on the data socket attaches only a client whose Attach carries `token`, and
    a session attached under another token is cut off. The worker answers Ack.
    """

    token: bytes = field(repr=False)


# -- engine <-> worker ------------------------------------------------------------------
# Data: Attach with the lease token, then calls tagged with a call_id, each answered by a
# result or a failure.


@message(45)
@dataclass(frozen=True, slots=True)
class Attach:
    """An engine's first message after the handshake: the lease token from WorkersAcquired.

    The worker answers Ack once it serves this engine, else an ErrorReply ("lease_refused",
    or "busy" while another engine stays attached) and closes the connection.
    """

    token: bytes = field(repr=False)


@message(40)
@dataclass(frozen=True, slots=True)
class RunCallable:
    """collective_rpc: a cloudpickled `(fn, args, kwargs)`; fn gets the worker first."""

    call_id: int
    payload: bytes


@message(41)
@dataclass(frozen=True, slots=True)
class CallResult:
    call_id: int
    payload: bytes  # cloudpickled return value


@message(42)
@dataclass(frozen=True, slots=True)
class CallFailed:
    """A call raised in the worker; the worker itself is still sound."""

    call_id: int
    error_type: str
    message: str
    traceback: str


# -- engine <-> worker: one step of the model ------------------------------------------


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the worker has not seen (or must rebuild after a preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only when a preempted request comes back
    sampling_params: SamplingParams
    eos_token_ids: list[int]  # masked while fewer than min_tokens are generated
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hits: KV already in these blocks
    # Each prompt token's segment, for an encoder's pair of texts (a cross-encoder's query and
    # document: BERT's token_type_ids); None: all of the first segment.
    token_type_ids: list[int] | None = None
    lora: LoRARequest | None = None  # None: the base model


@dataclass(frozen=True, slots=True)
class CachedRequests:
    """The diff for the requests the worker already holds, as columns: one entry per request.

    Columns rather than per-request records, because flat lists encode and check in one pass
    each: the validating decoder costs per object, not per int.
    """

    req_ids: list[str]
    new_block_ids: list[list[int]]  # blocks added this step (mostly empty)
    num_computed_tokens: list[int]
    # Speculative decoding: each request's draft tokens, computed after its last token and
    # verified this step; empty (the column, or a request's entry): none.
    draft_token_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not len(self.req_ids) == len(self.new_block_ids) == len(self.num_computed_tokens):
            raise ValueError("CachedRequests columns differ in length")
        if self.draft_token_ids and len(self.draft_token_ids) != len(self.req_ids):
            raise ValueError("CachedRequests columns differ in length")


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What to compute in one step: which requests, how many tokens of each."""

    step_id: int
    new_requests: list[NewRequestData]
    cached: CachedRequests
    # Tokens to compute per request, in batch order; a request whose prompt is then
    # complete samples one token.
    num_scheduled_tokens: dict[str, int]
    # Finished, aborted or preempted since the last step: the worker forgets them.
    finished_req_ids: list[str]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@message(43)
@dataclass(frozen=True, slots=True)
class ExecuteStep:
    call_id: int
    scheduler_output: SchedulerOutput


@dataclass(frozen=True, slots=True)
class TopLogprobs:
    token_ids: list[int]
    logprobs: list[float]


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """One prefill chunk's prompt logprobs for one request that set `prompt_logprobs` (k).

    Row j is about prompt token `start + j` (start >= 1: nothing predicts token 0), scored
    by the raw distribution the model predicted at the position before it. A prompt split
    by chunked prefill arrives in several of these; a request recomputed after a
    preemption before its first sampled token sends its rows again, with the same values.
    """

    req_id: str
    start: int  # prompt index of row 0's token
    token_logprobs: np.ndarray  # [N] float32: each prompt token's logprob
    ranks: np.ndarray  # [N] int64: its rank, 1 = most likely (ties share the worse rank)
    top_token_ids: np.ndarray  # [N, k] int64, by logprob descending
    top_logprobs: np.ndarray  # [N, k] float32


@message(44)
@dataclass(frozen=True, slots=True)
class StepResult:
    """One sampled token per request that sampled this step (partial prefills do not)."""

    call_id: int
    req_ids: list[str]
    sampled_token_ids: list[int]
    # Of each sampled token, from the raw logits; None where the step's sampler skipped
    # them (no request of the step asked for `logprobs`).
    logprobs: list[float | None]
    top_logprobs: list[TopLogprobs | None]  # for requests that asked for `logprobs`
    # This step's prompt positions of the requests that asked for `prompt_logprobs`,
    # sampled this step or not.
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # Seconds the worker spent executing the step (forward, sampling): the engine's
    # step timings subtract it from the wait for this reply.
    worker_time_s: float = 0.0
    # Requests the worker could not serve (a grammar that does not compile): the engine
    # fails each alone; whatever else this step holds for them is to be dropped.
    request_errors: list[RequestError] = field(default_factory=list)
    # A pooling worker's embeddings of the prompts completed this step (their sampled
    # token is a placeholder, which ends the request).
    pooled: list[PooledOutput] = field(default_factory=list)
    # Speculative decoding: per request in req_ids, the logprob of each of its draft tokens
    # that was accepted; its tokens this step are those drafts, then its sampled token.
    # Empty: no request had drafts.
    draft_logprobs: list[list[float | None]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PooledOutput:
    req_id: str
    embedding: np.ndarray  # [size] float32, normalized where the model's pooling says


@dataclass(frozen=True, slots=True)
class RequestError:
    req_id: str
    message: str  # shown to the request's caller, as a ValueError
