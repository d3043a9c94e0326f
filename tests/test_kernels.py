"""Paged attention: Pallas kernels vs the jnp references vs a dense numpy oracle.

On CPU the kernels run in Pallas interpret mode. TAXIRANK_KERNEL_INTERPRET selects:
"auto" (default: the real lowering when a GPU is present, else interpret), "1" (always
interpret), "0" (never: fails off GPU; bench/gpu_check.sh sets it so a silent CPU
fallback cannot pass for a GPU run).

Tolerances (max abs error, outputs are O(1)):
  f32:  kernel vs ref and both vs the float64 oracle: 1e-5.
  bf16: 2e-2 vs the oracle computed from the same bf16 inputs; the output itself is
        rounded to bf16 (relative step 2^-8) and the kernel feeds p to the second
        matmul in bf16, as flash attention does.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attention_backend as ab
import kernels_pallas as kp

_MODE = os.environ.get("TAXIRANK_KERNEL_INTERPRET", "auto")
ON_GPU = jax.default_backend() == "gpu"
INTERPRET = {"1": True, "0": False}.get(_MODE, not ON_GPU)
if not INTERPRET and not ON_GPU:  # fail the whole module at collection, loudly
    raise RuntimeError(f"TAXIRANK_KERNEL_INTERPRET=0 needs a GPU; JAX sees {jax.devices()}")

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
BS = 16  # the engine's default block size
NUM_BLOCKS = 48
WIDTH = 16  # block-table width: contexts up to 256 tokens
LONG = 13 * BS + 5  # "long": 13 blocks and a partial one, several inner-loop chunks


# ---- batch construction and the dense oracle -----------------------------------------

def make_cache(rng, num_kv_heads, head_dim, dtype, num_blocks=NUM_BLOCKS, block_size=BS):
    """Random K/V everywhere, the null block and unused blocks included: reads of them
    must be masked, not merely multiplied by zeros that happen to be there."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    return on_device(k, dtype), on_device(v, dtype)


def on_device(x, dtype) -> jax.Array:
    """`x` cast to `dtype` by NumPy (ml_dtypes for bfloat16), the cast jnp.asarray applies to
    a NumPy input, so the values are the same; then copied to the device. jnp.asarray would
    also compile a program per shape and dtype (a convert, or lax.stage for an array it
    keeps as it is): about 100 over this file."""
    return jax.device_put(np.asarray(x).astype(jnp.dtype(dtype)))


def make_block_tables(rng, kv_lens, num_blocks=NUM_BLOCKS, block_size=BS, width=WIDTH):
    """Each sequence gets its blocks from one shuffled pool of blocks 1..num_blocks-1;
    unused entries point at the null block 0."""
    need = [-(-int(n) // block_size) for n in kv_lens]
    assert sum(need) <= num_blocks - 1 and max(need, default=0) <= width
    pool = rng.permutation(np.arange(1, num_blocks))
    bt = np.zeros((len(kv_lens), width), np.int32)
    at = 0
    for s, n in enumerate(need):
        bt[s, :n] = pool[at:at + n]
        at += n
    return on_device(bt, jnp.int32)


def dense_oracle(q, k_cache, v_cache, block_tables, cu_q_lens, kv_lens, scale):
    """float64 numpy: per sequence, gather its context densely through the block table,
    repeat K/V over each GQA group, softmax over positions <= the query's position."""
    q = np.asarray(q, np.float64)
    kc, vc = np.asarray(k_cache, np.float64), np.asarray(v_cache, np.float64)
    bt, cu, kl = np.asarray(block_tables), np.asarray(cu_q_lens), np.asarray(kv_lens)
    T, Hq, D = q.shape
    _, bs, Hkv, _ = kc.shape
    R = Hq // Hkv
    out = np.zeros((T, Hq, D))
    for s in range(len(kl)):
        q_len, kv_len = cu[s + 1] - cu[s], kl[s]
        pos = np.arange(kv_len)
        k = kc[bt[s, pos // bs], pos % bs]                    # [L, Hkv, D]
        v = vc[bt[s, pos // bs], pos % bs]
        k, v = np.repeat(k, R, axis=1), np.repeat(v, R, axis=1)  # [L, Hq, D]
        for i in range(q_len):
            t, q_pos = cu[s] + i, kv_len - q_len + i
            if q_pos < 0:
                continue
            sc = np.einsum("hd,lhd->hl", q[t], k[:q_pos + 1]) * scale
            p = np.exp(sc - sc.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[t] = np.einsum("hl,lhd->hd", p, v[:q_pos + 1])
    return out


def decode_oracle(q, k_cache, v_cache, block_tables, kv_lens, scale):
    S = q.shape[0]
    return dense_oracle(q, k_cache, v_cache, block_tables, np.arange(S + 1), kv_lens, scale)


def cu_from(q_lens):
    return on_device(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)


def assert_close(got, want, dtype, what):
    got = np.asarray(got).astype(np.float64)
    err = np.abs(got - np.asarray(want, np.float64)).max()
    assert err <= TOL[dtype], f"{what}: max abs err {err:.3g} > {TOL[dtype]}"


def _hp(fn):
    """The references at full f32 precision (XLA on GPU would otherwise use TF32)."""
    @functools.wraps(fn)
    def wrapped(*a, **kw):
        with jax.default_matmul_precision("highest"):
            return fn(*a, **kw)
    return wrapped


ref_decode = _hp(jax.jit(kp.paged_decode_attention_ref, static_argnames="scale"))
ref_ragged = _hp(jax.jit(kp.ragged_paged_attention_ref, static_argnames="scale"))
pl_decode = jax.jit(functools.partial(kp.paged_decode_attention, interpret=INTERPRET),
                    static_argnames=("scale", "num_splits", "pages_per_iter"))
pl_ragged = jax.jit(functools.partial(kp.ragged_paged_attention, interpret=INTERPRET),
                    static_argnames=("scale", "block_q", "pages_per_iter"))

# ---- the edge-case batches -----------------------------------------------------------

DECODE_LENS = [0, 1, BS - 1, BS, BS + 1, LONG]
# (q_len, kv_len): idle, first token, decode, fresh prompts at the block edges, a chunk
# over a cached prefix, a long chunk over a long prefix, a decode deep in a context.
RAGGED_SEQS = [(0, 0), (1, 1), (1, 40), (BS - 1, BS - 1), (BS, BS), (BS + 1, BS + 1 + 20),
               (37, LONG), (1, LONG - 3)]
RAGGED_T = 96  # 88 real rows + padding rows that must come back zero

CONFIGS = [pytest.param(r, d, dt, id=f"gqa{r}-d{d}-{jnp.dtype(dt).name}")
           for r in (1, 4, 8) for d in (64, 128) for dt in (jnp.float32, jnp.bfloat16)]
HKV = 2


def decode_case(rng, R, D, dtype, lens=DECODE_LENS):
    kc, vc = make_cache(rng, HKV, D, dtype)
    kv_lens = on_device(lens, jnp.int32)
    bt = make_block_tables(rng, lens)
    q = on_device(rng.standard_normal((len(lens), HKV * R, D)), dtype)
    return q, kc, vc, bt, kv_lens


def ragged_case(rng, R, D, dtype, seqs=RAGGED_SEQS, T=RAGGED_T, num_blocks=NUM_BLOCKS):
    kc, vc = make_cache(rng, HKV, D, dtype, num_blocks=num_blocks)
    q_lens = [a for a, _ in seqs]
    kv_lens = on_device([b for _, b in seqs], jnp.int32)
    bt = make_block_tables(rng, [b for _, b in seqs], num_blocks=num_blocks)
    q = on_device(rng.standard_normal((T, HKV * R, D)), dtype)
    return q, kc, vc, bt, cu_from(q_lens), kv_lens


@pytest.mark.parametrize("R,D,dtype", CONFIGS)
def test_decode_ref_and_kernel(R, D, dtype):
    rng = np.random.default_rng(R * 1000 + D)
    q, kc, vc, bt, kv_lens = decode_case(rng, R, D, dtype)
    scale = D ** -0.5
    want = decode_oracle(q, kc, vc, bt, kv_lens, scale)
    ref = ref_decode(q, kc, vc, bt, kv_lens, scale=scale)
    out = pl_decode(q, kc, vc, bt, kv_lens, scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(ref, want, dtype, "decode ref vs oracle")
    assert_close(out, want, dtype, "decode kernel vs oracle")
    assert_close(out, ref, dtype, "decode kernel vs ref")
    assert not np.asarray(out)[0].any(), "idle slot (kv_len 0) must come back zero"


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("lens", [[200, 213, 129, 0, 64], [3, 1, 250, 0, 17, 2]], ids=["groups", "blocks"])
def test_decode_ref_long_and_short_contexts(lens, kv):
    """The reference reads contexts that fill its block groups by groups, others block by
    block: both against the dense oracle, on f32 and on int8 caches (the oracle reads the
    dequantized values)."""
    rng = np.random.default_rng(len(lens))
    q, kc, vc, bt, kv_lens = decode_case(rng, 4, 64, jnp.float32, lens=lens)
    if kv != "auto":
        kc, vc = (kp.QuantizedKV(*kp.quantize_kv(c, kp.kv_storage_dtype(kv))) for c in (kc, vc))
    want = decode_oracle(q, kp.dequantize_kv(kc), kp.dequantize_kv(vc), bt, kv_lens, 0.125)
    assert_close(ref_decode(q, kc, vc, bt, kv_lens, scale=0.125), want, jnp.float32, "decode ref vs oracle")


@pytest.mark.parametrize("lens", [[200, 213, 129, 0, 64], [3, 1, 250, 0, 17, 2]], ids=["groups", "blocks"])
def test_decode_ref_ignores_non_finite_values_outside_the_context(lens):
    """NaN in the null block and in every block's tail past its row's context (what a
    stale or never-written slot may hold) must not reach the output: masked keys are
    read, and p = 0 times NaN is NaN unless the values themselves are dropped."""
    rng = np.random.default_rng(11)
    q, kc, vc, bt, kv_lens = decode_case(rng, 4, 64, jnp.float32, lens=lens)
    want = decode_oracle(q, kc, vc, bt, kv_lens, 0.125)
    k, v = np.array(kc), np.array(vc)
    k[0] = v[0] = np.nan
    for row, n in enumerate(lens):
        if n % BS:
            b = int(np.asarray(bt)[row, n // BS])
            k[b, n % BS:] = v[b, n % BS:] = np.nan
    out = ref_decode(q, on_device(k, jnp.float32), on_device(v, jnp.float32), bt, kv_lens, scale=0.125)
    assert np.isfinite(np.asarray(out)).all(), "a value outside the context reached the output"
    assert_close(out, want, jnp.float32, "decode ref with NaN outside the context vs oracle on clean data")


@pytest.mark.parametrize("R,D,dtype", CONFIGS)
def test_ragged_ref_and_kernel(R, D, dtype):
    rng = np.random.default_rng(R * 1000 + D + 1)
    q, kc, vc, bt, cu, kv_lens = ragged_case(rng, R, D, dtype)
    scale = D ** -0.5
    want = dense_oracle(q, kc, vc, bt, cu, kv_lens, scale)
    ref = ref_ragged(q, kc, vc, bt, cu, kv_lens, scale=scale)
    out = pl_ragged(q, kc, vc, bt, cu, kv_lens, scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(ref, want, dtype, "ragged ref vs oracle")
    assert_close(out, want, dtype, "ragged kernel vs oracle")
    assert_close(out, ref, dtype, "ragged kernel vs ref")
    n = int(np.asarray(cu)[-1])
    assert not np.asarray(out)[n:].any(), "rows past cu_q_lens[S] must come back zero"


@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
def test_decode_split_k(num_splits):
    """Any split count gives the same answer: splits past a context exit at once and
    the combine step weighs the partial softmax states correctly."""
    rng = np.random.default_rng(7)
    q, kc, vc, bt, kv_lens = decode_case(rng, 4, 64, jnp.float32)
    want = decode_oracle(q, kc, vc, bt, kv_lens, 0.125)
    out = pl_decode(q, kc, vc, bt, kv_lens, scale=0.125, num_splits=num_splits)
    assert_close(out, want, jnp.float32, f"decode with {num_splits} splits")


@settings(max_examples=50, deadline=None, derandomize=True)
@given(num_chunks=st.integers(0, 40), num_splits=st.integers(1, 40))
def test_decode_splits_deal_chunks_round_robin(num_chunks, num_splits):
    """Split k takes chunks k, k + K, ...: together the splits cover every chunk of the
    context exactly once, their loads differ by at most one chunk, and so every split
    below the chunk count has work (batch 1 at a short context still spreads out)."""
    counts = [int(kp.split_chunk_count(jnp.int32(num_chunks), k, num_splits)) for k in range(num_splits)]
    dealt = sorted(k + i * num_splits for k in range(num_splits) for i in range(counts[k]))
    assert dealt == list(range(num_chunks))
    assert max(counts) - min(counts) <= 1
    assert all(c >= 1 for c in counts[:num_chunks])


def test_decode_one_split_writes_the_cache_dtype():
    """With one split the kernel normalises in place and writes bf16: no f32 partials
    and no combine step; exact against the oracle like the split path."""
    rng = np.random.default_rng(17)
    q, kc, vc, bt, kv_lens = decode_case(rng, 4, 64, jnp.bfloat16)
    f = functools.partial(kp.paged_decode_attention, scale=0.125, interpret=True)
    for splits, want_outs in ((1, [jnp.bfloat16]), (3, [jnp.float32] * 3)):
        jaxpr = jax.make_jaxpr(functools.partial(f, num_splits=splits))(q, kc, vc, bt, kv_lens)
        [call] = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
        assert [v.aval.dtype for v in call.outvars] == want_outs
        out = pl_decode(q, kc, vc, bt, kv_lens, scale=0.125, num_splits=splits)
        assert out.dtype == jnp.bfloat16
        assert_close(out, decode_oracle(q, kc, vc, bt, kv_lens, 0.125), jnp.bfloat16, f"{splits} splits")


@pytest.mark.parametrize("pages_per_iter,block_q", [(1, 16), (2, 32), (8, 128)])
def test_tiling_knobs(pages_per_iter, block_q):
    rng = np.random.default_rng(11)
    q, kc, vc, bt, cu, kv_lens = ragged_case(rng, 4, 64, jnp.float32)
    want = dense_oracle(q, kc, vc, bt, cu, kv_lens, 0.125)
    out = pl_ragged(q, kc, vc, bt, cu, kv_lens, scale=0.125, block_q=block_q,
                    pages_per_iter=pages_per_iter)
    assert_close(out, want, jnp.float32, "ragged tiling")
    q, kc, vc, bt, kv_lens = decode_case(rng, 4, 64, jnp.float32)
    want = decode_oracle(q, kc, vc, bt, kv_lens, 0.125)
    out = pl_decode(q, kc, vc, bt, kv_lens, scale=0.125, pages_per_iter=pages_per_iter)
    assert_close(out, want, jnp.float32, "decode tiling")


def test_block_size_8_and_all_idle():
    """A smaller block (more blocks per inner step) and a step where every slot is idle
    or every sequence has no query rows."""
    rng = np.random.default_rng(3)
    kc, vc = make_cache(rng, HKV, 64, jnp.float32, block_size=8)
    lens = [0, 1, 7, 8, 9, 60]
    bt = make_block_tables(rng, lens, block_size=8)
    q = on_device(rng.standard_normal((len(lens), HKV * 4, 64)), jnp.float32)
    kv = on_device(lens, jnp.int32)
    assert_close(pl_decode(q, kc, vc, bt, kv, scale=0.125),
                 decode_oracle(q, kc, vc, bt, kv, 0.125), jnp.float32, "bs=8 decode")
    zero = on_device(np.zeros(len(lens)), jnp.int32)
    assert not np.asarray(pl_decode(q, kc, vc, bt, zero, scale=0.125)).any()
    qr = on_device(rng.standard_normal((16, HKV * 4, 64)), jnp.float32)
    cu0 = on_device(np.zeros(len(lens) + 1), jnp.int32)
    assert not np.asarray(pl_ragged(qr, kc, vc, bt, cu0, kv, scale=0.125)).any()


# ---- random ragged batches (hypothesis; few examples: interpret mode is slow) ---------

@st.composite
def ragged_batches(draw, num_seqs=len(RAGGED_SEQS), max_tokens=48, max_ctx=WIDTH * BS):
    """The shapes of the edge-case batches (so the configurations above compiled them
    already): num_seqs sequences whose contexts fit the NUM_BLOCKS - 1 usable blocks."""
    seqs = []
    budget, blocks_left = max_tokens, NUM_BLOCKS - 1
    for _ in range(num_seqs):
        q_len = draw(st.integers(0, min(budget, 24, blocks_left * BS)))
        budget -= q_len
        prefix = draw(st.sampled_from([0, 1, BS - 1, BS, BS + 1, 50, max_ctx - 24]))
        kv_len = min(prefix + q_len, max_ctx) if q_len else draw(st.sampled_from([0, prefix]))
        kv_len = max(min(kv_len, blocks_left * BS), q_len)
        blocks_left -= -(-kv_len // BS)
        seqs.append((q_len, kv_len))
    return seqs


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=ragged_batches(), seed=st.integers(0, 2**16), R=st.sampled_from([1, 4, 8]),
       D=st.sampled_from([64, 128]), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_random_ragged_batches(seqs, seed, R, D, dtype):
    """Random batches over the GQA group sizes, head dims and dtypes of CONFIGS (the same
    ones every run: conftest derandomizes; `--hypothesis-profile=explore` draws new ones)."""
    rng = np.random.default_rng(seed)
    scale = D ** -0.5
    q, kc, vc, bt, cu, kv_lens = ragged_case(rng, R, D, dtype, seqs=seqs)
    want = dense_oracle(q, kc, vc, bt, cu, kv_lens, scale)
    assert_close(ref_ragged(q, kc, vc, bt, cu, kv_lens, scale=scale), want, dtype, "ref")
    assert_close(pl_ragged(q, kc, vc, bt, cu, kv_lens, scale=scale), want, dtype, "kernel")
    # the same context lengths as a decode step (one query per slot)
    n = len(DECODE_LENS)  # the decode configurations' shapes
    kvd, qd, btd = (on_device(x, x.dtype) for x in (np.asarray([b for _, b in seqs[:n]], np.int32),
                                                    np.asarray(q)[:n], np.asarray(bt)[:n]))
    want = decode_oracle(qd, kc, vc, btd, kvd, scale)
    assert_close(pl_decode(qd, kc, vc, btd, kvd, scale=scale), want, dtype, "decode")


# ---- backend selection ----------------------------------------------------------------

def test_backend_selection():
    auto = ab.select_attention_backend("auto", ab.AttentionShape(8, 2, 64, BS, "float32"))
    assert auto.name == ("pallas" if ON_GPU else "xla")
    assert ab.get_attention_backend("xla").decode is kp.paged_decode_attention_ref
    with pytest.raises(ValueError):
        ab.get_attention_backend("cuda")
    be = ab.get_attention_backend("pallas")  # interpret mode chosen by the platform
    assert be.name == "pallas"

    rng = np.random.default_rng(5)
    q, kc, vc, bt, cu, kv_lens = ragged_case(rng, 4, 64, jnp.float32)

    @jax.jit
    def step(q, kc, vc, bt, cu, kv_lens):  # as model.py calls it, inside a jitted step
        return (be.ragged(q, kc, vc, bt, cu, kv_lens, scale=0.125),
                be.decode(q[:8], kc, vc, bt, kv_lens, scale=0.125))

    rag, dec = step(q, kc, vc, bt, cu, kv_lens)
    assert_close(rag, dense_oracle(q, kc, vc, bt, cu, kv_lens, 0.125), jnp.float32, "ragged")
    assert_close(dec, decode_oracle(np.asarray(q)[:8], kc, vc, bt, kv_lens, 0.125), jnp.float32, "decode")


def test_model_forward_pallas_matches_xla():
    """The tiny model's prefill (ragged) and decode steps give the same hidden states
    with either backend, inside the model's jitted forward with its cache writes."""
    from flax import nnx

    import model as model_lib
    from kvcache import create_kv_caches
    from model_loader import BUILTIN_MODELS

    cfg = BUILTIN_MODELS["tiny"]
    graphdef, state = nnx.split(model_lib.init_model(cfg, "float32", 0))
    bs = 4
    bt = np.array([[3, 1, 7, 0, 0], [2, 5, 4, 6, 8]], np.int32)  # shuffled; 0 = null
    i32 = functools.partial(on_device, dtype=jnp.int32)

    def slots(seq, positions):
        return [int(bt[seq, p // bs]) * bs + p % bs for p in positions]

    prompt = [(0, list(range(6))), (1, list(range(17)))]  # (seq, positions)
    T = 24  # 23 real tokens + one padding row, which writes to the null block
    pre = model_lib.AttentionInputs(
        i32(sum((slots(s, p) for s, p in prompt), []) + [0]), i32(bt), i32([6, 17]), i32([0, 6, 23]))
    dec = model_lib.AttentionInputs(i32(slots(0, [6]) + slots(1, [17])), i32(bt), i32([7, 18]))
    rng = np.random.default_rng(0)
    toks = i32(rng.integers(0, cfg.vocab_size, T))
    pos = i32(list(range(6)) + list(range(17)) + [0])

    outs = {}
    for name in ("xla", "pallas"):
        be = ab.get_attention_backend(name)

        @jax.jit
        def fwd(state, tokens, positions, caches, attn, be=be):
            return nnx.merge(graphdef, state)(tokens, positions, caches, attn, be)

        caches = create_kv_caches(cfg, 9, bs, jnp.float32)  # [L, blocks, bs, hkv, hd], the scanned layout
        with jax.default_matmul_precision("highest"):  # no TF32 in XLA's matmuls on GPU
            h_pre, caches = fwd(state, toks, pos, caches, pre)
            h_dec, _ = fwd(state, i32(np.asarray(toks)[:2]), i32([6, 17]), caches, dec)
        outs[name] = (np.asarray(h_pre[:23]), np.asarray(h_dec))
    for a, b in zip(outs["xla"], outs["pallas"]):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)


def test_ragged_tile_sequences():
    cu = on_device([0, 3, 3, 5, 21, 21], jnp.int32)  # seq 1 and 4 empty
    first, count = kp.ragged_tile_sequences(cu, num_tiles=4, tile=8)
    # tile 0: rows 0-7 -> seqs 0..3; tile 1: 8-15 -> seq 3; tile 2: 16-20 -> seq 3; tile 3: none
    assert np.asarray(first).tolist()[:3] == [0, 3, 3]
    assert np.asarray(count).tolist() == [4, 1, 1, 0]


def test_only_the_triton_deprecation_warning_is_hidden():
    import warnings
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        kp.hide_triton_deprecation()
        # JAX 0.11.2's exact text (jax/_src/pallas/triton/pallas_call_registration.py)
        warnings.warn("The Pallas Triton backend is deprecated and will be removed in a future JAX "
                      "version. To keep using Pallas on GPU, please migrate to the Mosaic GPU backend.",
                      DeprecationWarning)
        warnings.warn("The Pallas Mosaic GPU thing is deprecated", DeprecationWarning)
        warnings.warn("The Pallas Triton backend is deprecated (but as a UserWarning)", UserWarning)
    assert [str(w.message)[:25] for w in seen] == ["The Pallas Mosaic GPU thi", "The Pallas Triton backend"]
    assert seen[1].category is UserWarning


# ---- the GPU lowering, checked from CPU ------------------------------------------------

def _jaxlib_version():
    import jaxlib
    return tuple(int(x) for x in jaxlib.__version__.split(".")[:3])


def _lower_for_cuda(traced) -> str:
    """The CUDA lowering's text, from a CPU-only machine. Known to work up to jaxlib
    0.10.2, where a failure is a failure. A later jaxlib is tried too; if it cannot
    lower for CUDA without a GPU, the test is skipped with its exact error, not
    silently dropped by a version check."""
    try:
        return traced.lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:
        if _jaxlib_version() <= (0, 10, 2):
            raise
        import jaxlib
        first_line = (str(e).strip().splitlines() or [""])[0][:300]
        pytest.skip(f"jaxlib {jaxlib.__version__} cannot cross-lower the kernels for CUDA without a GPU: "
                    f"{type(e).__name__}: {first_line}")


@pytest.mark.skipif(ON_GPU, reason="on a GPU the tests above run the compiled kernels instead")
@pytest.mark.parametrize("R,D,dtype", [(4, 128, jnp.bfloat16), (1, 64, jnp.float32),
                                       (8, 64, jnp.bfloat16), (7, 128, jnp.bfloat16)])
def test_lowers_to_triton(R, D, dtype):
    """Lower both kernels for CUDA through Pallas' Triton backend (to Triton IR: shape
    rules, indexing, dot sizes). Does not check the PTX compilation that follows."""
    S, T, Hkv, NB = 8, 64, 8, 64
    q = jax.ShapeDtypeStruct((S, Hkv * R, D), dtype)
    qr = jax.ShapeDtypeStruct((T, Hkv * R, D), dtype)
    kc = jax.ShapeDtypeStruct((NB, BS, Hkv, D), dtype)
    bt = jax.ShapeDtypeStruct((S, 24), jnp.int32)
    lens = jax.ShapeDtypeStruct((S,), jnp.int32)
    cu = jax.ShapeDtypeStruct((S + 1,), jnp.int32)
    dec = jax.jit(functools.partial(kp.paged_decode_attention, scale=0.1))
    rag = jax.jit(functools.partial(kp.ragged_paged_attention, scale=0.1))
    for f, args in ((dec, (q, kc, kc, bt, lens)), (rag, (qr, kc, kc, bt, cu, lens))):
        text = _lower_for_cuda(f.trace(*args))
        assert "xla.gpu.triton" in text


@pytest.mark.skipif(ON_GPU, reason="as test_lowers_to_triton")
def test_one_split_decode_lowers_to_triton():
    """The one-split decode (normalise and store bf16 in the kernel) lowers too."""
    q = jax.ShapeDtypeStruct((4, 32, 128), jnp.bfloat16)
    kc = jax.ShapeDtypeStruct((64, BS, 8, 128), jnp.bfloat16)
    bt = jax.ShapeDtypeStruct((4, 16), jnp.int32)
    lens = jax.ShapeDtypeStruct((4,), jnp.int32)
    dec = jax.jit(functools.partial(kp.paged_decode_attention, scale=0.1, num_splits=1))
    assert "xla.gpu.triton" in _lower_for_cuda(dec.trace(q, kc, kc, bt, lens))


@pytest.mark.skipif(ON_GPU, reason="as test_lowers_to_triton")
def test_backend_kernel_lowered_once_per_shape():
    """The model calls attention once per layer with the same shapes: the jitted backend
    functions make that one Triton kernel in the module, not one per layer."""
    be = ab.get_attention_backend("pallas", interpret=False)
    q = jax.ShapeDtypeStruct((4, 32, 128), jnp.bfloat16)
    kc = jax.ShapeDtypeStruct((64, BS, 8, 128), jnp.bfloat16)
    bt = jax.ShapeDtypeStruct((4, 16), jnp.int32)
    lens = jax.ShapeDtypeStruct((4,), jnp.int32)

    def layers(q, kc, vc, bt, lens):
        for _ in range(4):
            q = be.decode(q, kc, vc, bt, lens, scale=0.1)
        return q

    text = _lower_for_cuda(jax.jit(layers).trace(q, kc, kc, bt, lens))
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 1
