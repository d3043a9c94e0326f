"""Which attention kernels serve: chosen once per engine, checked before serving.

On a GPU, `--attention-backend auto` serves the Pallas kernels only after both have run
once at start-up on small inputs of the engine's own shapes (head_dim, block size, GQA
group, dtype) and matched the jnp references. Anything else -- Pallas' Triton backend
missing from this JAX, a head_dim or block size its lowering cannot take, a compile
error, a wrong or non-finite result -- is logged in one line saying what failed, and the
engine serves with the `xla` backend (the references): slower, never down. A kernel that
cannot run must not crash the engine at start-up for a reason no user can act on.

`--attention-backend pallas` runs the same checks and raises instead: asking for the
kernels by name means wanting to know when they do not work. Off GPU, `auto` is `xla`,
and `pallas` runs the kernels in interpret mode (slow, for checking), unprobed.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import kernels_pallas as kp

log = logging.getLogger("taxirank.attention")

# Max abs error of a kernel against the reference on the probe's O(1) outputs. Loose
# enough for a GPU's summation order and bf16 rounding of p and of the output (the tests'
# tolerances against a float64 oracle are 1e-5 and 2e-2), tight enough that a missing
# block, a wrong mask or a wrong head shows up (those move outputs by ~0.1 or more).
PROBE_TOL = {"float32": 2e-4, "bfloat16": 3e-2, "float16": 3e-2}


@dataclass(frozen=True)
class AttentionShape:
    """What the kernels are compiled for: the model's heads, the cache's block size and
    dtype. Only the GQA group (num_q_heads / num_kv_heads) matters to the probe, which
    uses two KV heads whatever the model has."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # numpy dtype name of the KV cache

    @classmethod
    def of(cls, model_config: Any, block_size: int, dtype: Any) -> "AttentionShape":
        return cls(model_config.num_attention_heads, model_config.num_key_value_heads,
                   model_config.head_dim, block_size, jnp.dtype(dtype).name)


def unsupported_reason(shape: AttentionShape) -> str | None:
    """Why the compiled kernels cannot serve this shape at all, before trying them."""
    reason = kp.triton_unavailable()
    if reason is not None:
        return reason
    for what, n in (("head_dim", shape.head_dim), ("block_size", shape.block_size)):
        if n < 1 or n & (n - 1):
            return f"the Triton lowering needs a power-of-two {what}, got {n}"
    if shape.num_q_heads % shape.num_kv_heads:
        return f"{shape.num_q_heads} query heads are not a multiple of {shape.num_kv_heads} KV heads"
    return None


def _probe_inputs(shape: AttentionShape, seed: int = 0):
    """A decode batch and a ragged batch that touch every path: an idle slot, a first
    token, a block boundary, several inner-loop chunks (and so several decode splits),
    a prompt chunk over a cached prefix, a decode inside a mixed step, padding rows."""
    BS, D, hkv = shape.block_size, shape.head_dim, 2
    hq = hkv * (shape.num_q_heads // shape.num_kv_heads)
    chunk = max(1, 64 // BS) * BS  # keys per kernel step at the default tiling
    long = 2 * chunk + BS + 3      # three chunks (the last partial): 3 splits by default
    dec_lens = [0, 1, BS + 1, long]
    # ragged (q_len, kv_len): decode, fresh prompt over a block edge, chunk after a prefix
    seqs = [(1, long), (BS + 1, BS + 1), (7, chunk + 7), (0, 0)]
    W = -(-long // BS)
    rng = np.random.default_rng(seed)
    need = [-(-n // BS) for n in dec_lens] + [-(-kv // BS) for _, kv in seqs]
    num_blocks = 1 + sum(need)
    pool = iter(rng.permutation(np.arange(1, num_blocks)))  # shuffled; 0 is the null block

    def table(lens):
        bt = np.zeros((len(lens), W), np.int32)
        for i, n in enumerate(lens):
            for j in range(-(-n // BS)):
                bt[i, j] = next(pool)
        return jnp.asarray(bt)

    dt = jnp.dtype(shape.dtype)
    cache = (num_blocks, BS, hkv, D)
    kc = jnp.asarray(rng.standard_normal(cache), dt)
    vc = jnp.asarray(rng.standard_normal(cache), dt)
    decode = (jnp.asarray(rng.standard_normal((len(dec_lens), hq, D)), dt), kc, vc,
              table(dec_lens), jnp.asarray(dec_lens, jnp.int32))
    q_lens = [a for a, _ in seqs]
    T = sum(q_lens) + 5  # padding rows, which must come back 0
    ragged = (jnp.asarray(rng.standard_normal((T, hq, D)), dt), kc, vc,
              table([kv for _, kv in seqs]), jnp.asarray(np.cumsum([0] + q_lens), jnp.int32),
              jnp.asarray([kv for _, kv in seqs], jnp.int32))
    return decode, ragged


def _mismatch(got: Any, want: Any, tol: float) -> str | None:
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    if got.shape != want.shape:
        return f"gave shape {got.shape}, expected {want.shape}"
    if not np.isfinite(got).all():
        return "gave non-finite values"
    err = float(np.abs(got - want).max()) if got.size else 0.0
    if not err <= tol:
        return f"differs from the reference by {err:.3g} (tolerance {tol:g})"
    return None


ref_decode = jax.jit(kp.paged_decode_attention_ref, static_argnames="scale")
ref_ragged = jax.jit(kp.ragged_paged_attention_ref, static_argnames="scale")


def probe_kernels(shape: AttentionShape, candidate: kp.AttentionBackend) -> str | None:
    """Run candidate.decode (with its default split count, two splits and one) and
    candidate.ragged once on small inputs of `shape`, and compare with the jnp
    references at full f32 matmul precision. None when all match, else one line saying
    what failed (exceptions included: compile errors surface here, not in warm-up)."""
    scale = shape.head_dim ** -0.5
    tol = PROBE_TOL.get(shape.dtype, 3e-2)
    decode, ragged = _probe_inputs(shape)
    runs: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
        ("decode kernel", lambda: candidate.decode(*decode, scale=scale),
         lambda: ref_decode(*decode, scale=scale)),
        # the long context has 3 chunks: 2 splits take chunks (0, 2) and (1), a second lap
        ("decode kernel (two splits)", lambda: candidate.decode(*decode, scale=scale, num_splits=2),
         lambda: ref_decode(*decode, scale=scale)),
        ("decode kernel (one split)", lambda: candidate.decode(*decode, scale=scale, num_splits=1),
         lambda: ref_decode(*decode, scale=scale)),
        ("ragged kernel", lambda: candidate.ragged(*ragged, scale=scale),
         lambda: ref_ragged(*ragged, scale=scale)),
    ]
    for what, run, ref in runs:
        try:
            got = jax.block_until_ready(run())
        except Exception as e:  # any failure to compile or run is a verdict, not a crash
            return f"{what} raised {type(e).__name__}: {' '.join(str(e).split())[:400]}"
        with jax.default_matmul_precision("highest"):  # no TF32 in the reference on GPU
            want = ref()
        bad = _mismatch(got, want, tol)
        if bad:
            return f"{what} {bad} ({shape})"
    return None


@functools.lru_cache(maxsize=None)
def _probe_pallas(shape: AttentionShape) -> str | None:
    """The real kernels' verdict for a shape, once per process (the engine may build
    more than one runner)."""
    return unsupported_reason(shape) or probe_kernels(shape, kp.get_attention_backend("pallas", interpret=False))


def select_attention_backend(name: str, shape: AttentionShape, *, on_gpu: bool | None = None,
                             candidate: kp.AttentionBackend | None = None) -> kp.AttentionBackend:
    """The backend the engine serves with (see the module docstring).

    `candidate` replaces the real Pallas kernels (tests inject failing ones); `on_gpu`
    replaces the platform check (tests run the GPU path on CPU with interpreted or
    injected kernels)."""
    if name not in ("auto", "pallas", "xla"):
        raise ValueError(f"unknown attention backend {name!r} (expected auto, pallas or xla)")
    if on_gpu is None:
        on_gpu = jax.default_backend() == "gpu"
    xla = kp.get_attention_backend("xla")
    if name == "xla" or (name == "auto" and not on_gpu):
        return xla
    if not on_gpu:  # pallas off GPU: the kernels interpreted, for checking
        return candidate or kp.get_attention_backend("pallas", interpret=True)
    if candidate is None:
        reason = _probe_pallas(shape)
        candidate = kp.get_attention_backend("pallas", interpret=False)
    else:
        reason = unsupported_reason(shape) or probe_kernels(shape, candidate)
    if reason is None:
        return candidate
    reason = " ".join(reason.split())  # one line
    if name == "pallas":
        raise RuntimeError(f"--attention-backend pallas: the Pallas kernels failed the start-up "
                           f"check: {reason}. Use --attention-backend auto or xla.")
    log.warning("attention backend: Pallas kernels failed the start-up check (%s); "
                "serving with the xla backend (jnp references) instead", reason)
    return xla
