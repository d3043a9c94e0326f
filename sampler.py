"""Per-request sampling inside the jitted step.

Every slot carries its own temperature, top_p, top_k, min_p and seed. A slot's random
key is fold_in(key(seed), number of tokens it has generated): a seeded request draws the
same tokens whatever else shares the batch, and after a preemption it resumes the same
stream; ngram speculation verifies with those very draws (rejection_sample).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np

from config import LogprobsKind
from sampling_params import SAMPLING_EPS, SamplingParams

RAW_LOGPROBS = LogprobsKind(raw=True, as_logits=False)  # vLLM's default --logprobs-mode, raw_logprobs


@jax.tree_util.register_dataclass
@dataclass
class SamplingTensors:
    temperature: jax.Array  # [S] f32, 0 = greedy
    top_p: jax.Array  # [S] f32
    top_k: jax.Array  # [S] i32, -1 = off (the engine clips values above the vocabulary to -1)
    min_p: jax.Array  # [S] f32
    seed: jax.Array  # [S] u32 (the engine maps any integer seed into it)
    step: jax.Array  # [S] i32: tokens generated so far (the fold_in counter)
    want_logprobs: jax.Array  # [] bool: compute top-k logprobs this step
    # Structured outputs: bit t % 32 of word t // 32 says whether token t may come next
    # (llguidance's packed layout; all ones for unconstrained rows). use_bitmask says
    # whether any row is constrained, so unconstrained steps skip the unpacking.
    token_bitmask: jax.Array | None = None  # [S, ceil(V / 32)] i32
    use_bitmask: jax.Array | None = None  # [] bool
    # The bitmask raw logprobs see (--logprobs-mode raw_*): a grammar's rows alone, as vLLM
    # applies a grammar before its sampler and the logits processors' masks inside it.
    # The runner passes token_bitmask itself unless a step has both and asks logprobs.
    logprobs_bitmask: jax.Array | None = None  # [S, ceil(V/32)] i32
    # logit_bias and penalties (logits_controls.py), a sparse list of W entries per row:
    # token id (V: padding, dropped), bias added, repetition penalty, then subtracted
    # (frequency * count + presence * seen). None: no row of the step has any, and the
    # program has none of this (a penalised step's program is one per width W).
    penalty_ids: jax.Array | None = None  # [S, W] i32
    penalty_bias: jax.Array | None = None  # [S, W] f32
    penalty_rep: jax.Array | None = None  # [S, W] f32
    penalty_sub: jax.Array | None = None  # [S, W] f32


# The API takes any finite temperature (vLLM's range). XLA divides by one as a multiply by its
# reciprocal, and flushes a subnormal to zero: past ~8.5e37 that is 0, and a masked logit's
# -inf * 0 NaN, which makes the row's draw any token. At 1e30 the reciprocal is normal, and
# a row's distribution already as flat as at any larger temperature.
MAX_TEMPERATURE = 1e30
# The bound of a penalised logit (apply_penalties): still finite after 1/temperature (at most
# 1e6, the floor _scaled divides by), so that no two infinities meet in a softmax (NaN).
PENALIZED_LOGIT_MAX = 1e30


def empty_sampling_arrays(num_slots: int) -> dict[str, np.ndarray]:
    """Host-side arrays for one step; idle slots stay greedy and cost nothing extra."""
    return {
        "temperature": np.zeros(num_slots, np.float32),
        "top_p": np.ones(num_slots, np.float32),
        "top_k": np.full(num_slots, -1, np.int32),
        "min_p": np.zeros(num_slots, np.float32),
        "seed": np.zeros(num_slots, np.uint32),
        "step": np.zeros(num_slots, np.int32),
    }


def fill_slot(arrays: dict[str, np.ndarray], slot: int, params: SamplingParams, seed: int, step: int) -> None:
    arrays["temperature"][slot] = min(params.temperature, MAX_TEMPERATURE)
    arrays["top_p"][slot] = params.top_p
    arrays["top_k"][slot] = params.top_k
    arrays["min_p"][slot] = params.min_p
    arrays["seed"][slot] = seed
    arrays["step"][slot] = step


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """logits [S, V] with every token whose bit is clear in bitmask [S, ceil(V/32)] at -inf."""
    V = logits.shape[1]
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :V].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """logits [S, V] with each row's sparse entries applied, in vLLM's order: logit_bias
    added, then the repetition penalty (a logit > 0 divided by it, else multiplied), then
    frequency * count + presence subtracted. A gather and a scatter of [S, W]: a token not
    listed keeps its logit."""
    S, V = logits.shape
    rows = jnp.arange(S)[:, None]
    x = logits[rows, jnp.minimum(t.penalty_ids, V - 1)] + t.penalty_bias
    x = jnp.where(x > 0, x / t.penalty_rep, x * t.penalty_rep) - t.penalty_sub
    # A repetition penalty near float32's ends overflows the logit to +-inf: +inf ones make the
    # row's softmax NaN, and a -inf one is a mask that can leave no token allowed.
    x = jnp.clip(x, -PENALIZED_LOGIT_MAX, PENALIZED_LOGIT_MAX)
    return logits.at[rows, t.penalty_ids].set(x, mode="drop")


def argmax(x: jax.Array) -> jax.Array:
    """The first index of each row's maximum, as jnp.argmax, from two plain reductions: XLA's
    CPU argmax (one reduction over (value, index) pairs) is not vectorized, 20x slower over a
    vocabulary-wide row."""
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    best = jnp.max(x, axis=-1, keepdims=True)
    # (a NaN row matches nothing: clipped, its index stays a valid token id)
    return jnp.minimum(jnp.min(jnp.where(x == best, iota, x.shape[-1]), axis=-1), x.shape[-1] - 1)


def _gumbel(t: SamplingTensors, V: int) -> jax.Array:
    """[S, V] Gumbel noise in vocabulary order from each row's own key, so a row's draw
    does not depend on which path (sorted or not) its step takes."""
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(t.seed, t.step)
    return jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)


def _filter_sorted(scaled: jax.Array, t: SamplingTensors) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The scaled logits sorted descending, their ids, and which of them the filters keep:
    min_p, top_k, then top_p on the mass the first two leave (vLLM's order)."""
    V = scaled.shape[1]
    sorted_logits, sorted_ids = jax.lax.top_k(scaled, V)  # descending
    rank = jnp.arange(V)[None, :]
    keep = (t.top_k[:, None] < 0) | (rank < t.top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    # min_p before top_p, as vLLM: top_p's mass is measured over what min_p leaves.
    # (p / p_max does not depend on the normalisation, so top-k first changes nothing.)
    keep &= probs >= t.min_p[:, None] * probs[:, :1]
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    # top_p: keep the smallest prefix whose mass reaches top_p, and the first token always
    # (vLLM's "at least one": a top_p such as 1e-50 is 0 in f32, and `< top_p` keeps nothing).
    # top_p = 1 keeps everything: the f32 mass before a far-tail token can round up to 1.
    keep &= (rank == 0) | (t.top_p[:, None] >= 1.0) | ((jnp.cumsum(probs, axis=-1) - probs) < t.top_p[:, None])
    return sorted_logits, sorted_ids, keep


def _sample_filtered(scaled: jax.Array, gumbel: jax.Array, t: SamplingTensors) -> jax.Array:
    """vLLM's order: temperature (already applied), min_p, top_k, then top_p on the mass the
    first two leave; all on one descending sort, then a Gumbel-max draw."""
    sorted_logits, sorted_ids, keep = _filter_sorted(scaled, t)
    filtered = jnp.where(keep, sorted_logits, -jnp.inf)
    choice = argmax(filtered + jnp.take_along_axis(gumbel, sorted_ids, axis=-1))
    return jnp.take_along_axis(sorted_ids, choice[:, None], axis=-1)[:, 0]


def _has_filter(t: SamplingTensors) -> jax.Array:
    return (t.top_k >= 0) | (t.top_p < 1.0) | (t.min_p > 0.0)


def _scaled(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    return logits / jnp.maximum(t.temperature, 1e-6)[:, None]


def _sample_random(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """A draw per row at its temperature (_sample_rows_drawn calls it on one row). The
    full-vocabulary sort (seconds on a CPU) runs only when a row has a top_k, top_p or
    min_p filter; without one, Gumbel-max over the scaled logits draws from the same
    distribution, with the same noise."""
    scaled, gumbel = _scaled(logits, t), _gumbel(t, logits.shape[1])
    return jax.lax.cond(jnp.any(_has_filter(t)), lambda: _sample_filtered(scaled, gumbel, t),
                        lambda: argmax(scaled + gumbel))


def _sample_rows_drawn(logits: jax.Array, t: SamplingTensors, is_greedy: jax.Array) -> jax.Array:
    """[S] the draws of the rows that are not greedy (the greedy rows' entries are
    meaningless). A row under a filter is drawn alone, its own sort; the rows without one
    are drawn all at once (Gumbel-max, no sort) when they are more than half the rows,
    else each alone too: one sampled row among greedy ones costs one row's Gumbel noise,
    not S rows'. A row draws the same token either way (its own key, its noise in
    vocabulary order: _gumbel), and the program traces one row's sort, not one for every
    shape it samples (the sort path is most of the sample program's compile)."""
    S, V = logits.shape
    filtered = _has_filter(t) & ~is_greedy
    plain = ~is_greedy & ~filtered
    batched = 2 * jnp.sum(plain) > S
    tok = jax.lax.cond(batched, lambda: argmax(_scaled(logits, t) + _gumbel(t, V)).astype(jnp.int32),
                       lambda: jnp.zeros(S, jnp.int32))
    alone = filtered | (plain & ~batched)
    order = jnp.argsort(~alone, stable=True)  # the rows drawn alone first

    def row(i: jax.Array, tok: jax.Array) -> jax.Array:
        one = jax.tree.map(lambda x: x if x.ndim == 0 else jax.lax.dynamic_slice_in_dim(x, order[i], 1), (logits, t))
        return jax.lax.dynamic_update_slice_in_dim(tok, _sample_random(*one).astype(jnp.int32), order[i], 0)

    return jax.lax.fori_loop(0, jnp.sum(alone), row, tok)


def sample(logits: jax.Array, t: SamplingTensors, mode: LogprobsKind = RAW_LOGPROBS,
           width: int = 20) -> tuple[jax.Array, ...]:
    """logits [S, V] f32 -> (token [S], its logprob [S], its rank [S], top ids [S, width],
    top logprobs [S, width]).

    Steps where every slot is greedy draw nothing (lax.cond), and only rows with a top_k,
    top_p or min_p filter sort. No lax.cond here returns the [S, V] logits (a branch
    that hands back its vocabulary-wide operand costs a copy of it on a CPU), so the bitmask
    selects between two whole samplers, whose outputs are small. logit_bias and penalties
    (a step that has them) come before the bitmask. The logprobs are those of `mode`
    (a config.LogprobsKind, static: one program per engine); the defaults are vLLM's, and so
    is the rank: the tokens at least as likely as the sampled one under them, itself included."""
    raw = logits
    if t.penalty_ids is not None:
        logits = apply_penalties(logits, t)
    if t.token_bitmask is None:
        return _sample_unmasked(logits, t, raw, None, mode, width)
    raw_mask = t.token_bitmask if t.logprobs_bitmask is None else t.logprobs_bitmask
    return jax.lax.cond(t.use_bitmask,
                        lambda: _sample_unmasked(apply_token_bitmask(logits, t.token_bitmask), t, raw, raw_mask, mode,
                                                 width),
                        lambda: _sample_unmasked(logits, t, raw, None, mode, width))


def sample_rows(logits: jax.Array, t: SamplingTensors, num_rows: jax.Array, chunk: int,
                mode: LogprobsKind = RAW_LOGPROBS, width: int = 20) -> tuple[jax.Array, ...]:
    """sample() on the first num_rows rows of logits [S, V] (S a multiple of chunk), chunk
    rows at a time: one program serves every row count, and its cost follows the rows
    that sample, not S (the trip count is dynamic; rows past the last chunk come back 0).
    Each chunk takes its own branches (all greedy, a filter, the bitmask: only a chunk
    with a constrained row unpacks it), and a chunk's [chunk, V] temporaries stay in cache."""
    S, V = logits.shape
    assert S % chunk == 0, (S, chunk)
    outs = (jnp.zeros(S, jnp.int32), jnp.zeros(S, jnp.float32), jnp.zeros(S, jnp.int32),
            jnp.zeros((S, width), jnp.int32), jnp.zeros((S, width), jnp.float32))

    def body(i: jax.Array, outs: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        rows = jax.tree.map(lambda x: x if x.ndim == 0 else jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk),
                            (logits, t))
        x, tc = rows
        if tc.token_bitmask is not None:  # all ones: no row of the chunk is constrained
            tc = replace(tc, use_bitmask=tc.use_bitmask & jnp.any(tc.token_bitmask != -1))
        return tuple(jax.lax.dynamic_update_slice_in_dim(o, r, i * chunk, 0)
                     for o, r in zip(outs, sample(x, tc, mode, width)))

    return jax.lax.fori_loop(0, (num_rows + chunk - 1) // chunk, body, outs)


def _draw(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """[S] the token each row draws at output index t.step: its argmax if greedy, else the
    Gumbel-max draw of its seed's noise for that index. sample() and the verification of
    deterministic proposals both draw through here, so a seeded row's token at an index is
    one function of its logits there, whichever step computes it."""
    greedy_tok = argmax(logits).astype(jnp.int32)
    is_greedy = t.temperature < SAMPLING_EPS
    return jax.lax.cond(jnp.all(is_greedy), lambda: greedy_tok,
                        lambda: jnp.where(is_greedy, greedy_tok, _sample_rows_drawn(logits, t, is_greedy)))


def _sample_unmasked(logits: jax.Array, t: SamplingTensors, raw: jax.Array, raw_mask: jax.Array | None,
                     mode: LogprobsKind,
                     width: int) -> tuple[jax.Array, ...]:
    """Draw from logits (processed but for temperature and the filters); logprobs, when the
    step wants them, from raw (the model's, raw_mask applied when given) or from logits."""
    tok = _draw(logits, t)
    S = logits.shape[0]

    def logprobs() -> tuple[jax.Array, ...]:
        if mode.raw:
            return token_logprobs(raw if raw_mask is None else apply_token_bitmask(raw, raw_mask), tok,
                                  mode.as_logits, width)
        return _processed_top(logits, t, tok, mode, width)

    def no_logprobs() -> tuple[jax.Array, ...]:
        return (jnp.zeros((S,), jnp.float32), jnp.zeros((S,), jnp.int32), jnp.zeros((S, width), jnp.int32),
                jnp.zeros((S, width), jnp.float32))

    return (tok, *jax.lax.cond(t.want_logprobs, logprobs, no_logprobs))


def token_logprobs(x: jax.Array, tok: jax.Array, as_logits: bool, width: int) -> tuple[jax.Array, ...]:
    """(value of tok [S], its rank [S], top ids [S, width], top values [S, width]) of x
    [S, V], as logits (as_logits: mode *_logits) or as logprobs (log_softmax): sampled,
    verified and prompt tokens' logprobs alike."""
    if not as_logits:
        x = jax.nn.log_softmax(x, axis=-1)
    top_v, top_ids = jax.lax.top_k(x, width)
    value = jnp.take_along_axis(x, tok[:, None], axis=-1)[:, 0]
    # vLLM's rank: the tokens at least as likely, itself included (ties count against it)
    rank = jnp.sum(x >= value[:, None], axis=-1).astype(jnp.int32)
    return value, rank, top_ids.astype(jnp.int32), top_v


def _processed_top(logits: jax.Array, t: SamplingTensors, tok: jax.Array, mode: LogprobsKind,
                   width: int) -> tuple[jax.Array, ...]:
    """token_logprobs of vLLM's processed logits: each row's at its temperature with the tokens min_p,
    top_k and top_p filter out at -inf, the logits a row draws from; a greedy row's as they
    are (vLLM clears a greedy request's filters). The sort only when a random row filters."""
    is_greedy = t.temperature < SAMPLING_EPS
    scaled = logits / jnp.where(is_greedy, 1.0, jnp.maximum(t.temperature, 1e-6))[:, None]

    def filtered() -> tuple[jax.Array, ...]:
        S, V = scaled.shape
        _, sorted_ids, keep = _filter_sorted(scaled, t)
        kept = jnp.zeros((S, V), bool).at[jnp.arange(S)[:, None], sorted_ids].set(keep | is_greedy[:, None])
        return token_logprobs(jnp.where(kept, scaled, -jnp.inf), tok, mode.as_logits, width)

    return jax.lax.cond(jnp.any(_has_filter(t) & ~is_greedy), filtered,
                        lambda: token_logprobs(scaled, tok, mode.as_logits, width))


# ---- speculative decoding: verification (spec_decode.py proposes) -----------------------

def filtered_probs(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """[S, V] the distribution a random row samples from, in vocabulary order: the
    filters of _sample_random (temperature, min_p, top_k, then top_p on what the first
    two leave), renormalised. Greedy rows get the one-hot of their argmax."""
    S, V = logits.shape
    sorted_logits, sorted_ids, keep = _filter_sorted(_scaled(logits, t), t)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    out = jnp.zeros((S, V), jnp.float32).at[jnp.arange(S)[:, None], sorted_ids].set(probs)
    greedy = jax.nn.one_hot(argmax(logits), V, dtype=jnp.float32)
    return jnp.where((t.temperature < SAMPLING_EPS)[:, None], greedy, out)


def _at_positions(t: SamplingTensors, K1: int) -> SamplingTensors:
    """[R * K1] each row's parameters at its K1 run positions (row-major), "step" the output
    index of each: a position draws its index's randomness, whichever step verifies it."""
    rep = lambda x: jnp.repeat(x, K1)  # noqa: E731
    step = (t.step[:, None] + jnp.arange(K1, dtype=t.step.dtype)[None, :]).reshape(-1)
    return SamplingTensors(rep(t.temperature), rep(t.top_p), rep(t.top_k), rep(t.min_p), rep(t.seed), step,
                           t.want_logprobs)


def rejection_sample(logits: jax.Array, draft: jax.Array, num_draft: jax.Array, t: SamplingTensors,
                     draft_probs: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Verify R rows of proposals: logits [R, K+1, V] the target's at the row's last known
    token and at each of its K draft tokens draft [R, K] (num_draft [R] of them real);
    t holds each row's sampling parameters ([R]; step = index of its first emitted token).

    Returns (tokens [R, K+1], num_emitted [R] in 1..num_draft+1): the accepted drafts,
    then one token of the target's, every emitted token distributed as non-speculative
    sampling draws it. Greedy rows accept while the draft is the argmax and emit the
    argmax after, token for token what greedy decoding emits.

    Deterministic proposals (draft_probs None: q_j one-hot at the draft x_j, ngram): each
    position j draws t_j exactly as sample() draws output index step + j (_draw: the
    seed's Gumbel noise for that index over the filtered logits); draft j is accepted iff
    t_j == x_j, which has probability p_j(x_j) = min(1, p_j(x_j) / q_j(x_j)), the standard
    test; at the first mismatch t_j is emitted, distributed as p_j without x_j, which is
    the residual norm(max(p_j - q_j, 0)); after all are accepted the bonus is t_num_draft.
    So every emitted token is, given the same logits, the very token plain seeded decoding
    emits at its index: how many drafts a step verifies changes nothing.

    Draft distributions (draft_probs [R, K, V], a draft model): standard rejection
    sampling (Leviathan et al. 2023, Chen et al. 2023): draft j is accepted with probability
    min(1, p_j(x) / q_j(x)) under the target's filtered p_j, at the first rejection the
    token comes from norm(max(p_j - q_j, 0)), after all acceptances from p (the bonus, with
    the Gumbel noise plain decoding draws its index with). The uniform of the test and the
    residual's noise are keyed by the absolute output index, not by the run's first one."""
    R, K1, V = logits.shape
    K = K1 - 1
    real = jnp.arange(K)[None, :] < num_draft[:, None]
    jj = jnp.arange(K1)[None, :]
    at = _at_positions(t, K1)
    flat = logits.reshape(R * K1, V)

    def leading(ok: jax.Array) -> jax.Array:  # the count of leading Trues of each row
        return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)

    if draft_probs is None:
        drawn = _draw(flat, at).reshape(R, K1)
        accepted = leading((drawn[:, :K] == draft) & real)
        return jnp.where(jj <= accepted[:, None], drawn, 0).astype(jnp.int32), accepted + 1

    def greedy_only() -> tuple[jax.Array, jax.Array]:
        best = argmax(logits).astype(jnp.int32)  # [R, K+1]
        return best, leading((draft == best[:, :K]) & real)

    def with_random() -> tuple[jax.Array, jax.Array]:
        p = filtered_probs(flat, at).reshape(R, K1, V)
        px = jnp.take_along_axis(p[:, :K], draft[:, :, None], axis=-1)[:, :, 0]
        q = draft_probs[:R]
        qx = jnp.take_along_axis(q, draft[:, :, None], axis=-1)[:, :, 0]
        keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(at.seed, at.step)  # [R*K1, 2]
        u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1), (), jnp.float32))(keys)
        accepted = leading((u.reshape(R, K1)[:, :K] * qx < px) & real)  # P(u < p/q) = min(1, p/q); p = 0 never
        # The token after the accepted run: from the residual at a rejection, else the bonus.
        rows = jnp.arange(R)
        a = rows * K1 + accepted  # its flat position
        p_a, q_a = p[rows, accepted], jnp.pad(q, ((0, 0), (0, 1), (0, 0)))[rows, accepted]
        rejected = accepted < num_draft
        resid = jnp.where(rejected[:, None], jnp.maximum(p_a - q_a, 0.0), p_a)
        # p == q exactly leaves no residual mass, and then nothing is ever rejected; guard the log.
        resid = jnp.where(jnp.sum(resid, axis=-1, keepdims=True) > 0, resid, p_a)
        # The bonus takes the noise plain decoding draws its index with; a residual, fold 2 of it.
        noise = jnp.where(rejected[:, None], jax.vmap(lambda k: jax.random.fold_in(k, 2))(keys[a]), keys[a])
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(noise)
        extra = jnp.argmax(jnp.where(resid > 0, jnp.log(resid), -jnp.inf) + gumbel, axis=-1).astype(jnp.int32)
        padded = jnp.pad(draft, ((0, 0), (0, 1)))
        tokens = jnp.where(jj < accepted[:, None], padded, jnp.where(jj == accepted[:, None], extra[:, None], 0))
        g_tok, g_acc = greedy_only()
        is_greedy = t.temperature < SAMPLING_EPS
        return jnp.where(is_greedy[:, None], g_tok, tokens), jnp.where(is_greedy, g_acc, accepted)

    tokens, accepted = jax.lax.cond(jnp.all(t.temperature < SAMPLING_EPS), greedy_only, with_random)
    return tokens.astype(jnp.int32), accepted + 1


def emitted_logprobs(logits: jax.Array, tokens: jax.Array, t: SamplingTensors, want: jax.Array,
                     mode: LogprobsKind = RAW_LOGPROBS, width: int = 20) -> tuple[jax.Array, ...]:
    """The target's logprobs of tokens [R, K+1] under logits [R, K+1, V], their ranks and
    the top `width` at each position (zeros unless `want`), as sample() reports them in `mode`
    (t: the rows' parameters, [R]; a verified row has no logits processor or bitmask)."""
    R, K1, V = logits.shape
    flat, toks = logits.reshape(R * K1, V), tokens.reshape(R * K1)

    def compute() -> tuple[jax.Array, ...]:
        if mode.raw:
            out = token_logprobs(flat, toks, mode.as_logits, width)
        else:
            out = _processed_top(flat, _at_positions(t, K1), toks, mode, width)
        return tuple(x.reshape(R, K1, *x.shape[1:]) for x in out)

    def skip() -> tuple[jax.Array, ...]:
        return (jnp.zeros((R, K1), jnp.float32), jnp.zeros((R, K1), jnp.int32), jnp.zeros((R, K1, width), jnp.int32),
                jnp.zeros((R, K1, width), jnp.float32))

    return jax.lax.cond(want, compute, skip)
