"""Sampling draws from the distribution it claims to, in vLLM's order.

On fixed logits, N = 10^4 draws of `sampler.sample` (one per (seed, step) pair, as the
engine folds them) are compared with the exact filtered distribution computed in float64:
temperature, then min_p, top_k and top_p (vLLM v1's order: min_p is a logits processor
applied before its top-k/top-p sampler). The threshold is derived from the multinomial
noise, not guessed: Pearson's chi-square statistic over the kept tokens follows a
chi-square law with (kept - 1) degrees of freedom, so a correct sampler exceeds its
1 - 1e-6 quantile once in a million runs (and the draws are seeded: a pass is stable).
A token outside the filtered set must never be drawn at all. (That a seeded request
resumes its stream after a preemption is checked in test_engine's preemption test.)"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from scipy import stats

from config import LOGPROBS_MODES
from sampler import SamplingTensors, _filter_sorted, argmax, empty_sampling_arrays, sample, sample_rows

N = 10_000
ALPHA = 1e-6
# Distinct values, not in sorted order (the sampler sorts: token ids must map back); a
# vocabulary of 24 (at least MAX_LOGPROBS), half of it a low tail.
LOGITS = np.array([2.0, -0.5, 3.0, 1.0, 2.2, 0.0, 2.5, -1.0, 1.5, -3.0, 0.5, -2.0,
                   -3.5, -2.5, -4.0, -1.5, -4.5, -2.2, -5.0, -3.2, -5.5, -2.8, -6.0, -3.8], np.float32)
VLLM_ORDER = ("min_p", "top_k", "top_p")


def exact(logits: np.ndarray, temperature: float, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0,
          order: tuple[str, ...] = VLLM_ORDER) -> np.ndarray:
    """The filtered distribution in float64: each filter sees the distribution the
    previous ones left (renormalised)."""
    z = logits.astype(np.float64) / temperature
    keep = np.ones(len(z), bool)

    def probs() -> np.ndarray:
        e = np.where(keep, np.exp(z - z[keep].max()), 0.0)
        return e / e.sum()

    for f in order:
        p = probs()
        ranked = np.argsort(-p, kind="stable")
        if f == "min_p":
            keep &= p >= min_p * p.max()
        elif f == "top_k" and top_k > 0:
            keep[ranked[top_k:]] = False
        elif f == "top_p":  # the smallest prefix whose mass reaches top_p (vLLM: mass before < top_p)
            before = np.cumsum(p[ranked]) - p[ranked]
            keep[ranked[before >= top_p]] = False
    return probs()


_sample = jax.jit(sample)


def draw(logits: np.ndarray, n: int = N, step: int = 0, **params) -> np.ndarray:
    """n draws on the same logits, row i with seed i (the engine's per-request stream)."""
    arrays = empty_sampling_arrays(n)
    for name, value in params.items():
        arrays[name][:] = value
    arrays["seed"][:] = np.arange(n, dtype=np.uint32)
    arrays["step"][:] = step
    t = SamplingTensors(**arrays, want_logprobs=np.bool_(False))
    return np.asarray(_sample(np.broadcast_to(logits, (n, len(logits))).copy(), t)[0])


def chi_square(counts: np.ndarray, p: np.ndarray) -> tuple[float, float]:
    """(Pearson's statistic over the kept tokens, its 1 - ALPHA quantile). Tokens expected
    fewer than 20 times are pooled into one bin, where the chi-square law holds."""
    kept = p > 0
    expected, observed = counts.sum() * p[kept], counts[kept]
    rare = expected < 20
    if rare.any():
        expected = np.append(expected[~rare], expected[rare].sum())
        observed = np.append(observed[~rare], observed[rare].sum())
    stat = float(((observed - expected) ** 2 / expected).sum())
    return stat, float(stats.chi2.isf(ALPHA, df=len(expected) - 1))


CASES = {  # name: (params, how many tokens the filters keep)
    "temperature": (dict(temperature=0.7), 24),
    "hot temperature": (dict(temperature=2.0), 24),
    "top_k": (dict(temperature=1.0, top_k=4), 4),
    "top_p": (dict(temperature=1.0, top_p=0.8), 4),
    "min_p": (dict(temperature=1.0, min_p=0.2), 5),
    # min_p binds harder than top_k: top_p must see min_p's renormalised mass (vLLM order)
    "min_p, then top_p": (dict(temperature=2.0, top_k=8, top_p=0.8, min_p=0.5), 3),
    # top_k binds harder than min_p, top_p after both
    "all four": (dict(temperature=1.5, top_k=6, top_p=0.9, min_p=0.1), 5),
}


@pytest.mark.parametrize("name", list(CASES))
def test_draws_follow_the_exact_filtered_distribution(name):
    params, num_kept = CASES[name]
    p = exact(LOGITS, **params)
    assert (p > 0).sum() == num_kept, "the case exercises the filter it names"
    counts = np.bincount(draw(LOGITS, **params), minlength=len(LOGITS))
    assert not counts[p == 0].any(), f"drew filtered-out tokens: {np.flatnonzero(counts * (p == 0))}"
    stat, limit = chi_square(counts, p)
    assert stat <= limit, f"chi-square {stat:.1f} > {limit:.1f}: {counts / N} vs {p}"


def test_top_p_one_keeps_the_far_tail_that_float32_mass_rounds_away():
    """One dominant token: in f32 the mass before each tail token rounds to exactly 1, so a
    plain `mass before < top_p` would drop the whole tail at top_p = 1. The float64 reference
    keeps it; so must the sampler (top_p = 1 filters nothing, as in vLLM)."""
    logits = np.array([0.0] + [-30.0] * 23, np.float32)
    params = dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=1e-20)  # a filter: the sorted path
    arrays = empty_sampling_arrays(1)
    for name, value in params.items():
        arrays[name][:] = value
    t = SamplingTensors(**arrays, want_logprobs=np.bool_(False))
    _, ids, keep = _filter_sorted(logits[None] / params["temperature"], t)
    kept = np.zeros(len(logits), bool)
    kept[np.asarray(ids)[0][np.asarray(keep)[0]]] = True
    np.testing.assert_array_equal(kept, exact(logits, **params) > 0)
    assert kept.all()


def test_the_order_is_vllms_and_the_test_would_see_another():
    """With top_p before min_p (vLLM v0's order) the same parameters keep a fourth token
    with ~0.2 of the mass: the draws reject that distribution by far."""
    params = CASES["min_p, then top_p"][0]
    other = exact(LOGITS, **params, order=("top_k", "top_p", "min_p"))
    assert (other > 0).sum() == 4
    counts = np.bincount(draw(LOGITS, **params), minlength=len(LOGITS))
    assert counts[other > 0].min() == 0  # the token only the other order keeps never comes out
    stat, limit = chi_square(counts + (other > 0), other)  # +1: a defined statistic
    assert stat > 10 * limit


def test_the_step_counter_gives_fresh_draws_of_the_same_distribution():
    params = CASES["all four"][0]
    a, b = draw(LOGITS, step=0, **params), draw(LOGITS, step=1, **params)
    assert (a != b).mean() > 0.3  # independent streams, not one replayed
    stat, limit = chi_square(np.bincount(b, minlength=len(LOGITS)), exact(LOGITS, **params))
    assert stat <= limit


def test_temperature_zero_rows_in_a_mixed_batch_are_the_argmax():
    rng = np.random.default_rng(0)
    S, V = 64, 50
    logits = rng.standard_normal((S, V)).astype(np.float32)
    arrays = empty_sampling_arrays(S)
    hot = np.arange(S) % 2 == 1  # every other row samples, hot, with no filter
    arrays["temperature"][hot] = 5.0
    arrays["seed"][:] = np.arange(S)
    tok = np.asarray(_sample(logits, SamplingTensors(**arrays, want_logprobs=np.bool_(True)))[0])
    np.testing.assert_array_equal(tok[~hot], logits[~hot].argmax(-1))
    assert (tok[hot] != logits[hot].argmax(-1)).sum() >= S // 4  # the sampling rows did sample



def test_a_row_draws_the_same_token_with_its_batch_or_alone_whatever_its_neighbours_filter():
    """Unfiltered rows are drawn together when they are most of the step, else each alone;
    a filtered row is always drawn alone, with its own sort. A row's seeded draw must not
    depend on which of those happened, so every path uses the row's own noise."""
    rng = np.random.default_rng(1)
    S, V = 256, 40
    logits = rng.standard_normal((S, V)).astype(np.float32)
    arrays = empty_sampling_arrays(S)
    arrays["temperature"][:] = 1.3
    arrays["seed"][:] = np.arange(S)

    def draw() -> np.ndarray:
        return np.asarray(_sample(logits, SamplingTensors(**arrays, want_logprobs=np.bool_(False)))[0])

    together = draw()  # every row unfiltered and drawing: one batched draw
    arrays["top_k"][0] = 3  # row 0 filters: drawn alone, the others still together
    mixed = draw()
    np.testing.assert_array_equal(mixed[1:], together[1:])
    assert mixed[0] in np.argsort(-logits[0])[:3]
    arrays["temperature"][S // 4:] = 0.0  # now the drawing rows are a quarter: each drawn alone
    few = draw()
    np.testing.assert_array_equal(few[1:S // 4], together[1:S // 4])
    assert few[0] == mixed[0]
    np.testing.assert_array_equal(few[S // 4:], logits[S // 4:].argmax(-1))
    assert (together != logits.argmax(-1)).sum() >= S // 4  # they did sample


def test_the_sample_programs_chunks_draw_each_row_as_the_whole_batch_does():
    """sample_rows (the runner's sample program: chunks of rows up to a row count known on
    the device; a chunk's few sampled rows among greedy ones drawn one by one) draws each
    row's token as sample() does with every row of the batch sampled together (the path
    the distribution tests above check); rows past the last chunk come back 0."""
    rng = np.random.default_rng(3)
    S, V, C = 24, 40, 8
    logits = 2 * rng.standard_normal((S, V)).astype(np.float32)
    arrays = empty_sampling_arrays(S)
    arrays["temperature"][:] = 1.1
    arrays["seed"][:] = np.arange(S)
    arrays["step"][:] = 5
    arrays["top_k"][::3] = 4  # filtered rows in every chunk
    whole = np.asarray(_sample(logits, SamplingTensors(**arrays, want_logprobs=np.bool_(False)))[0])
    greedy = np.ones(S, bool)
    greedy[[1, 6]] = False  # chunk 0: two sampled rows (row 6 filtered), drawn alone
    greedy[8:16] = False  # chunk 1: all its rows drawn together
    arrays["temperature"][greedy] = 0.0
    t = SamplingTensors(**arrays, want_logprobs=np.bool_(False))
    got = np.asarray(jax.jit(sample_rows, static_argnums=3)(logits, t, np.int32(13), C)[0])
    np.testing.assert_array_equal(got[:16], np.where(greedy, logits.argmax(-1), whole)[:16])
    assert (got[16:] == 0).all()  # the third chunk is past row 13: not sampled
    assert (whole[[1, 6]] != logits[[1, 6]].argmax(-1)).any() or (whole[8:16] != logits[8:16].argmax(-1)).sum() >= 2


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_a_sampled_tokens_rank_counts_the_tokens_at_least_as_likely_in_the_modes_distribution(mode):
    """vLLM's rank of a sampled token (batched_count_greater_than): the tokens whose value
    in the mode's distribution is at least the token's, itself included, so ties count
    against it. Integer logits tie often and stay exact under a temperature of 0.5 and
    log_softmax; a filtered row's top_k ends between two values, so NumPy knows its kept set."""
    rng = np.random.default_rng(5)
    S, V, C = 16, 40, 8
    logits = rng.integers(-3, 3, (S, V)).astype(np.float32)
    arrays = empty_sampling_arrays(S)
    arrays["temperature"][:] = np.where(np.arange(S) % 2, 0.5, 0.0)  # odd rows random, even greedy
    arrays["seed"][:] = np.arange(S)
    filtered = np.arange(S) % 4 == 1
    arrays["top_k"][filtered] = (logits >= logits.max(-1, keepdims=True) - 1).sum(-1)[filtered]
    t = SamplingTensors(**arrays, want_logprobs=np.bool_(True))
    tok, lp, rank = (np.asarray(x) for x in jax.jit(sample_rows, static_argnums=(3, 4, 5))(
        logits, t, np.int32(S), C, LOGPROBS_MODES[mode], 4)[:3])
    x = logits.astype(np.float64)
    if mode.startswith("processed"):
        x = np.where(arrays["temperature"][:, None] > 0, x / 0.5, x)
        x[filtered] = np.where(logits[filtered] >= logits[filtered].max(-1, keepdims=True) - 1, x[filtered], -np.inf)
    if mode.endswith("logprobs"):
        m = x.max(-1, keepdims=True)
        x = x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))
    value = x[np.arange(S), tok]
    np.testing.assert_allclose(lp, value, rtol=1e-5, atol=1e-5)
    want = (x >= value[:, None]).sum(-1)
    np.testing.assert_array_equal(rank, want)
    assert (want[::2] > 1).any() and (want[1::2] > 1).any()  # ties with a greedy and a drawn token


def test_argmax_is_numpys_first_index_of_the_maximum():
    x = np.random.default_rng(2).integers(0, 4, (64, 300)).astype(np.float32)  # many ties
    x[3] = -np.inf  # a fully masked row: index 0, as numpy
    x[5, 7:] = np.inf
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(x)), x.argmax(-1))


def test_a_top_p_that_float32_rounds_to_zero_still_keeps_the_most_likely_token():
    """vLLM keeps at least one token whatever top_p. 1e-50 is a valid top_p (0 < top_p <= 1)
    that is 0 in float32, where `mass before < top_p` holds for no token: the filter must
    still keep the most likely one, NumPy's argmax, alone at probability 1, for the draw,
    the processed logprobs (0 for it, -inf for the rest) and a draft model's verification."""
    from sampler import filtered_probs, rejection_sample

    logits = np.stack([LOGITS, LOGITS[::-1]])
    best = logits.argmax(-1)
    assert (best != 0).all()  # (a filter that keeps nothing ends up at token 0)
    arrays = empty_sampling_arrays(2)
    arrays["temperature"][:] = 0.8
    arrays["top_p"][:] = 1e-50
    arrays["seed"][:] = [3, 4]
    t = SamplingTensors(**arrays, want_logprobs=np.bool_(True))
    tok, tok_lp, rank, ids, top = (np.asarray(x) for x in sample(logits, t, LOGPROBS_MODES["processed_logprobs"], 3))
    np.testing.assert_array_equal(tok, best)
    np.testing.assert_array_equal(tok_lp, [0.0, 0.0])
    np.testing.assert_array_equal(ids[:, 0], best)
    np.testing.assert_array_equal(top, [[0.0, -np.inf, -np.inf]] * 2)
    np.testing.assert_array_equal(rank, [1, 1])
    np.testing.assert_array_equal(np.asarray(filtered_probs(logits, t)), np.eye(len(LOGITS))[best])
    # a draft model proposing the best token (row 0: accepted, then the bonus) or another one
    # (row 1: rejected, the residual's token), each with a uniform draft distribution
    draft = np.array([[best[0]], [(best[1] + 1) % len(LOGITS)]], np.int32)
    q = np.full((2, 1, len(LOGITS)), 1.0 / len(LOGITS), np.float32)
    tokens, num = rejection_sample(np.stack([logits, logits], 1), draft, np.array([1, 1]), t, q)
    np.testing.assert_array_equal(np.asarray(num), [2, 1])
    assert np.asarray(tokens)[0].tolist() == [best[0], best[0]] and np.asarray(tokens)[1, 0] == best[1]
