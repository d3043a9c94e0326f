"""Per-request sampling inside the jitted step.

Every slot carries its own temperature, top_p, top_k, min_p and seed. A slot's random
key is fold_in(key(seed), number of tokens it has generated): a seeded request draws the
same tokens whatever else shares the batch, and after a preemption it resumes the same
stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from config import MAX_LOGPROBS, SAMPLING_EPS, SamplingParams


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
    arrays["temperature"][slot] = params.temperature
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


def _sample_filtered(scaled: jax.Array, gumbel: jax.Array, t: SamplingTensors) -> jax.Array:
    """vLLM's order: temperature (already applied), min_p, top_k, then top_p on the mass the
    first two leave; all on one descending sort, then a Gumbel-max draw."""
    V = scaled.shape[1]
    sorted_logits, sorted_ids = jax.lax.top_k(scaled, V)  # descending
    rank = jnp.arange(V)[None, :]
    keep = (t.top_k[:, None] < 0) | (rank < t.top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    # min_p before top_p, as vLLM: top_p's mass is measured over what min_p leaves.
    # (p / p_max does not depend on the normalisation, so top-k first changes nothing.)
    keep &= probs >= t.min_p[:, None] * probs[:, :1]
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    # top_p: keep the smallest prefix whose mass reaches top_p (the first token always).
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < t.top_p[:, None]
    filtered = jnp.where(keep, sorted_logits, -jnp.inf)
    choice = argmax(filtered + jnp.take_along_axis(gumbel, sorted_ids, axis=-1))
    return jnp.take_along_axis(sorted_ids, choice[:, None], axis=-1)[:, 0]


def _sample_random(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """A draw per row at its temperature. The full-vocabulary sort (seconds on a CPU) runs
    only in steps where some row has a top_k, top_p or min_p filter; without one, Gumbel-max
    over the scaled logits draws from the same distribution, with the same noise."""
    S, V = logits.shape
    scaled = logits / jnp.maximum(t.temperature, 1e-6)[:, None]
    gumbel = _gumbel(t, V)
    no_filter = (t.top_k < 0) & (t.top_p >= 1.0) & (t.min_p <= 0.0)
    return jax.lax.cond(jnp.all(no_filter), lambda: argmax(scaled + gumbel),
                        lambda: _sample_filtered(scaled, gumbel, t))


def sample(logits: jax.Array, t: SamplingTensors) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """logits [S, V] f32 -> (token [S], its logprob [S], top ids [S, K], top logprobs [S, K]).

    Steps where every slot is greedy draw nothing (lax.cond), and steps without a top_k,
    top_p or min_p filter sort nothing. No lax.cond here returns the [S, V] logits (a branch
    that hands back its vocabulary-wide operand costs a copy of it on a CPU), so the bitmask
    selects between two whole samplers, whose outputs are small."""
    if t.token_bitmask is None:
        return _sample_unmasked(logits, t)
    return jax.lax.cond(t.use_bitmask, lambda: _sample_unmasked(apply_token_bitmask(logits, t.token_bitmask), t),
                        lambda: _sample_unmasked(logits, t))


def _sample_unmasked(logits: jax.Array, t: SamplingTensors) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    greedy_tok = argmax(logits).astype(jnp.int32)
    is_greedy = t.temperature < SAMPLING_EPS
    tok = jax.lax.cond(jnp.all(is_greedy), lambda: greedy_tok,
                       lambda: jnp.where(is_greedy, greedy_tok, _sample_random(logits, t).astype(jnp.int32)))
    S = logits.shape[0]

    def logprobs():
        lp = jax.nn.log_softmax(logits, axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
        return jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    def no_logprobs():
        return (jnp.zeros((S,), jnp.float32), jnp.zeros((S, MAX_LOGPROBS), jnp.int32),
                jnp.zeros((S, MAX_LOGPROBS), jnp.float32))

    tok_lp, top_ids, top_lp = jax.lax.cond(t.want_logprobs, logprobs, no_logprobs)
    return tok, tok_lp, top_ids, top_lp
