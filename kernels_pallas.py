"""Paged attention over the block-structured KV cache: pure-jnp references (this part)
and Pallas kernels with the same signatures.

KV cache layout, per layer: k_cache, v_cache of shape [num_blocks, block_size,
num_kv_heads, head_dim]. Block 0 is the null block: idle slots and padding tokens point
at it, and every read of it is masked. A quantized cache (--kv-cache-dtype int8/fp8) is
a `QuantizedKV` instead: 8-bit values of that shape and one f32 scale per token and KV
head; every function here takes either (on CPU with narrow floats held as their `Bits`,
see as_bits), and dequantizes inside attention (the scores and the probabilities are
scaled, m, l and the accumulator stay f32).

Two entry points, which attention_backend.py registers as backends (the references as
`xla`, the kernels as `pallas`) and model.py calls through an `AttentionBackend`:
  decode(q[S,Hq,D], k_cache, v_cache, block_tables[S,W], kv_lens[S])            -> [S,Hq,D]
      one query token per slot, at position kv_lens[s]-1; kv_lens[s] == 0 is an idle slot.
  ragged(q[T,Hq,D], k_cache, v_cache, block_tables[S,W], cu_q_lens[S+1], kv_lens[S]) -> [T,Hq,D]
      flattened query tokens; sequence s owns q rows cu_q_lens[s]:cu_q_lens[s+1] (q_len may
      be 0), which sit at the last q_len positions of its kv_lens[s] context (the step's
      own K/V is written to the cache before attention). Causal. Rows at or past
      cu_q_lens[S] are padding and come back as zeros.

The references keep an online softmax (m, l, acc in f32) and loop with *traced* trip
counts, so the cost follows the tokens actually in context, not the block table's width,
and one compiled program serves every context length. ragged splits the keys three ways
and merges the partial softmax states:
  - in-step: the step's own tokens, causal, as varlen flash attention over tiles of the
    flattened tokens (a query tile visits only the key tiles of its own sequences);
  - decodes (q_len 1) over their cached context, one row per sequence, as decode does;
  - prompt chunks over the prefix cached by earlier chunks, one sequence at a time.
Without chunked prefill a prompt step has no cached prefix at all, and attention costs
what causal attention over the prompts costs; nothing scales with T x context.

The Pallas kernels (below the references; design, lowering and tolerances in
docs/KERNELS.md) do the same per program: paged_decode_attention over (slot, kv head,
context split) with a jnp combine of the splits, ragged_paged_attention over (query tile,
kv head). Both read each block's [block_size, head_dim] tile of one kv head once for all
the query heads of its GQA group.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from attention_backend import REFERENCE
from config import KV_CACHE_DTYPES

# A large finite negative rather than -inf: exp(NEG - NEG) stays finite for rows that
# are fully masked so far, and the where() below zeroes them.
NEG_INF = -1e30


# ---- quantized KV cache ------------------------------------------------------------

def kv_storage_dtype(kv_cache_dtype: str) -> jnp.dtype | None:
    """The dtype a --kv-cache-dtype stores its values in (config.KV_CACHE_DTYPES); None: the model dtype."""
    stored = KV_CACHE_DTYPES[kv_cache_dtype]
    return None if stored is None else jnp.dtype(stored)


_QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0, jnp.dtype(jnp.float8_e5m2): 57344.0}


@jax.tree_util.register_dataclass
@dataclass
class QuantizedKV:
    """A K or V cache in 8 bits: `values` [..., Hkv, D] (int8 or fp8) and `scales`
    [..., Hkv] f32, one per token and KV head (value = values * scales[..., None]). Per
    token, because a token is written once and never rescaled: the step that writes it
    knows its whole range. (No trailing axis of 1 on the scales: XLA then copies them
    around the in-place scatter.)"""

    values: jax.Array  # or their Bits (as_bits)
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self) -> Any:
        return self.values.dtype


@jax.tree_util.register_dataclass
@dataclass
class Bits:
    """An array of a float type narrower than 32 bits held as its raw bits: `bits`, unsigned
    ints of the same width, stand for the same values in `dtype`, bit for bit (see as_bits)."""

    bits: jax.Array
    dtype: Any = field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.bits.shape


def holds_bits(dtype: Any) -> bool:
    """Whether a cache (a plain one or a QuantizedKV's values) of `dtype` is held as its Bits
    here: a float narrower than 32 bits (bf16, f16, fp8) on CPU."""
    return jax.default_backend() == "cpu" and jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 4


def _bits_type(dtype: Any) -> Any:
    return jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")


def bits_zeros(shape: tuple[int, ...], dtype: Any) -> Any:
    """A cache of zeros in `dtype`, held as Bits where holds_bits says so (zero bits are 0.0)."""
    return Bits(jnp.zeros(shape, _bits_type(dtype)), jnp.dtype(dtype)) if holds_bits(dtype) else jnp.zeros(shape, dtype)


def as_bits(cache: Any) -> Any:
    """`cache` (a pytree) with each array of a float type narrower than 32 bits replaced, on
    CPU, by its Bits. XLA:CPU has no scatter or gather on such floats: around each it converts
    the whole operand to f16/f32 and back, a pass over the whole cache for every layer's write
    and read (a decode step of the tiny model with 20 MiB of fp8 cache: ~140 ms instead of
    int8's ~1.3; with 256 MiB of bf16 cache: 406 ms instead of f32's 0.9), where integers are
    written and read in place. The engine allocates its caches so (bits_zeros) and keeps
    them so; the model converts a cache handed to it in its float type on the way in and
    back on the way out, and attention reinterprets only the tiles it gathers (from_bits)."""
    one = lambda x: Bits(jax.lax.bitcast_convert_type(x, _bits_type(x.dtype)), jnp.dtype(x.dtype))
    return jax.tree.map(lambda x: one(x) if holds_bits(x.dtype) else x, cache)


def _is_bits(x: Any) -> bool:
    return isinstance(x, Bits)


def from_bits(cache: Any) -> Any:
    """as_bits undone: each Bits in `cache` (a pytree) as its values, bit for bit."""
    one = lambda x: jax.lax.bitcast_convert_type(x.bits, x.dtype) if _is_bits(x) else x
    return jax.tree.map(one, cache, is_leaf=_is_bits)


def quantize_kv(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (values [..., D] in `dtype`, scales [...] f32): absmax per row,
    mapped to the dtype's largest finite value (int8: round to nearest)."""
    x = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True), 1e-30) / _QMAX[jnp.dtype(dtype)]
    y = x / scale
    if jnp.dtype(dtype) == jnp.int8:
        y = jnp.clip(jnp.round(y), -127, 127)
    return y.astype(dtype), scale[..., 0]


def dequantize_kv(cache: Any) -> jax.Array:
    """A cache (or a gathered part of one) as f32."""
    cache = from_bits(cache)
    if isinstance(cache, QuantizedKV):
        return cache.values.astype(jnp.float32) * cache.scales[..., None]
    return cache.astype(jnp.float32)


def _take(cache: Any, idx: jax.Array) -> jax.Array:
    """cache[idx] along the first axis, dequantized to f32: only what attention reads."""
    return dequantize_kv(jax.tree.map(lambda c: c[idx], cache))


def _online_softmax_step(m, l, acc, s, mask, v, eq_pv: str):
    """One online-softmax update. s: scores with the key axis last; mask broadcastable to s."""
    s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + p.sum(-1)
    acc = acc * corr[..., None] + jnp.einsum(eq_pv, p, v)
    return m_new, l, acc


def _group_size(bytes_per_block: int, width: int, most: int = 16) -> int:
    """Blocks per loop iteration: big enough to amortise the loop, small enough that one
    iteration's tensors (gathered K/V, or scores) stay around 32 MiB."""
    g = max(1, min(most, (32 << 20) // max(bytes_per_block, 1)))
    return min(1 << (g.bit_length() - 1), max(width, 1))


def _pad_cols(block_tables: jax.Array, g: int) -> jax.Array:
    w = block_tables.shape[1]
    pad = (-w) % g
    return jnp.pad(block_tables, ((0, 0), (0, pad))) if pad else block_tables


def _pair_lists(counts: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """The row-major list of every row r's first counts[r] columns, as (rows [n], columns
    [n]), (0, 0) past its end. Each entry finds its row among the rows' cumulative ends
    (an unrolled binary search) rather than by compacting a rows x columns mask
    (jnp.nonzero: a cumulative-sum scan over it that XLA:CPU compiles slowly, in every
    layer body of every program). Made once per loop, not per visit: computed inside the
    visits, it made smollm2's decode steps 10-20% slower."""
    S = counts.shape[0]
    # the inclusive cumulative sum as a masked sum: S is the batch's rows, S x S is small
    ends = jnp.sum(jnp.where(jnp.arange(S)[:, None] >= jnp.arange(S)[None, :], counts[None, :], 0), axis=1)
    k = jnp.arange(n, dtype=ends.dtype)
    valid = k < ends[S - 1]
    row = jnp.where(valid, jnp.searchsorted(ends, k, side="right", method="scan_unrolled"), 0)
    return row, jnp.where(valid, k - (ends - counts)[row], 0)


_TILE = 128  # query/key tile of the in-step (prefill) part


def _merge(a, b):
    """Merge two partial softmax states (m, l, acc) over disjoint key sets."""
    (ma, la, acca), (mb, lb, accb) = a, b
    m = jnp.maximum(ma, mb)
    ca, cb = jnp.exp(ma - m), jnp.exp(mb - m)
    return m, la * ca + lb * cb, acca * ca[..., None] + accb * cb[..., None]


def _empty_state(shape, D):
    return (jnp.full(shape, NEG_INF, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros(shape + (D,), jnp.float32))


_PAIR_KEYS = 128  # keys per (row, block group) pair: a row's waste is under one group
_ITER_KEYS = 2048  # keys per loop iteration (pairs x group): measured fastest on CPU


def _block_diag_q(qg: jax.Array) -> jax.Array:
    """qg [S, Hkv, R, D] -> [S, Hkv*D, Hkv*R], zero where the key head is not the query's.

    Against it the gathered keys [keys, Hkv*D] (the cache's own layout) score every head in
    one matmul per row: Hkv times the FLOPs of the per-head products, but no transposes of
    the gathered K/V and no [R, D] x [D, keys] products batched over rows x heads, which
    XLA's CPU dot runs one tiny call at a time."""
    S, Hkv, R, D = qg.shape
    bd = qg[:, :, None] * jnp.eye(Hkv, dtype=qg.dtype)[:, :, None, None]  # [S, h, h', R, D]
    return jnp.moveaxis(bd, -1, 2).reshape(S, Hkv * D, Hkv * R)  # rows (h, d), columns (h', r)


def _paged_partial(qg: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                   lens: jax.Array):
    """Softmax state (m, l, acc) of each row's query heads qg[S, Hkv, R, D] over the first
    lens[s] cached tokens of row s: by groups of blocks where the rows' contexts fill them
    (the groups' keys at most twice the blocks'), else block by block."""
    BS = k_cache.shape[1]
    G = max(1, _PAIR_KEYS // BS)
    blocks = jnp.sum((lens + BS - 1) // BS)
    grouped = jnp.sum((lens + G * BS - 1) // (G * BS)) * G <= 2 * blocks
    # Both loops, the other one for zero trips, rather than a lax.cond with the whole caches
    # among its operands; an empty state merges exactly.
    none = jnp.zeros_like(lens)
    return _merge(_paged_partial_groups(qg, k_cache, v_cache, block_tables, jnp.where(grouped, lens, none)),
                  _paged_partial_blocks(qg, k_cache, v_cache, block_tables, jnp.where(grouped, none, lens)))


def _paged_partial_groups(qg: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                          lens: jax.Array):
    """_paged_partial's state by groups of G blocks (about _PAIR_KEYS tokens): the (row, group)
    pairs actually in context are flattened (row-major) and visited C at a time; each
    visit's per-pair statistics merge into their row with sorted segment reductions. The
    cost is the sum of the rows' contexts (rounded up to a group), not rows x the longest
    one: a batch of short requests beside one long one pays for what it reads."""
    S, Hkv, R, D = qg.shape
    _, BS, _, _ = k_cache.shape
    G = max(1, _PAIR_KEYS // BS)
    bt = _pad_cols(block_tables, G)
    Wg = bt.shape[1] // G
    C = min(max(1, _ITER_KEYS // (G * BS)), S * Wg)
    groups = (lens + G * BS - 1) // (G * BS)
    total = jnp.sum(groups)
    rows_all, cols_all = _pair_lists(groups, S * Wg + C)  # + C: every slice stays in range
    bt = bt.reshape(S, Wg, G)
    qbd = _block_diag_q(qg)
    segment = dict(num_segments=S, indices_are_sorted=True)

    def body(i, state):
        r, c = (jax.lax.dynamic_slice_in_dim(x, i * C, C) for x in (rows_all, cols_all))
        kpos = c[:, None] * G * BS + jnp.arange(G * BS)
        in_range = (i * C + jnp.arange(C)) < total
        mask = ((kpos < lens[r][:, None]) & in_range[:, None])[:, :, None]
        # Keys outside the context (the null block, a block's stale tail) are zeroed, not
        # merely given p = 0: the matmuls below multiply them, and 0 * NaN is NaN. (Within
        # the context, a non-finite K of one key head reaches every head of the row through
        # the block-diagonal scores; a non-finite V stays in its own group, as in the per-head
        # kernels.)
        k = jnp.where(mask, _take(k_cache, bt[r, c]).reshape(C, G * BS, Hkv * D), 0)  # [C, keys, Hkv*D]
        v = jnp.where(mask, _take(v_cache, bt[r, c]).reshape(C, G * BS, Hkv * D), 0)
        s = jnp.einsum("ckx,cxj->ckj", k, qbd[r])  # [C, keys, Hkv*R]
        s = jnp.where(mask, s, NEG_INF)
        m_b = s.max(1)
        p = jnp.where(mask, jnp.exp(s - m_b[:, None]), 0.0)
        m, l, acc = state
        m_new = jnp.maximum(m, jax.ops.segment_max(m_b, r, **segment))
        scale = jnp.exp(m_b - m_new[r])
        corr = jnp.exp(m - m_new)
        l = l * corr + jax.ops.segment_sum(p.sum(1) * scale, r, **segment)
        # every (query head, key head) pair's p @ v, then each query head's own key head: sliced
        # out, not an einsum against the identity (a dot with transposes of its operand on CPU)
        pv = jnp.einsum("ckj,ckx->cjx", p, v).reshape(C, Hkv, R, Hkv, D)
        pv = jnp.stack([pv[:, h, :, h] for h in range(Hkv)], 1) * scale.reshape(C, Hkv, R, 1)
        acc = acc * corr.reshape(S, Hkv, R, 1) + jax.ops.segment_sum(pv, r, **segment)
        return m_new, l, acc

    init = (jnp.full((S, Hkv * R), NEG_INF, jnp.float32), jnp.zeros((S, Hkv * R), jnp.float32),
            jnp.zeros((S, Hkv, R, D), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, (total + C - 1) // C, body, init)
    return m.reshape(S, Hkv, R), l.reshape(S, Hkv, R), acc


def _paged_partial_blocks(qg: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                          lens: jax.Array, blocks_per_iter: int = 64):
    """_paged_partial's state block by block, each head's scores on their own: for short
    contexts, where a group of blocks would mostly read keys outside them. The (row, block)
    pairs actually in context are flattened (row-major) and visited
    `blocks_per_iter` at a time; each visit's per-block statistics merge into their row
    with sorted segment reductions. The cost is the sum of the rows' contexts, not rows x
    the longest one: a batch of short requests beside one long one pays for what it reads."""
    S, Hkv, R, D = qg.shape
    _, BS, _, _ = k_cache.shape
    W = block_tables.shape[1]
    C = min(blocks_per_iter, S * W)
    num_blocks = (lens + BS - 1) // BS
    total = jnp.sum(num_blocks)
    rows_all, cols_all = _pair_lists(num_blocks, S * W + C)  # + C: every slice stays in range
    blocks_all = block_tables[rows_all, cols_all]
    segment = dict(num_segments=S, indices_are_sorted=True)

    def body(i, state):
        r, c, b = (jax.lax.dynamic_slice_in_dim(x, i * C, C) for x in (rows_all, cols_all, blocks_all))
        k = _take(k_cache, b)  # [C, BS, Hkv, D]
        v = _take(v_cache, b)
        s = jnp.einsum("chrd,ckhd->chrk", qg[r], k)
        kpos = c[:, None] * BS + jnp.arange(BS)
        in_range = (i * C + jnp.arange(C)) < total
        keys = (kpos < lens[r][:, None]) & in_range[:, None]
        mask = keys[:, None, None, :]
        s = jnp.where(mask, s, NEG_INF)
        m_b = s.max(-1)
        p = jnp.where(mask, jnp.exp(s - m_b[..., None]), 0.0)
        m, l, acc = state
        m_new = jnp.maximum(m, jax.ops.segment_max(m_b, r, **segment))
        scale = jnp.exp(m_b - m_new[r])
        corr = jnp.exp(m - m_new)
        l = l * corr + jax.ops.segment_sum(p.sum(-1) * scale, r, **segment)
        v = jnp.where(keys[:, :, None, None], v, 0)  # a stale tail's values: p = 0 times NaN is NaN
        pv = jnp.einsum("chrk,ckhd->chrd", p, v) * scale[..., None]
        acc = acc * corr[..., None] + jax.ops.segment_sum(pv, r, **segment)
        return m_new, l, acc

    return jax.lax.fori_loop(0, (total + C - 1) // C, body, _empty_state((S, Hkv, R), D))


def paged_decode_attention_ref(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                               block_tables: jax.Array, kv_lens: jax.Array, *, scale: float) -> jax.Array:
    S, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    qg = q.reshape(S, Hkv, Hq // Hkv, D).astype(jnp.float32) * scale
    _, l, acc = _paged_partial(qg, k_cache, v_cache, block_tables, kv_lens)
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


def _in_step_partial(qg, k_new, v_new, seq, valid, cu_q_lens):
    """Causal attention among the step's own tokens (varlen flash attention): query tile
    i visits only key tiles from the start of its first token's sequence up to itself."""
    T, Hkv, R, D = qg.shape
    tile = min(_TILE, T)
    n_tiles = -(-T // tile)
    pad = n_tiles * tile - T
    if pad:  # T need not be a multiple of the tile (max_num_batched_tokens is any number)
        qg, k_new, v_new = (jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)) for x in (qg, k_new, v_new))
        seq, valid = jnp.pad(seq, (0, pad), constant_values=seq[-1]), jnp.pad(valid, (0, pad))
    S = cu_q_lens.shape[0] - 1

    def q_tile(i):
        q0 = i * tile
        qt = jax.lax.dynamic_slice_in_dim(qg, q0, tile)
        qseq = jax.lax.dynamic_slice_in_dim(seq, q0, tile)
        qidx = q0 + jnp.arange(tile)
        first_key = cu_q_lens[seq[q0]]
        j0 = first_key // tile
        j1 = jnp.where(q0 < cu_q_lens[S], i + 1, j0)  # padding tiles do nothing

        def body(j, carry):
            k0 = j * tile
            kt = jax.lax.dynamic_slice_in_dim(k_new, k0, tile)
            vt = jax.lax.dynamic_slice_in_dim(v_new, k0, tile)
            kseq = jax.lax.dynamic_slice_in_dim(seq, k0, tile)
            kval = jax.lax.dynamic_slice_in_dim(valid, k0, tile)
            kidx = k0 + jnp.arange(tile)
            mask = (qseq[:, None] == kseq[None, :]) & (kidx[None, :] <= qidx[:, None]) & kval[None, :]
            s = jnp.einsum("thrd,khd->thrk", qt, kt)
            return _online_softmax_step(*carry, s, mask[:, None, None, :], vt, "thrk,khd->thrd")

        return jax.lax.fori_loop(j0, j1, body, _empty_state((tile, Hkv, R), D))

    m, l, acc = jax.lax.map(q_tile, jnp.arange(n_tiles))
    return m.reshape(-1, Hkv, R)[:T], l.reshape(-1, Hkv, R)[:T], acc.reshape(-1, Hkv, R, D)[:T]


_PREFIX_Q_TILE = 64  # query rows per visit of a sequence's cached prefix


def _chunk_prefix_partial(qg, k_cache, v_cache, block_tables, cu_q_lens, prefix, multi):
    """For sequences with several query tokens AND a cached prefix (a prompt chunk after
    earlier chunks, or a prompt after a prefix-cache hit): their tokens over that prefix,
    one sequence at a time, its own query rows only, a tile of them per visit. (Prefix
    caching puts dozens of such sequences in one step: scoring all T rows against each
    one's prefix would cost T x prefix per sequence instead of its q_len x prefix.)"""
    T, Hkv, R, D = qg.shape
    _, BS, _, _ = k_cache.shape
    QT = min(_PREFIX_Q_TILE, T)
    # One sequence's K is gathered per iteration and the [QT, Hq, keys] scores set the
    # size; small groups measured fastest on CPU (cache-resident scores).
    G = _group_size(QT * BS * Hkv * R * 4, block_tables.shape[1], most=16)
    bt = _pad_cols(block_tables, G)
    todo = multi & (prefix > 0)
    order = jnp.argsort(~todo)  # rows to visit first
    count = jnp.sum(todo)

    def per_row(n, state):
        r = order[n]
        q_lo, q_hi = cu_q_lens[r], cu_q_lens[r + 1]

        def q_tile(j, state):
            want = q_lo + j * QT
            s0 = jnp.minimum(want, T - QT)  # a tile never runs past T: clamp, mask the overlap
            qt = jax.lax.dynamic_slice_in_dim(qg, s0, QT)
            qidx = s0 + jnp.arange(QT)
            mine = ((qidx >= want) & (qidx < q_hi))[:, None, None, None]

            def body(i, carry):
                cols = jax.lax.dynamic_slice_in_dim(bt[r], i * G, G)
                k = _take(k_cache, cols).reshape(G * BS, Hkv, D)
                v = _take(v_cache, cols).reshape(G * BS, Hkv, D)
                s = jnp.einsum("thrd,khd->thrk", qt, k)
                kpos = i * G * BS + jnp.arange(G * BS)
                mask = mine & (kpos < prefix[r])[None, None, None, :]
                return _online_softmax_step(*carry, s, mask, v, "thrk,khd->thrd")

            part = jax.lax.fori_loop(0, (prefix[r] + G * BS - 1) // (G * BS), body, _empty_state((QT, Hkv, R), D))
            merged = _merge(tuple(jax.lax.dynamic_slice_in_dim(x, s0, QT) for x in state), part)
            return tuple(jax.lax.dynamic_update_slice_in_dim(x, y, s0, 0) for x, y in zip(state, merged))

        return jax.lax.fori_loop(0, (q_hi - q_lo + QT - 1) // QT, q_tile, state)

    return jax.lax.fori_loop(0, count, per_row, _empty_state((T, Hkv, R), D))


def ragged_paged_attention_ref(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                               block_tables: jax.Array, cu_q_lens: jax.Array, kv_lens: jax.Array,
                               *, scale: float) -> jax.Array:
    T, Hq, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    R = Hq // Hkv
    seq, q_pos, valid = ragged_token_layout(cu_q_lens, kv_lens, T)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    prefix = kv_lens - q_lens  # tokens cached before this step
    qg = q.reshape(T, Hkv, R, D).astype(jnp.float32) * scale
    # The step's own K/V, read back from the cache rows the model just wrote.
    rows = block_tables[seq, q_pos // BS] * BS + q_pos % BS
    by_row = lambda cache: jax.tree.map(lambda c: c.reshape(-1, *c.shape[2:]), cache)
    k_new = _take(by_row(k_cache), rows)
    v_new = _take(by_row(v_cache), rows)
    state = _in_step_partial(qg, k_new, v_new, seq, valid, cu_q_lens)
    # Decodes (one query token) over their cached context: one row each.
    single = q_lens == 1
    first = jnp.minimum(cu_q_lens[:-1], T - 1)
    dec = _paged_partial(qg[first], k_cache, v_cache, block_tables, jnp.where(single, prefix, 0))
    is_dec = (single[seq] & valid)[:, None, None]
    m_d, l_d, acc_d = dec
    state = _merge(state, (jnp.where(is_dec, m_d[seq], NEG_INF), jnp.where(is_dec, l_d[seq], 0.0),
                           jnp.where(is_dec[..., None], acc_d[seq], 0.0)))
    state = _merge(state, _chunk_prefix_partial(qg, k_cache, v_cache, block_tables, cu_q_lens, prefix, q_lens > 1))
    _, l, acc = state
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(T, Hq, D).astype(q.dtype)


# --------------------------------------------------------------------------------------
# Pallas kernels
#
# Written for Pallas' generic `pallas_call` API and lowered on GPU through its Triton
# backend, selected explicitly by passing the Triton CompilerParams. JAX 0.11 deprecates
# that backend (Mosaic GPU is the way forward, on Hopper above all; see docs/KERNELS.md).
# Off GPU the kernels run in interpret mode. The Triton lowering shapes the code: every
# array a kernel touches has power-of-two dims; matmuls need M, N, K >= 16 (tl.dot); there
# is no scalar prefetch or scratch memory, so block tables and lengths are plain
# whole-array inputs read with scalar loads, and the carried (m, l, acc) live in registers
# across dynamic-trip loops.
# --------------------------------------------------------------------------------------

try:  # the Triton backend's CompilerParams: passing them selects that lowering on GPU
    from jax.experimental.pallas import triton as _pl_triton
    _TRITON_IMPORT_ERROR: str | None = None
except ImportError as e:  # pragma: no cover - a JAX without the Triton backend
    _pl_triton = None
    _TRITON_IMPORT_ERROR = f"{type(e).__name__}: {e}"

TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"


def hide_triton_deprecation() -> None:
    """JAX 0.11 warns at every Triton lowering that the backend is deprecated; we know
    (docs/KERNELS.md), and a user can do nothing about it. Only that message is hidden."""
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


hide_triton_deprecation()

MIN_DOT = 16  # tl.dot needs every matmul dim >= 16
# Triton lowers a DEFAULT-precision f32 dot as TF32; HIGHEST keeps f32 caches exact (IEEE)
# and changes nothing for bf16 inputs (bf16 products are exact, accumulation is f32).
_HIGHEST = jax.lax.Precision.HIGHEST


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def triton_unavailable() -> str | None:
    """Why the Pallas Triton backend cannot be used here, or None when it can."""
    if _pl_triton is None:
        return (f"jax.experimental.pallas.triton failed to import under jax {jax.__version__} "
                f"({_TRITON_IMPORT_ERROR}); taxirank's kernels need Pallas' Triton backend")
    return None


def _compiler_params(num_warps: int, num_stages: int, interpret: bool):
    """The Triton CompilerParams, which select that lowering on GPU. Never None there: a
    pallas_call without them falls to Mosaic GPU (JAX 0.9/0.10's default), which rejects
    the block-table gather with an error about something else entirely."""
    if interpret:
        return None
    reason = triton_unavailable()
    if reason is not None:
        raise RuntimeError(f"{reason} (use --attention-backend {REFERENCE.name})")
    return _pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _check_shapes(q, k_cache, v_cache):
    """The kernels' shapes. Compiled (not interpreted), head_dim and block_size must also
    be powers of two: attention_backend.py's registration of the kernels declares it."""
    _, Hq, D = q.shape
    _, BS, Hkv, Dk = k_cache.shape
    if k_cache.shape != v_cache.shape or Dk != D or Hq % Hkv:
        raise ValueError(f"bad attention shapes: q {q.shape}, k {k_cache.shape}, v {v_cache.shape}")
    return Hq, D, BS, Hkv, Hq // Hkv


def _default_pages_per_iter(block_size: int) -> int:
    """Blocks gathered per inner-loop step: 64 keys per step (>= MIN_DOT for tl.dot)."""
    return max(1, 64 // block_size)


def _attend_chunk(carry, q, k_ref, v_ref, ids, h, k_start, mask_fn, scale, ks_ref=None, vs_ref=None):
    """One online-softmax step over the keys of `ids` (P blocks) for kv head h.

    q: [M, D] in the model dtype; mask_fn(kpos[1, N]) -> bool [M, N]. Scores, m, l and the
    accumulator are f32; p is cast to the model dtype for the second matmul (as flash
    attention does on GPU: bf16 tensor-core inputs, f32 accumulation). A quantized cache
    (ks_ref, vs_ref: its per-token scales) is converted to the model dtype as loaded and
    its scales applied to the scores' columns and to p: q.(s k) = s (q.k)."""
    m, l, acc = carry
    P, BS, D = ids.shape[0], k_ref.shape[1], k_ref.shape[3]
    k = k_ref[ids, :, h, :].reshape(P * BS, D).astype(q.dtype)   # gather P blocks of one kv head
    v = v_ref[ids, :, h, :].reshape(P * BS, D).astype(q.dtype)
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                            preferred_element_type=jnp.float32) * scale     # [M, N]
    if ks_ref is not None:
        s = s * ks_ref[ids, :, h].reshape(1, P * BS)
    kpos = k_start + jax.lax.broadcasted_iota(jnp.int32, (1, P * BS), 1)
    mask = mask_fn(kpos)
    s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + p.sum(axis=1)
    pv = p if vs_ref is None else p * vs_ref[ids, :, h].reshape(1, P * BS)
    pv = jax.lax.dot_general(pv.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=_HIGHEST,
                             preferred_element_type=jnp.float32)
    return m_new, l, acc * corr[:, None] + pv


def _kernel_cache_inputs(k_cache: Any, v_cache: Any) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """((k values, v values), (k scales, v scales) or () when not quantized)."""
    k_cache, v_cache = from_bits((k_cache, v_cache))  # Bits: CPU, where the kernels only run interpreted
    if isinstance(k_cache, QuantizedKV):
        return (k_cache.values, v_cache.values), (k_cache.scales, v_cache.scales)
    return (k_cache, v_cache), ()


def _block_ids(bt_ref, s, chunk, P, num_blocks):
    """Block ids of chunk `chunk` (P consecutive table entries) of sequence s, clamped so
    a stale table entry can never address memory outside the cache."""
    return jnp.clip(bt_ref[s, pl.ds(chunk * P, P)], 0, num_blocks - 1)


# ---- decode: one query token per slot ------------------------------------------------

def split_chunk_count(num_chunks, split, num_splits: int):
    """How many of chunks split, split + K, split + 2K, ... (K = num_splits) lie below
    num_chunks: the decode program's trip count. Never negative: split < K, so the
    numerator of the ceiling division is >= 0 and truncation is the floor."""
    return pl.cdiv(num_chunks - split, num_splits)


def _decode_kernel(q_ref, k_ref, v_ref, bt_ref, lens_ref, *refs,
                   scale, pages_per_iter, num_splits, quantized):
    """Program (s, h, split): the RP query rows of kv head h of slot s (the R real heads
    of the group, zero-padded), over this split's chunks of the context, dealt round-robin
    (split k takes chunks k, k + K, k + 2K, ...): every split below the context's chunk
    count has work, so batch 1 at a short context still spreads over K programs.
    With K > 1 it writes the unnormalised partial (acc, m, l); a split past the context
    (and an idle slot) runs zero iterations and writes the empty partial (0, NEG_INF, 0).
    With K == 1 it writes the normalised output in the output ref's (the cache's) dtype."""
    ks_ref, vs_ref, *out_refs = refs if quantized else (None, None, *refs)
    s, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    P, BS = pages_per_iter, k_ref.shape[1]
    chunk_len = P * BS
    kv_len = lens_ref[s]
    n = split_chunk_count(pl.cdiv(kv_len, chunk_len), split, num_splits)
    q = q_ref[...]                                                        # [RP, D]
    rows = q.shape[0]

    def body(i, carry):
        c = split + i * num_splits
        ids = _block_ids(bt_ref, s, c, P, k_ref.shape[0])
        return _attend_chunk(carry, q, k_ref, v_ref, ids, h, c * chunk_len,
                             lambda kpos: jnp.broadcast_to(kpos < kv_len, (rows, chunk_len)),
                             scale, ks_ref, vs_ref)

    init = (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros(q.shape, jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, n, body, init)
    if num_splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)  # idle: 0
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


def default_num_splits(num_slots: int, num_kv_heads: int, num_chunks: int,
                       target_programs: int = 264) -> int:
    """Split the context when slots x kv heads alone would leave the GPU's SMs idle
    (H100/H200: 132 SMs; aim for ~2 programs each). Splits past a short context exit
    at once, so a generous count costs little."""
    return int(max(1, min(num_chunks, -(-target_programs // max(1, num_slots * num_kv_heads)))))


def paged_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                           block_tables: jax.Array, kv_lens: jax.Array, *, scale: float,
                           interpret: bool = False, num_splits: int | None = None,
                           pages_per_iter: int | None = None, num_warps: int = 4,
                           num_stages: int = 2) -> jax.Array:
    """Pallas version of paged_decode_attention_ref (same signature and result).

    Grid (slot, kv head, split). Each program reads its kv head's [block_size, D] tile
    of each block once for all R = Hq/Hkv query heads of the group (no K/V repeat);
    a jnp combine step merges the splits' partial softmax states. With one split the
    kernel normalises and writes the cache dtype itself (no f32 round trip)."""
    S, _, _ = q.shape
    Hq, D, BS, Hkv, R = _check_shapes(q, k_cache, v_cache)
    P = pages_per_iter or _default_pages_per_iter(BS)
    W = block_tables.shape[1]
    num_chunks = max(1, -(-W // P))
    splits = num_splits or default_num_splits(S, Hkv, num_chunks)
    splits = max(1, min(splits, num_chunks))
    bt = _pad_cols(block_tables.astype(jnp.int32), P)    # every chunk's P entries exist
    RP = max(MIN_DOT, _next_pow2(R))                     # query rows per program
    qg = jnp.pad(q.reshape(S, Hkv, R, D), ((0, 0), (0, 0), (0, RP - R), (0, 0)))

    kv, scales = _kernel_cache_inputs(k_cache, v_cache)
    kernel = functools.partial(_decode_kernel, scale=float(scale), pages_per_iter=P,
                               num_splits=splits, quantized=bool(scales))
    if splits == 1:  # the kernel normalises: no f32 partials, no combine step
        out_specs = pl.BlockSpec((None, None, RP, D), lambda s, h, k: (s, h, 0, 0))
        out_shape = jax.ShapeDtypeStruct((S, Hkv, RP, D), q.dtype)
    else:
        out_specs = [pl.BlockSpec((None, None, None, RP, D), lambda s, h, k: (s, h, k, 0, 0)),
                     pl.BlockSpec((None, None, None, RP), lambda s, h, k: (s, h, k, 0)),
                     pl.BlockSpec((None, None, None, RP), lambda s, h, k: (s, h, k, 0))]
        out_shape = [jax.ShapeDtypeStruct((S, Hkv, splits, RP, D), jnp.float32),
                     jax.ShapeDtypeStruct((S, Hkv, splits, RP), jnp.float32),
                     jax.ShapeDtypeStruct((S, Hkv, splits, RP), jnp.float32)]
    res = pl.pallas_call(
        kernel,
        grid=(S, Hkv, splits),
        in_specs=[pl.BlockSpec((None, None, RP, D), lambda s, h, k: (s, h, 0, 0)),
                  pl.BlockSpec(), pl.BlockSpec(), pl.BlockSpec(), pl.BlockSpec()]
        + [pl.BlockSpec() for _ in scales],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_compiler_params(num_warps, num_stages, interpret),
        interpret=interpret,
        name="paged_decode_attention",
    )(qg, *kv, bt, kv_lens.astype(jnp.int32), *scales)
    if splits == 1:
        out = res[:, :, :R, :]
    else:
        acc, m, l = res
        out = combine_splits(acc[..., :R, :], m[..., :R], l[..., :R])   # [S, Hkv, R, D]
    return out.reshape(S, Hq, D).astype(q.dtype)


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Merge per-split partial softmax states along axis 2: acc [..., K, R, D], m/l
    [..., K, R] -> normalised [..., R, D]. Empty splits carry (0, NEG_INF, 0) and get
    weight 0; a row with no keys at all (idle slot) comes out 0."""
    m_max = m.max(axis=2, keepdims=True)
    w = jnp.exp(m - m_max)
    l_tot = (l * w).sum(axis=2)
    acc_tot = (acc * w[..., None]).sum(axis=2)
    return acc_tot / jnp.maximum(l_tot, 1e-30)[..., None]


# ---- ragged: flattened prompt chunks and decodes -------------------------------------

def ragged_tile_sequences(cu_q_lens: jax.Array, num_tiles: int, tile: int):
    """For each query tile of `tile` consecutive flattened tokens: the first sequence
    with a row in it and how many sequences (an interval, empty ones included) it spans.
    Tiles wholly past cu_q_lens[S] span none."""
    S = cu_q_lens.shape[0] - 1
    starts = jnp.arange(num_tiles, dtype=jnp.int32) * tile
    total = cu_q_lens[S]
    ends = jnp.minimum(starts + tile, total)
    first = jnp.searchsorted(cu_q_lens[1:], starts, side="right").astype(jnp.int32)
    last = jnp.searchsorted(cu_q_lens[1:], ends - 1, side="right").astype(jnp.int32)
    count = jnp.where(starts < total, last - first + 1, 0).astype(jnp.int32)
    return jnp.minimum(first, S - 1), count


def _ragged_kernel(q_ref, k_ref, v_ref, bt_ref, cu_ref, lens_ref, first_ref, count_ref,
                   *refs, scale, pages_per_iter, tile, quantized):
    """Program (i, h): query tile i (`tile` flattened tokens x RP head rows) of kv head h.
    The tile may hold rows of several sequences (a prompt's tail, decode tokens, the next
    prompt's head); it visits each of them in turn with that sequence's block table,
    masking the rows that are not its own, and reads keys only up to the last position
    any of its rows of that sequence attends to (causal, counting the cached prefix:
    the row of token t of sequence s sits at kv_len - q_len + (t - cu_q_lens[s]))."""
    ks_ref, vs_ref, o_ref = refs if quantized else (None, None, *refs)
    i, h = pl.program_id(0), pl.program_id(1)
    P, BS = pages_per_iter, k_ref.shape[1]
    chunk_len = P * BS
    TQ, RP, D = q_ref.shape
    M = TQ * RP
    q = q_ref[...].reshape(M, D)
    tile_start = i * tile
    tok = tile_start + jax.lax.broadcasted_iota(jnp.int32, (M,), 0) // RP   # row -> token
    first = first_ref[i]

    def seq_body(j, carry):
        s = first + j
        q_start, q_end, kv_len = cu_ref[s], cu_ref[s + 1], lens_ref[s]
        lo, hi = jnp.maximum(q_start, tile_start), jnp.minimum(q_end, tile_start + tile)
        last_pos = kv_len - q_end + hi - 1            # position of this tile's last row of s
        n = jnp.where(hi > lo, pl.cdiv(last_pos + 1, chunk_len), 0)
        q_pos = (kv_len - q_end + tok)[:, None]       # [M, 1]
        mine = ((tok >= q_start) & (tok < q_end))[:, None]

        def kv_body(c, carry):
            ids = _block_ids(bt_ref, s, c, P, k_ref.shape[0])
            return _attend_chunk(carry, q, k_ref, v_ref, ids, h, c * chunk_len,
                                 lambda kpos: mine & (kpos <= q_pos), scale, ks_ref, vs_ref)

        return jax.lax.fori_loop(0, n, kv_body, carry)

    init = (jnp.full((M,), NEG_INF, jnp.float32), jnp.zeros((M,), jnp.float32),
            jnp.zeros((M, D), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, count_ref[i], seq_body, init)
    out = acc / jnp.maximum(l, 1e-30)[:, None]        # rows of no sequence: 0
    o_ref[...] = out.reshape(TQ, RP, D).astype(o_ref.dtype)


def ragged_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                           block_tables: jax.Array, cu_q_lens: jax.Array, kv_lens: jax.Array,
                           *, scale: float, interpret: bool = False,
                           block_q: int = 64, pages_per_iter: int | None = None,
                           num_warps: int = 4, num_stages: int = 2) -> jax.Array:
    """Pallas version of ragged_paged_attention_ref (same signature and result).

    Grid (query tile, kv head) over the flattened tokens, no host-side planning: a tile
    holds block_q // RP tokens x the RP (padded) query heads of one kv head, so K/V are
    read once per tile for the whole GQA group."""
    T = q.shape[0]
    Hq, D, BS, Hkv, R = _check_shapes(q, k_cache, v_cache)
    P = pages_per_iter or _default_pages_per_iter(BS)
    RP = _next_pow2(R)
    TQ = max(1, max(block_q, MIN_DOT) // RP)               # tokens per tile
    num_tiles = max(1, -(-T // TQ))
    Tp = num_tiles * TQ
    qg = jnp.pad(q.reshape(T, Hkv, R, D), ((0, Tp - T), (0, 0), (0, RP - R), (0, 0)))
    bt = _pad_cols(block_tables.astype(jnp.int32), P)
    cu = cu_q_lens.astype(jnp.int32)
    first, count = ragged_tile_sequences(cu, num_tiles, TQ)

    kv, scales = _kernel_cache_inputs(k_cache, v_cache)
    kernel = functools.partial(_ragged_kernel, scale=float(scale), pages_per_iter=P, tile=TQ,
                               quantized=bool(scales))
    out = pl.pallas_call(
        kernel,
        grid=(num_tiles, Hkv),
        in_specs=[pl.BlockSpec((TQ, None, RP, D), lambda i, h: (i, h, 0, 0))]
        + [pl.BlockSpec() for _ in range(7 + len(scales))],
        out_specs=pl.BlockSpec((TQ, None, RP, D), lambda i, h: (i, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((Tp, Hkv, RP, D), q.dtype),
        compiler_params=_compiler_params(num_warps, num_stages, interpret),
        interpret=interpret,
        name="ragged_paged_attention",
    )(qg, *kv, bt, cu, kv_lens.astype(jnp.int32), first, count, *scales)
    return out[:T, :, :R].reshape(T, Hq, D)
