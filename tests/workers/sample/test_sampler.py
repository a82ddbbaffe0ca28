"""Sampler unit tests: each sampling field against a direct computation on a small vocabulary."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import pytest
import torch

from loomllm.protocols.sampling import SamplingParams
from loomllm.workers.sample.sampler import (
    SamplingMetadata,
    _apply_top_k_top_p,
    apply_penalties,
    draw_seed,
    sample,
)

V = 16


def _meta(
    params: Sequence[SamplingParams],
    *,
    draws: Sequence[int] | None = None,
    prompts: Sequence[list[int]] | None = None,
    outputs: Sequence[list[int]] | None = None,
    banned: Sequence[list[int]] | None = None,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.from_params(
        list(params),
        list(draws) if draws is not None else [0] * n,
        list(prompts) if prompts is not None else [[] for _ in range(n)],
        list(outputs) if outputs is not None else [[] for _ in range(n)],
        list(banned) if banned is not None else [[] for _ in range(n)],
    )


def _logits(batch: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 2  # [B, V]


def _draws(logits_row: torch.Tensor, params: SamplingParams, n: int = 4000) -> torch.Tensor:
    """n independent samples of one row, as one batch of n identical rows (fixed seed)."""
    logits = logits_row[None, :].expand(n, -1)  # [n, V]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        return sample(logits, _meta([params] * n)).sampled_token_ids  # [n]


def _reachable(logits_row: torch.Tensor, params: SamplingParams, n: int = 4000) -> set[int]:
    return set(_draws(logits_row, params, n).tolist())


def test_from_params_builds_tensors_and_maps_top_k_off() -> None:
    meta = _meta([SamplingParams(top_k=-1, logprobs=3), SamplingParams(top_k=5, temperature=0.0)])
    assert meta.top_k.tolist() == [0, 5] and meta.top_k.dtype == torch.int64
    assert meta.temperature.dtype == torch.float32 and meta.temperature.shape == (2,)
    assert meta.num_logprobs == [3, None]
    assert meta.is_greedy == [False, True] and not meta.is_all_greedy and not meta.has_penalties


def test_greedy_is_argmax_and_touches_no_rng() -> None:
    logits = _logits(6)
    rng_state = torch.get_rng_state()
    params = [SamplingParams(temperature=0.0, seed=7 if i % 2 else None) for i in range(6)]
    out = sample(logits, _meta(params))
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(torch.get_rng_state(), rng_state)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-6),
        SamplingParams(top_k=1),
        SamplingParams(temperature=2.0, top_k=1),
    ],
)
def test_greedy_equivalents(params: SamplingParams) -> None:
    logits = _logits(5, seed=1)
    for _ in range(5):
        assert (
            sample(logits, _meta([params] * 5)).sampled_token_ids.tolist()
            == logits.argmax(-1).tolist()
        )


def test_mixed_batch_greedy_rows_stay_argmax() -> None:
    logits = _logits(4, seed=2)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=5.0)] * 2
    for _ in range(20):
        got = sample(logits, _meta(params)).sampled_token_ids
        assert got[0] == logits[0].argmax() and got[2] == logits[2].argmax()


def test_top_k_never_samples_outside_top_k() -> None:
    row = _logits(1, seed=3)[0]
    top5 = set(row.topk(5).indices.tolist())
    assert _reachable(row, SamplingParams(temperature=3.0, top_k=5)) == top5


def test_top_p_keeps_exactly_the_nucleus() -> None:
    probs = torch.tensor([0.05, 0.4, 0.02, 0.3, 0.15, 0.08])
    row = probs.log()
    # sorted: 0.4, 0.3, 0.15, 0.08, 0.05, 0.02 -> mass before each: 0, .4, .7, .85, .93, .98
    assert _reachable(row, SamplingParams(top_p=0.65)) == {1, 3}
    assert _reachable(row, SamplingParams(top_p=0.75)) == {1, 3, 4}
    assert _reachable(row, SamplingParams(top_p=0.9)) == {1, 3, 4, 5}
    assert _reachable(row, SamplingParams(top_p=1e-6)) == {1}  # the top token always stays
    assert _reachable(row, SamplingParams(top_p=1.0), n=20000) == set(range(6))


def test_top_p_applies_after_top_k() -> None:
    row = torch.tensor([0.05, 0.4, 0.02, 0.3, 0.15, 0.08]).log()
    # top_k=3 renormalizes {.4, .3, .15} to {.47, .35, .18}: the top two already hold 0.82,
    # so top_p=0.75 keeps two here (three without top_k, see above) and 0.85 keeps three.
    assert _reachable(row, SamplingParams(top_k=3, top_p=0.75)) == {1, 3}
    assert _reachable(row, SamplingParams(top_k=3, top_p=0.85)) == {1, 3, 4}


def test_min_p_drops_low_tokens() -> None:
    probs = torch.tensor([0.05, 0.4, 0.02, 0.3, 0.15, 0.08])
    row = probs.log()
    # threshold 0.3 * 0.4 = 0.12 keeps .4, .3, .15; with temperature 2 the ratio is sqrt'd.
    assert _reachable(row, SamplingParams(min_p=0.3)) == {1, 3, 4}
    kept = {i for i, p in enumerate(probs.tolist()) if math.sqrt(p / 0.4) >= 0.5}
    assert _reachable(row, SamplingParams(min_p=0.5, temperature=2.0)) == kept


def _reference_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
) -> torch.Tensor:
    expected = logits.clone()
    for i, p in enumerate(params):
        for t in range(logits.shape[1]):
            value = expected[i, t].item()
            if t in prompts[i] or t in outputs[i]:
                value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
            count = outputs[i].count(t)
            value -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            expected[i, t] = value
    return expected


def test_penalties_match_definition() -> None:
    logits = _logits(4, seed=4, vocab=12)
    params = [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(frequency_penalty=0.6),
        SamplingParams(presence_penalty=-1.1),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=1.5),
    ]
    prompts = [[0, 1, 2, 2], [3, 4], [], [5, 11]]
    outputs = [[2, 6, 6], [4, 4, 4, 7], [8, 9, 9], [5, 5, 10]]
    meta = _meta(params, prompts=prompts, outputs=outputs)
    assert meta.has_penalties and meta.has_repetition_penalty
    got = apply_penalties(logits, meta)
    torch.testing.assert_close(got, _reference_penalties(logits, params, prompts, outputs))


def test_no_penalty_rows_are_untouched_and_fast_path_flag() -> None:
    assert not _meta([SamplingParams()] * 3, outputs=[[1], [2], [3]]).has_penalties
    logits = _logits(2, seed=5)
    meta = _meta([SamplingParams(), SamplingParams(presence_penalty=1.0)], outputs=[[1, 2], [1, 2]])
    got = apply_penalties(logits, meta)
    assert torch.equal(got[0], logits[0]) and not meta.has_repetition_penalty


def test_penalties_flip_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0]] * 3)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, frequency_penalty=0.3),
        SamplingParams(temperature=0.0, presence_penalty=0.6),
    ]
    # Row 0: 3.0 in the prompt -> 2.0 < 2.5. Rows 1, 2: 3.0 seen twice in the output.
    out = sample(logits, _meta(params, prompts=[[1], [], []], outputs=[[], [1, 1], [1, 1]]))
    assert out.sampled_token_ids.tolist() == [2, 2, 2]
    unpenalized = sample(logits, _meta(params, prompts=[[0], [], []], outputs=[[], [3], [3]]))
    assert unpenalized.sampled_token_ids.tolist() == [1, 1, 1]


def test_banned_ids_never_sampled() -> None:
    row = _logits(1, seed=6)[0]
    order = row.argsort(descending=True).tolist()
    banned = order[:3]
    n = 3000
    logits = row[None, :].expand(n, -1)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=5.0)] * (n // 2)
    meta = _meta(params, banned=[banned] * n, outputs=[[banned[0]]] * n)
    got = set(sample(logits, meta).sampled_token_ids.tolist())
    assert not got & set(banned) and order[3] in got
    # Penalties must not revive a banned id (-inf stays -inf).
    params = [SamplingParams(temperature=0.0, frequency_penalty=-2.0)]
    meta = _meta(params, outputs=[[banned[0]] * 50], banned=[banned])
    assert sample(row[None, :], meta).sampled_token_ids.item() == order[3]


def test_values_float32_rounds_to_zero_or_inf_still_sample_sensibly() -> None:
    """Valid Python floats that float32 would make 0 or inf: no NaN reaches the draw (NaN
    logits sampled token 0 every step)."""
    row = _logits(1, seed=9)[0]
    order = row.argsort(descending=True).tolist()
    # top_p of 1e-50 (0.0 in float32): only the top token, never none.
    assert _reachable(row, SamplingParams(temperature=1.0, top_p=1e-50), 300) == {order[0]}
    # A temperature of 1e300 (inf): uniform over the tokens not banned, never a banned one.
    banned = order[:4]
    n = 2000
    meta = _meta([SamplingParams(temperature=1e300)] * n, banned=[banned] * n)
    got = set(sample(row[None, :].expand(n, -1), meta).sampled_token_ids.tolist())
    assert got == set(range(V)) - set(banned), got
    # A repetition penalty of 1e-300 (0.0): the positive logits seen grow (to float32's
    # largest), the negative ones shrink to ~0; greedy takes a positive one seen.
    seen = order[-3:] + order[5:7]  # three negative logits, two positive ones (seed 9)
    assert (row[order[-3:]] < 0).all() and (row[order[5:7]] > 0).all()
    meta = _meta(
        [
            SamplingParams(temperature=0.0, repetition_penalty=1e-300),
            SamplingParams(temperature=1.0, repetition_penalty=1e-300),
        ],
        outputs=[seen, seen],
    )
    x = apply_penalties(row[None, :].expand(2, -1), meta)
    assert not x.isnan().any() and not x.isinf().any()
    assert set(sample(row[None, :].expand(2, -1), meta).sampled_token_ids.tolist()) <= set(
        order[5:7]
    )


def test_seeded_rows_ignore_batch_companions() -> None:
    target = _logits(1, seed=7)[0]
    params = SamplingParams(temperature=1.5, top_p=0.9, top_k=12, seed=42)

    def run(companions: int, companion_seed: int | None, steps: int = 8) -> list[int]:
        tokens = []
        for step in range(steps):  # the seeded row samples its output token `step`
            others = _logits(companions, seed=100 + step + companions) if companions else None
            logits = target[None, :] if others is None else torch.cat([others, target[None, :]])
            others_params = [SamplingParams(temperature=1.0, seed=companion_seed)] * companions
            meta = _meta(others_params + [params], draws=[step * 3] * companions + [step])
            tokens.append(sample(logits, meta).sampled_token_ids[-1].item())
        return tokens

    alone = run(0, None)
    assert run(3, None) == alone
    assert run(5, 9) == alone
    assert run(2, 42) == alone  # companions of the same seed, at other tokens
    assert len(set(alone)) > 1  # a seeded row is still random from token to token
    # Each draw is its (seed, index)'s alone: resampling token 3 (after a preemption, or a
    # draw async scheduling dropped) gives it again; another seed gives other tokens.
    again = sample(target[None, :], _meta([params], draws=[3])).sampled_token_ids.item()
    assert again == alone[3]
    other = dataclasses.replace(params, seed=43)
    meta = _meta([other] * 8, draws=list(range(8)))
    assert sample(target[None, :].expand(8, -1), meta).sampled_token_ids.tolist() != alone


def test_unseeded_rows_are_random() -> None:
    logits = torch.zeros(2, V)
    meta = _meta([SamplingParams()] * 2)
    draws = [tuple(sample(logits, meta).sampled_token_ids.tolist()) for _ in range(30)]
    assert len(set(draws)) > 10


def test_logprobs_are_raw_log_softmax_at_sampled_ids() -> None:
    logits = _logits(5, seed=8)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
        SamplingParams(temperature=0.7, logprobs=3),
        SamplingParams(temperature=1.0, presence_penalty=1.0, logprobs=0),
        SamplingParams(temperature=0.0, logprobs=20),
        SamplingParams(top_k=4, logprobs=1),
    ]
    out = sample(logits, _meta(params, prompts=[[1, 2]] * 5, outputs=[[3]] * 5))
    raw = torch.log_softmax(logits, dim=-1)
    expected = raw.gather(1, out.sampled_token_ids[:, None])[:, 0]
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, expected, atol=1e-6, rtol=0)
    assert out.top_token_ids[0] is None and out.top_logprobs[0] is None
    assert out.top_token_ids[2] == [] and out.top_logprobs[2] == []
    for i, k in [(1, 3), (3, 16), (4, 1)]:  # k=20 > V returns the whole vocabulary
        values, ids = raw[i].topk(k)
        assert out.top_token_ids[i] == ids.tolist()
        lps = out.top_logprobs[i]
        assert lps is not None and lps == sorted(lps, reverse=True)
        torch.testing.assert_close(torch.tensor(lps), values, atol=1e-6, rtol=0)


def test_sample_does_not_modify_caller_logits() -> None:
    logits = _logits(2, seed=9)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.5, top_p=0.5)] * 2
    sample(logits, _meta(params, prompts=[[0, 1]] * 2, banned=[[2], [3]]))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_empirical_distribution_matches_softmax(temperature: float) -> None:
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.2, 1.3, -2.0, 0.7])
    n = 20000
    counts = torch.bincount(_draws(row, SamplingParams(temperature=temperature), n), minlength=10)
    expected = torch.softmax(row / temperature, dim=-1)
    assert (counts / n - expected).abs().max() < 0.02
    chi2 = (((counts - n * expected) ** 2) / (n * expected)).sum().item()
    assert chi2 < 40  # 9 degrees of freedom: p < 1e-5


def test_bfloat16_logits() -> None:
    logits = _logits(4, seed=10).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(top_k=3, top_p=0.9, min_p=0.1),
        SamplingParams(presence_penalty=0.5),
        SamplingParams(seed=1),
    ]
    out = sample(logits, _meta(params, outputs=[[1]] * 4))
    assert out.sampled_token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    assert out.sampled_token_ids[0] == logits[0].float().argmax()
    raw = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(
        out.logprobs, raw.gather(1, out.sampled_token_ids[:, None])[:, 0], atol=1e-6, rtol=0
    )
    assert out.top_token_ids[0] == raw[0].topk(2).indices.tolist()


def test_draw_seeds_are_the_seed_and_index_s_alone_and_use_all_64_bits() -> None:
    assert draw_seed(5, 3) == draw_seed(5, 3) and 0 <= draw_seed(-(2**63), 0) < 2**64
    seeds = {
        draw_seed(seed, index)
        for seed in (-2, -1, 0, 1, 2**32 + 1, 2**63 - 1)
        for index in range(50)
    }
    assert len(seeds) == 300
    # A CPU generator keeps the low 32 bits of its seed: these differ too (there, -1 and
    # 2**63 - 1, or 1 and 2**32 + 1, would have drawn alike).
    assert len({seed % 2**32 for seed in seeds}) == 300


def test_logit_bias_adds_to_the_logits_before_sampling() -> None:
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.2, 1.3, -2.0, 0.7])
    bias = {2: 3.0, 4: -1.5, 9: 0.25}
    shifted = row.clone()
    for token_id, b in bias.items():
        shifted[token_id] += b
    # Greedy picks the biased argmax; sampling follows softmax(logits + bias).
    greedy = sample(row[None, :], _meta([SamplingParams(temperature=0.0, logit_bias=bias)]))
    assert greedy.sampled_token_ids.item() == shifted.argmax().item() == 2
    n = 20000
    counts = torch.bincount(_draws(row, SamplingParams(logit_bias=bias), n), minlength=10)
    assert (counts / n - torch.softmax(shifted, dim=-1)).abs().max() < 0.02
    # OpenAI's extremes: +100 forces a token, -100 all but bans it; logprobs stay raw.
    out = sample(
        row[None, :].expand(2, -1),
        _meta(
            [
                SamplingParams(logit_bias={8: 100}, logprobs=1),
                SamplingParams(logit_bias={4: -100, 7: -100, 0: -100}, temperature=0.0),
            ]
        ),
    )
    assert out.sampled_token_ids.tolist() == [8, 9]
    torch.testing.assert_close(out.logprobs[0], torch.log_softmax(row, -1)[8])


def test_allowed_token_ids_limit_every_row_that_has_them() -> None:
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.2, 1.3, -2.0, 0.7])
    assert _reachable(row, SamplingParams(allowed_token_ids=[3, 5, 8])) == {3, 5, 8}
    out = sample(
        row[None, :].expand(3, -1),
        _meta(
            [
                SamplingParams(temperature=0.0, allowed_token_ids=[1, 3]),
                SamplingParams(temperature=0.0),  # a row without the list is untouched
                SamplingParams(temperature=0.0, allowed_token_ids=[1, 3], logit_bias={3: 1.5}),
            ]
        ),
    )
    assert out.sampled_token_ids.tolist() == [1, 4, 3]


def test_bias_keeps_banned_ids_banned_and_sums_finite() -> None:
    row = torch.zeros(V)
    params = SamplingParams(logit_bias={3: 1e300, 1: -1e300, 2: 50.0}, temperature=0.0)
    # min_tokens' ban of 3 wins over its bias; a huge bias is a finite logit (NaN logits
    # would sample token 0).
    for temperature in (0.0, 0.5, 1.0):  # below 1, dividing once overflowed to NaN
        one = dataclasses.replace(params, temperature=temperature)
        assert sample(row[None, :], _meta([one])).sampled_token_ids.item() == 3
        out = sample(row[None, :], _meta([one], banned=[[3]]))
        assert out.sampled_token_ids.item() == 2


def test_an_extreme_repetition_penalty_under_a_low_temperature_stays_finite() -> None:
    row = torch.zeros(V)
    row[4] = 1.0
    params = SamplingParams(repetition_penalty=1e-40, temperature=0.5)  # 1 / 1e-40 / 0.5
    out = sample(row[None, :], _meta([params], prompts=[[4]], banned=[[0]]))
    assert out.sampled_token_ids.item() == 4  # not NaN's token 0, which is banned here


def test_token_filters_are_built_once_in_their_normal_form() -> None:
    from loomllm.workers.sample.token_filters import TokenFilters

    params = SamplingParams(allowed_token_ids=[9, 3, 9, 20], logit_bias={20: 1.0, 5: 1e300})
    assert params.allowed_token_ids == (3, 9, 20)
    with pytest.raises(TypeError):
        params.logit_bias[7] = 1.0  # type: ignore[index]
    assert hash(params) == hash(dataclasses.replace(params, logit_bias={1: 2.0}))
    filters = TokenFilters.of(params, V, torch.device("cpu"))  # 20 is beyond V = 16: dropped
    assert filters is not None and filters.allowed.tolist() == [3, 9]
    assert filters.bias_ids.tolist() == [5]
    assert filters.bias_values.item() == torch.finfo(torch.float32).max
    assert TokenFilters.of(SamplingParams(), V, torch.device("cpu")) is None
    both = [dataclasses.replace(params, temperature=0.0), SamplingParams(temperature=0.0)]
    meta = SamplingMetadata.from_params(both, [0, 0], [[], []], [[], []], [[], []], vocab_size=V)
    out = sample(torch.zeros(2, V), meta)
    assert out.sampled_token_ids.tolist() == [3, 0]  # 5 is not allowed: its bias is moot
    # (greedy over equal logits takes the lowest allowed id)


def _nucleus_reference(row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The ids top-k then top-p keep, in float64 over the whole sorted row."""
    ordered, order = row.double().sort(descending=True)
    if top_k > 0:
        ordered[top_k:] = float("-inf")
    probs = ordered.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    keep = ordered > float("-inf")
    if top_p < 1.0:
        keep &= mass_before < top_p
        keep[0] = True
    return set(order[keep].tolist())


def test_top_k_top_p_on_a_large_vocabulary_keep_exactly_the_nucleus() -> None:
    """Rows whose nucleus lies among the largest logits the CPU takes first (a top_k above
    their count among them, and rows with either off), alone and beside rows whose nucleus
    reaches past them (those are sorted whole): each keeps what sorting the whole row in
    float64 keeps, at its own logits."""
    torch.manual_seed(11)
    vocab = 5000
    scales = torch.tensor([[6.0], [0.1], [4.0], [5.0], [3.0], [6.0], [0.3]])
    logits = torch.randn(7, vocab) * scales
    top_k = torch.tensor([0, 0, 300, 40, 0, 7, 0])
    top_p = torch.tensor([0.9, 0.9, 0.95, 1.0, 1.0, 0.5, 0.5])
    for past in (1, 6):
        assert len(_nucleus_reference(logits[past], 0, float(top_p[past]))) > 256
    for rows in ([0, 1, 2, 3, 4, 5, 6], [0, 2, 3, 4, 5], [6, 1]):
        out = _apply_top_k_top_p(logits[rows], top_k[rows], top_p[rows])
        for i, r in enumerate(rows):
            kept = torch.nonzero(out[i] > float("-inf"))[:, 0]
            assert set(kept.tolist()) == _nucleus_reference(
                logits[r], int(top_k[r]), float(top_p[r])
            )
            assert torch.equal(out[i][kept], logits[r][kept])
