"""Stale block-table entries (KERNELS.md: block ids are clamped into [0, num_blocks), so a
stale entry can never address outside the cache). The engine zero-fills unused entries,
and so do test_kernels' tables; here every entry past a sequence's context is garbage:
ids far past the cache, negative ids, ids of other sequences' blocks. The kernels must
give the dense oracle's answer, finite, for both the decode and the ragged kernel."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from test_kernels import (BS, NUM_BLOCKS, assert_close, decode_case, decode_oracle, dense_oracle, pl_decode,
                          pl_ragged, ragged_case)


def stale(bt: jnp.ndarray, kv_lens, rng) -> jnp.ndarray:
    """The table with every entry past ceil(kv_len / BS) replaced by garbage."""
    bt = np.array(bt)
    garbage = np.array([NUM_BLOCKS, NUM_BLOCKS + 7, 2**30, -1, -2**30, 5, 1], np.int32)
    for s, n in enumerate(np.asarray(kv_lens)):
        used = -(-int(n) // BS)
        bt[s, used:] = rng.choice(garbage, bt.shape[1] - used)
    return jnp.asarray(bt)


def test_decode_kernel_ignores_stale_block_ids():
    rng = np.random.default_rng(21)
    q, kc, vc, bt, kv_lens = decode_case(rng, 4, 64, jnp.float32)
    want = decode_oracle(q, kc, vc, bt, kv_lens, 0.125)
    for pages_per_iter in (1, 4):  # the stale entries inside the last chunk are loaded, then masked
        out = pl_decode(q, kc, vc, stale(bt, kv_lens, rng), kv_lens, scale=0.125, pages_per_iter=pages_per_iter)
        assert np.isfinite(np.asarray(out)).all()
        assert_close(out, want, jnp.float32, f"decode, stale table, pages_per_iter={pages_per_iter}")


def test_ragged_kernel_ignores_stale_block_ids():
    rng = np.random.default_rng(22)
    q, kc, vc, bt, cu, kv_lens = ragged_case(rng, 4, 64, jnp.float32)
    want = dense_oracle(q, kc, vc, bt, cu, kv_lens, 0.125)
    out = pl_ragged(q, kc, vc, stale(bt, kv_lens, rng), cu, kv_lens, scale=0.125, pages_per_iter=4)
    assert np.isfinite(np.asarray(out)).all()
    assert_close(out, want, jnp.float32, "ragged, stale table")


def test_the_block_id_load_clamps_into_the_cache():
    """Interpret mode gathers with clamped indices anyway, so on CPU the two tests above
    would pass without the kernels' own clamp (on a GPU they read real memory). Hence this
    check of the one load both kernels read block ids through, run as a kernel: every id
    it hands to the K/V gathers lies in [0, num_blocks)."""
    import jax
    from jax.experimental import pallas as pl

    import kernels_pallas as kp

    P, num_blocks = 8, NUM_BLOCKS
    table = jnp.asarray([[3, NUM_BLOCKS, 2**30, -1, -2**30, 0, NUM_BLOCKS - 1, NUM_BLOCKS + 7]], jnp.int32)

    def kernel(bt_ref, o_ref):
        o_ref[...] = kp._block_ids(bt_ref, 0, 0, P, num_blocks)

    ids = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((P,), jnp.int32), interpret=True)(table)
    assert np.asarray(ids).tolist() == [3, NUM_BLOCKS - 1, NUM_BLOCKS - 1, 0, 0, 0, NUM_BLOCKS - 1, NUM_BLOCKS - 1]
