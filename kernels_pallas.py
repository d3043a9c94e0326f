"""Paged attention over the block-structured KV cache: pure-jnp references (this part)
and Pallas kernels with the same signatures.

KV cache layout, per layer: k_cache, v_cache of shape [num_blocks, block_size,
num_kv_heads, head_dim]. Block 0 is the null block: idle slots and padding tokens point
at it, and every read of it is masked.

Two entry points, used by model.py through `AttentionBackend`:
  decode(q[S,Hq,D], k_cache, v_cache, block_tables[S,W], kv_lens[S])            -> [S,Hq,D]
      one query token per slot, at position kv_lens[s]-1; kv_lens[s] == 0 is an idle slot.
  ragged(q[T,Hq,D], k_cache, v_cache, block_tables[S,W], cu_q_lens[S+1], kv_lens[S]) -> [T,Hq,D]
      flattened query tokens; sequence s owns q rows cu_q_lens[s]:cu_q_lens[s+1] (q_len may
      be 0), which sit at the last q_len positions of its kv_lens[s] context (the step's
      own K/V is written to the cache before attention). Causal. Rows at or past
      cu_q_lens[S] are padding and come back as zeros.

The references loop over the context in groups of blocks with a *traced* trip count
(the longest kv_len in the step), with an online softmax (m, l, acc in f32): the cost
follows the tokens actually in context, not the block table's width, and one compiled
program serves every context length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

# A large finite negative rather than -inf: exp(NEG - NEG) stays finite for rows that
# are fully masked so far, and the where() below zeroes them.
NEG_INF = -1e30


def _online_softmax_step(m, l, acc, s, mask, v, eq_pv: str):
    """One online-softmax update. s: scores with the key axis last; mask broadcastable to s."""
    s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + p.sum(-1)
    acc = acc * corr[..., None] + jnp.einsum(eq_pv, p, v)
    return m_new, l, acc


def _group_size(rows: int, block_size: int, num_kv_heads: int, head_dim: int, width: int) -> int:
    """Blocks per loop iteration: big enough to amortise the loop, small enough that the
    gathered K/V of one iteration stays around 32 MiB."""
    per_block = rows * block_size * num_kv_heads * head_dim * 4
    g = max(1, min(16, (32 << 20) // max(per_block, 1)))
    return min(1 << (g.bit_length() - 1), max(width, 1))


def _pad_cols(block_tables: jax.Array, g: int) -> jax.Array:
    w = block_tables.shape[1]
    pad = (-w) % g
    return jnp.pad(block_tables, ((0, 0), (0, pad))) if pad else block_tables


def paged_decode_attention_ref(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                               block_tables: jax.Array, kv_lens: jax.Array, *, scale: float) -> jax.Array:
    S, Hq, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    R = Hq // Hkv
    G = _group_size(S, BS, Hkv, D, block_tables.shape[1])
    bt = _pad_cols(block_tables, G)
    qg = q.reshape(S, Hkv, R, D).astype(jnp.float32) * scale
    n_iter = (jnp.max(kv_lens) + G * BS - 1) // (G * BS)

    def body(i, carry):
        cols = jax.lax.dynamic_slice_in_dim(bt, i * G, G, axis=1)            # [S, G]
        k = k_cache[cols].reshape(S, G * BS, Hkv, D).astype(jnp.float32)
        v = v_cache[cols].reshape(S, G * BS, Hkv, D).astype(jnp.float32)
        s = jnp.einsum("shrd,skhd->shrk", qg, k)
        kpos = i * G * BS + jnp.arange(G * BS)
        mask = (kpos[None, :] < kv_lens[:, None])[:, None, None, :]
        return _online_softmax_step(*carry, s, mask, v, "shrk,skhd->shrd")

    init = (jnp.full((S, Hkv, R), NEG_INF, jnp.float32), jnp.zeros((S, Hkv, R), jnp.float32),
            jnp.zeros((S, Hkv, R, D), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, n_iter, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return out.reshape(S, Hq, D).astype(q.dtype)


def ragged_token_layout(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int):
    """For each flattened query row: (sequence index, absolute position, is-real-token)."""
    S = kv_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens[1:], t, side="right"), 0, S - 1).astype(jnp.int32)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    q_pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    valid = t < cu_q_lens[S]
    return seq, q_pos, valid


def ragged_paged_attention_ref(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                               block_tables: jax.Array, cu_q_lens: jax.Array, kv_lens: jax.Array,
                               *, scale: float) -> jax.Array:
    T, Hq, D = q.shape
    S = kv_lens.shape[0]
    _, BS, Hkv, _ = k_cache.shape
    R = Hq // Hkv
    G = _group_size(T, BS, Hkv, D, block_tables.shape[1])
    bt = _pad_cols(block_tables, G)
    seq, q_pos, valid = ragged_token_layout(cu_q_lens, kv_lens, T)
    qg = q.reshape(T, Hkv, R, D).astype(jnp.float32) * scale
    has_q = (cu_q_lens[1:] - cu_q_lens[:-1]) > 0
    max_kv = jnp.max(jnp.where(has_q, kv_lens, 0))
    n_iter = (max_kv + G * BS - 1) // (G * BS)

    def body(i, carry):
        cols = jax.lax.dynamic_slice_in_dim(bt, i * G, G, axis=1)[seq]     # [T, G]
        k = k_cache[cols].reshape(T, G * BS, Hkv, D).astype(jnp.float32)
        v = v_cache[cols].reshape(T, G * BS, Hkv, D).astype(jnp.float32)
        s = jnp.einsum("thrd,tkhd->thrk", qg, k)
        kpos = i * G * BS + jnp.arange(G * BS)
        mask = ((kpos[None, :] <= q_pos[:, None]) & valid[:, None])[:, None, None, :]
        return _online_softmax_step(*carry, s, mask, v, "thrk,tkhd->thrd")

    init = (jnp.full((T, Hkv, R), NEG_INF, jnp.float32), jnp.zeros((T, Hkv, R), jnp.float32),
            jnp.zeros((T, Hkv, R, D), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, n_iter, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return out.reshape(T, Hq, D).astype(q.dtype)


@dataclass(frozen=True)
class AttentionBackend:
    """The pair of attention functions the model calls; chosen once per engine."""

    name: str
    decode: Callable[..., jax.Array]
    ragged: Callable[..., jax.Array]


def get_attention_backend(name: str = "auto") -> AttentionBackend:
    """auto: Pallas on GPU, the jnp reference elsewhere. pallas off-GPU runs the kernels
    in interpret mode (slow, for checking)."""
    platform = jax.default_backend()
    if name == "auto":
        name = "pallas" if platform == "gpu" else "xla"
    if name == "xla":
        return AttentionBackend("xla", paged_decode_attention_ref, ragged_paged_attention_ref)
    if name == "pallas":
        raise NotImplementedError("the Pallas kernels are not written yet")
    raise ValueError(f"unknown attention backend {name!r} (expected auto, pallas or xla)")
