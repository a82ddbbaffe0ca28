"""Batched sampling with vLLM semantics: a worker's last step, from logits to token ids."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loomllm.protocols.sampling import SamplingParams
from loomllm.workers.device.transfer import device_tensor, to_device
from loomllm.workers.kernels import cpu_native
from loomllm.workers.sample.structured_output import apply_bitmask
from loomllm.workers.sample.token_filters import TokenFilters, apply_allowed, apply_bias

_GREEDY_EPSILON = 1e-5  # same threshold as SamplingParams.is_greedy
_F32_MAX = torch.finfo(torch.float32).max


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling parameters of the rows that sample this step (B rows).

    The tensors may live on any device (`sample` moves them to the logits' device); the
    flags below are computed once from them, so build this on the CPU to avoid a sync.
    """

    temperature: torch.Tensor  # [B] float32
    top_p: torch.Tensor  # [B] float32 (1.0 = off)
    top_k: torch.Tensor  # [B] int64 (0 = off)
    min_p: torch.Tensor  # [B] float32 (0.0 = off)
    presence_penalty: torch.Tensor  # [B] float32
    frequency_penalty: torch.Tensor  # [B] float32
    repetition_penalty: torch.Tensor  # [B] float32
    # Per row: the seed of this row's draw, from its request's seed and the index of the
    # token it samples (draw_seed); None: unseeded, drawn from torch's RNG.
    draw_seeds: list[int | None]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]  # tokens generated so far
    banned_token_ids: list[list[int]]  # ids forbidden this step (eos/stop while < min_tokens)
    num_logprobs: list[int | None]  # how many top logprobs to return
    # Per row: its allowed ids and logit bias (None: neither), built once per request.
    token_filters: list[TokenFilters | None] = field(default_factory=list)
    # [B, ceil(V / 32)] int32 on the CPU, bit j of word i set: token 32 i + j may be sampled,
    # for the rows in bitmask_rows (structured_outputs' grammars). None: no row has one.
    token_bitmask: torch.Tensor | None = None
    bitmask_rows: list[int] = field(default_factory=list)
    is_greedy: list[bool] = field(init=False)
    is_all_greedy: bool = field(init=False)
    has_penalties: bool = field(init=False)
    has_repetition_penalty: bool = field(init=False)
    has_top_k_top_p: bool = field(init=False)  # among random rows
    has_min_p: bool = field(init=False)  # among random rows

    def __post_init__(self) -> None:
        greedy = (self.temperature < _GREEDY_EPSILON) | (self.top_k == 1)  # [B]
        self.is_greedy = greedy.tolist()
        self.is_all_greedy = all(self.is_greedy)
        has_rep = bool((self.repetition_penalty != 1.0).any())
        self.has_repetition_penalty = has_rep
        self.has_penalties = has_rep or bool(
            ((self.presence_penalty != 0.0) | (self.frequency_penalty != 0.0)).any()
        )
        random = ~greedy
        self.has_top_k_top_p = bool((random & ((self.top_k > 1) | (self.top_p < 1.0))).any())
        self.has_min_p = bool((random & (self.min_p > 0.0)).any())

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        draw_indexes: list[int],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        banned_token_ids: list[list[int]],
        token_filters: list[TokenFilters | None] | None = None,
        vocab_size: int = 2**62,
    ) -> SamplingMetadata:
        """Build the per-row tensors on the CPU; top_k -1 (vLLM's "off") becomes 0.
        `token_filters`: each row's, cached by the caller (else built here, on the CPU,
        dropping ids from `vocab_size` on)."""

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32)  # [B]

        # A temperature float32 would round to inf (1e300) is kept finite: a banned -inf
        # divided by it would be NaN, and NaN logits sample token 0. (apply_penalties
        # clamps what an extreme repetition penalty makes.)
        return cls(
            temperature=floats([min(p.temperature, _F32_MAX) for p in params]),
            top_p=floats([p.top_p for p in params]),
            top_k=torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.int64),
            min_p=floats([p.min_p for p in params]),
            presence_penalty=floats([p.presence_penalty for p in params]),
            frequency_penalty=floats([p.frequency_penalty for p in params]),
            repetition_penalty=floats([p.repetition_penalty for p in params]),
            draw_seeds=[
                None if p.seed is None else draw_seed(p.seed, index)
                for p, index in zip(params, draw_indexes, strict=True)
            ],
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
            banned_token_ids=banned_token_ids,
            num_logprobs=[p.logprobs for p in params],
            token_filters=token_filters
            if token_filters is not None
            else [TokenFilters.of(p, vocab_size, torch.device("cpu")) for p in params],
        )


@dataclass(slots=True)
class SamplerOutput:
    """One step's sampled token of each row, with its logprob and the top logprobs asked for."""

    sampled_token_ids: torch.Tensor  # [B] int64
    # [B] float32: raw log_softmax (before penalties) at the sampled id; None where no row
    # asked for logprobs and the kernel that sampled skipped them (the greedy one's exp pass).
    logprobs: torch.Tensor | None
    top_token_ids: list[list[int] | None]  # per row, sorted by logprob desc; None: not asked
    top_logprobs: list[list[float] | None]
    # [B] bool: rows whose filters left no token (a token was drawn anyway); None: no row
    # was narrowed to a few tokens. On the logits' device: read with the tokens, no sync.
    stuck: torch.Tensor | None = None


def draw_seed(seed: int, index: int) -> int:
    """The seed of a seeded request's draw of its output token `index`: a function of the
    two alone, so the token does not depend on the other rows, on a preemption that
    recomputed the request, or on a draw made for a token async scheduling then dropped.
    Mixed with splitmix64 over all 64 bits (a CPU generator keeps only the low 32 of a
    seed, where 2**63 - 1 and -1 agree)."""
    mixed = (seed + 0x9E3779B97F4A7C15 * (index + 1)) % 2**64
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) % 2**64
    return mixed ^ (mixed >> 31)


_generators: dict[torch.device, torch.Generator] = {}


def _seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """The device's one generator for seeded draws, set to `seed` (a draw's own)."""
    generator = _generators.get(device)
    if generator is None:
        generator = _generators[device] = torch.Generator(device=device)
    return generator.manual_seed(seed)


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
    """Sample one token per row of `logits` [B, V] (any float dtype; computed in float32)."""
    ops = cpu_native.loaded()
    on_cpu = logits.device.type == "cpu" and logits.dtype in cpu_native.DTYPES
    if ops is not None and on_cpu and _plain(meta):
        # The C++ kernels: a few passes over each row, no float32 copy.
        if meta.is_all_greedy:
            sampled, logprobs = ops.greedy_ids(logits), None
        else:
            greedy = torch.tensor(meta.is_greedy)
            temperature = torch.where(greedy, 0.0, meta.temperature)  # [B]; 0: greedy
            uniforms = _uniforms(meta, logits.device)[:, 0]  # [B]
            sampled, logprobs = ops.random_sample(logits, temperature, uniforms)
        rows = [None] * len(meta.num_logprobs)
        return SamplerOutput(sampled, logprobs, list(rows), list(rows), None)
    raw = logits.float()  # [B, V]; never modified in place (may be the caller's tensor)
    lse = torch.logsumexp(raw, dim=-1)  # [B]
    x = apply_token_filters(raw, meta)  # [B, V]
    narrowed = meta.token_bitmask is not None or any(
        f is not None and f.allowed is not None for f in meta.token_filters
    )
    stuck = ~x.isfinite().any(dim=-1) if narrowed else None  # [B]
    if meta.has_penalties:
        x = apply_penalties(x, meta)
    if meta.is_all_greedy:  # the common case: no RNG touched, a few tensor ops
        sampled = x.argmax(dim=-1)  # [B]
    else:
        sampled = _sample_random(x, meta)
    logprobs = raw.gather(1, sampled[:, None])[:, 0] - lse  # [B]
    top_ids, top_lps = _top_logprobs(raw, lse, meta.num_logprobs)
    return SamplerOutput(sampled, logprobs, top_ids, top_lps, stuck)


def _plain(meta: SamplingMetadata) -> bool:
    """Whether every row is greedy or draws at a temperature alone: nothing else changes the
    logits or narrows the draw, and no row asks for more than the sampled token's logprob."""
    return (
        not meta.has_top_k_top_p
        and not meta.has_min_p
        and not meta.has_penalties
        and meta.token_bitmask is None
        and not any(meta.banned_token_ids)
        and all(f is None for f in meta.token_filters)
        and all(k is None for k in meta.num_logprobs)
    )


def apply_token_filters(x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """vLLM's order before penalties: the grammar's tokens, only the allowed ids, then
    min_tokens' bans, then the logit bias. Out of place; `x` [B, V] is returned when no row
    has any."""
    if meta.token_bitmask is not None:
        x = apply_bitmask(x, meta.token_bitmask, meta.bitmask_rows)
    if any(meta.token_filters):
        x = apply_allowed(x, meta.token_filters)
    x = apply_banned(x, meta.banned_token_ids)
    if any(meta.token_filters):
        x = apply_bias(x, meta.token_filters)
    return x


def apply_banned(x: torch.Tensor, banned: list[list[int]]) -> torch.Tensor:
    """Set each row's banned ids to -inf (out of place); `x` [B, V] is returned when none."""
    if not any(banned):
        return x
    rows = [i for i, ids in enumerate(banned) for _ in ids]
    cols = [t for ids in banned for t in ids]
    index = (device_tensor(rows, torch.long, x.device), device_tensor(cols, torch.long, x.device))
    return x.index_put(index, torch.full((), float("-inf"), device=x.device))


def apply_penalties(x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """vLLM's penalties on logits `x` [B, V], out of place.

    repetition p over tokens in prompt or output: logit > 0 -> logit / p, else logit * p;
    then logit -= frequency * count_in_output + presence * (count_in_output > 0).
    """
    batch, vocab = x.shape
    device = x.device
    output = _padded(meta.output_token_ids, vocab, device)  # [B, Lo], pad = vocab
    counts = torch.zeros(batch, vocab + 1, device=device)  # [B, V + 1]; last column eats pads
    counts.scatter_add_(1, output, torch.ones_like(output, dtype=torch.float32))
    counts = counts[:, :vocab]  # [B, V]
    seen = counts > 0  # [B, V]
    if meta.has_repetition_penalty:
        prompt = _padded(meta.prompt_token_ids, vocab, device)  # [B, Lp]
        in_prompt = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=device)
        in_prompt.scatter_(1, prompt, True)
        rep = to_device(meta.repetition_penalty, device)[:, None]  # [B, 1]
        # Clamped: an extreme penalty must not turn a logit into inf (NaN after softmax);
        # a banned token's -inf stays (only finite logits are penalized).
        penalized = torch.where(x > 0, x / rep, x * rep).clamp(-_F32_MAX, _F32_MAX)  # [B, V]
        x = torch.where((in_prompt[:, :vocab] | seen) & x.isfinite(), penalized, x)
    freq = to_device(meta.frequency_penalty, device)[:, None]  # [B, 1]
    presence = to_device(meta.presence_penalty, device)[:, None]  # [B, 1]
    return x - freq * counts - presence * seen.float()


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Ragged id lists as one [B, width] int64 tensor, padded with `pad`."""
    width = max((len(r) for r in rows), default=0)
    padded = [r + [pad] * (width - len(r)) for r in rows]
    return device_tensor(padded, torch.int64, device).reshape(len(rows), width)


def _sample_random(x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then one uniform draw a row, taken through the
    row's cumulative probabilities; greedy rows take argmax."""
    device = x.device
    greedy = device_tensor(meta.is_greedy, torch.bool, device)  # [B]
    temperature = to_device(meta.temperature, device)
    scaled = x / torch.where(greedy, 1.0, temperature)[:, None]  # [B, V]
    # A huge finite logit (a bias, a penalty) over a temperature below 1 must stay finite:
    # inf is NaN after softmax, and NaN samples token 0. -inf (banned) stays -inf.
    scaled = torch.where(x.isfinite(), scaled.clamp(-_F32_MAX, _F32_MAX), scaled)
    if meta.has_top_k_top_p:
        scaled = _apply_top_k_top_p(
            scaled, to_device(meta.top_k, device), to_device(meta.top_p, device)
        )
    probs = scaled.softmax(dim=-1)  # [B, V]
    if meta.has_min_p:
        threshold = to_device(meta.min_p, device)[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)  # the draw needs no renormalizing
    # The first token whose cumulative probability reaches u * total, u uniform in (0, 1]:
    # a token of probability 0 is never taken. One draw a row, where an exponential race
    # (argmax of p / q, q ~ Exp(1)) draws one per token: on a CPU that costs more than the
    # forward of a small model. In float64, so that even the rarest token keeps its mass.
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [B, V]
    reach = (1.0 - _uniforms(meta, device)) * cdf[:, -1:]  # [B, 1]
    sampled = torch.searchsorted(cdf, reach).clamp_(max=cdf.shape[-1] - 1)[:, 0]  # [B]
    if any(meta.is_greedy):
        sampled = torch.where(greedy, x.argmax(dim=-1), sampled)
    return sampled


def _uniforms(meta: SamplingMetadata, device: torch.device) -> torch.Tensor:
    """Each random row's uniform draw in [0, 1), float64 [B, 1] (greedy rows' are unset)."""
    u = torch.empty(len(meta.is_greedy), 1, dtype=torch.float64, device=device)
    rows = list(zip(meta.is_greedy, meta.draw_seeds, strict=True))
    if any(not is_greedy and seed is None for is_greedy, seed in rows):
        u.uniform_()  # one batched draw from the default RNG for all unseeded rows
    # Each seeded row draws only from its own generator, so its tokens do not depend on
    # which other rows share the batch.
    for i, (is_greedy, seed) in enumerate(rows):
        if seed is not None and not is_greedy:
            u[i].uniform_(generator=_seeded_generator(seed, device))
    return u


# How many of each row's largest logits the CPU takes first for top-k/top-p: the nucleus
# mostly lies among them, and finding them costs a fraction of sorting the vocabulary.
_CANDIDATES = 256


def _apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask with -inf all but each row's k largest logits, then all but the smallest set whose
    probability mass reaches top_p (the top token is always kept). x: [B, V]; top_k, top_p: [B].

    On the CPU the rows' largest logits are taken first, and a row's vocabulary is sorted
    only where its nucleus may reach past them."""
    vocab = x.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab)  # [B]
    if x.device.type == "cpu":
        width = min(vocab, max(_CANDIDATES, int(top_k.max())))
        values, order = x.topk(width, dim=-1)  # [B, W], descending
        # Where k is off, the probabilities are over the whole vocabulary.
        whole = torch.full_like(top_p, float("nan"))  # [B]
        if bool((top_k == 0).any()):
            whole = torch.where(top_k > 0, whole, x.logsumexp(-1))
        kept, mass = _nucleus(values, k, top_p, whole)
        off = (top_k == 0) & (top_p >= 1.0)  # [B]: rows that keep their whole vocabulary
        out = torch.full_like(x, float("-inf")).scatter_(-1, order, kept)
        out = torch.where(off[:, None], x, out)
        # Rows whose nucleus may reach past their candidates are sorted whole.
        past = ~(off | (k <= width) | ((top_p < 1.0) & (mass >= top_p)))  # [B]
        if bool(past.any()):
            out[past] = _sorted_nucleus(x[past], k[past], top_p[past])
        return out
    return _sorted_nucleus(x, k, top_p)


def _sorted_nucleus(x: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """_apply_top_k_top_p over each row's whole sorted vocabulary; k [B] (vocab where off)."""
    ordered, order = x.sort(dim=-1, descending=True)  # [B, V]
    kept, _ = _nucleus(ordered, k, top_p, None)
    return torch.empty_like(x).scatter_(-1, order, kept)


def _nucleus(
    ordered: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, whole: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' logits in descending order [B, W] (all of each row's, or its largest) with -inf
    past each row's k and where top_p drops them, and the mass of these W [B]. `whole`: each
    row's log-sum-exp over its vocabulary where its k is off, NaN where on (None: `ordered`
    holds whole rows)."""
    position = torch.arange(ordered.shape[-1], device=ordered.device)  # [W]
    ordered = ordered.masked_fill(position >= k[:, None], float("-inf"))
    lse = ordered.logsumexp(dim=-1)  # [B]
    if whole is not None:
        lse = torch.where(whole.isnan(), lse, whole)
    probs = (ordered - lse[:, None]).exp()  # [B, W]
    cumulative = probs.cumsum(dim=-1)  # [B, W]
    mass_before = cumulative - probs  # [B, W]: mass of strictly more likely tokens
    # top_p = 1 is off outright: rounding in the cumsum must not drop the tail.
    drop = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop[:, 0] = False  # a top_p that float32 rounds to 0 must not drop the top token too
    return ordered.masked_fill(drop, float("-inf")), cumulative[:, -1]


def _top_logprobs(
    raw: torch.Tensor, lse: torch.Tensor, num_logprobs: list[int | None]
) -> tuple[list[list[int] | None], list[list[float] | None]]:
    """Each asking row's k largest raw logprobs, descending. raw: [B, V]; lse: [B]."""
    wanted = [k for k in num_logprobs if k is not None]
    if not wanted:
        return [None] * len(num_logprobs), [None] * len(num_logprobs)
    k_max = min(max(wanted), raw.shape[-1])
    values, ids = raw.topk(k_max, dim=-1)  # [B, k_max], sorted descending
    all_ids = ids.tolist()
    all_lps = (values - lse[:, None]).tolist()
    top_ids: list[list[int] | None] = []
    top_lps: list[list[float] | None] = []
    for i, k in enumerate(num_logprobs):
        top_ids.append(None if k is None else all_ids[i][:k])
        top_lps.append(None if k is None else all_lps[i][:k])
    return top_ids, top_lps
