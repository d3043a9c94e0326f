"""Attention backends: the one registry of paged-attention implementations, and the
choice an engine makes among them once, at start-up.

A backend is one `register(BackendSpec(...))`: its name, a `build(interpret)` that returns
its decode and ragged functions (the signatures of kernels_pallas.py's references), and
what it needs, declared as data: the platforms it compiles for (elsewhere it runs
interpreted), which shapes must be powers of two, whether it must pass a check against
the references before it serves, whether `auto` may pick it. Callers ask the
registration; nothing outside this file compares backend names.

`--attention-backend auto` serves the first backend that declares `auto` for this
platform, but only after its decode and ragged functions have run once at start-up on
small inputs of the engine's own shapes (head_dim, block size, GQA group, dtype) and
matched the references. Anything else -- Pallas' Triton backend missing from this JAX, a
head_dim or block size its lowering cannot take, a compile error, a wrong or non-finite
result -- is logged in one line saying what failed, and the engine serves with the
reference backend (`xla`): slower, never down. A kernel that cannot run must not crash
the engine at start-up for a reason no user can act on.

A checked backend asked for by name runs the same check and raises instead: asking for
the kernels by name means wanting to know when they do not work. Off its platforms it
runs interpreted (slow, for checking), unchecked.

JAX and the kernels are imported inside the functions that run them: config.py, which the
JAX-free scheduler imports, validates --attention-backend against this registry.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from policy import Registry

if TYPE_CHECKING:
    import jax

log = logging.getLogger("taxirank.attention")

AUTO = "auto"

# Max abs error of a kernel against the reference on the probe's O(1) outputs. Loose
# enough for a GPU's summation order and bf16 rounding of p and of the output (the tests'
# tolerances against a float64 oracle are 1e-5 and 2e-2), tight enough that a missing
# block, a wrong mask or a wrong head shows up (those move outputs by ~0.1 or more).
PROBE_TOL = {"float32": 2e-4, "bfloat16": 3e-2, "float16": 3e-2}

AttentionFn = Callable[..., "jax.Array"]


@dataclass(frozen=True)
class AttentionBackend:
    """The pair of attention functions the model calls; chosen once per engine."""

    name: str
    decode: AttentionFn
    ragged: AttentionFn


def _available() -> str | None:
    return None


@dataclass(frozen=True, eq=False)  # hashed by identity: the start-up verdict is cached per registration
class BackendSpec:
    """One registered backend and what it needs."""

    name: str
    build: Callable[[bool], tuple[AttentionFn, AttentionFn]]  # interpret -> (decode, ragged)
    platforms: tuple[str, ...] = ()  # jax.default_backend() names it compiles for; () = every one
    auto: bool = False  # `auto` may serve it on its platforms (after its check)
    checked: bool = False  # compiled, it must match the reference at start-up before serving
    power_of_two: tuple[str, ...] = ()  # AttentionShape fields its compiled form needs as powers of two
    unavailable: Callable[[], str | None] = _available  # why it cannot compile in this process
    # extra decode calls the check makes: (label, keyword arguments)
    decode_variants: tuple[tuple[str, dict[str, Any]], ...] = ()

    def compiled_on(self, platform: str) -> bool:
        return not self.platforms or platform in self.platforms

    # One backend object per registration and mode: engines built on it share their step
    # programs (compilation.ProgramKey compares the functions by identity).
    @functools.lru_cache(maxsize=None)
    def make(self, interpret: bool = False) -> AttentionBackend:
        decode, ragged = self.build(interpret)
        return AttentionBackend(self.name, decode, ragged)


# --attention-backend: name -> registration (`auto` chooses among them: select_attention_backend)
BACKENDS: Registry[BackendSpec] = Registry("attention_backend", also=(AUTO,))


def register(spec: BackendSpec) -> BackendSpec:
    """Add a backend; its name becomes a valid --attention-backend."""
    if spec.name in BACKENDS.also or spec.name in BACKENDS:
        raise ValueError(f"attention backend {spec.name!r} is already registered")
    BACKENDS[spec.name] = spec
    return spec


def get_attention_backend(name: str, interpret: bool | None = None) -> AttentionBackend:
    """Registered backend `name`, built without the start-up check; `interpret` defaults
    to "not on one of its platforms"."""
    import jax

    BACKENDS.check(name)
    spec = BACKENDS[name]
    return spec.make(not spec.compiled_on(jax.default_backend()) if interpret is None else interpret)


# ---- the registrations ------------------------------------------------------------

def _build_reference(interpret: bool) -> tuple[AttentionFn, AttentionFn]:
    import kernels_pallas as kp

    return kp.paged_decode_attention_ref, kp.ragged_paged_attention_ref


def _build_pallas(interpret: bool) -> tuple[AttentionFn, AttentionFn]:
    import jax

    import kernels_pallas as kp

    # jitted, so that the model's identical per-layer calls lower (and compile the Triton
    # kernel) once per shape instead of once per layer
    knobs = ("scale", "pages_per_iter", "num_warps", "num_stages")
    decode = jax.jit(functools.partial(kp.paged_decode_attention, interpret=interpret),
                     static_argnames=knobs + ("num_splits",))
    ragged = jax.jit(functools.partial(kp.ragged_paged_attention, interpret=interpret),
                     static_argnames=knobs + ("block_q",))
    return decode, ragged


def _triton_unavailable() -> str | None:
    import kernels_pallas as kp

    return kp.triton_unavailable()


# The jnp references: every platform, the check's oracle and the fallback of `auto`.
REFERENCE = register(BackendSpec("xla", _build_reference))
register(BackendSpec(
    "pallas", _build_pallas, platforms=("gpu",), auto=True, checked=True,
    power_of_two=("head_dim", "block_size"), unavailable=_triton_unavailable,
    # the probe's long context has 3 chunks: 2 splits take chunks (0, 2) and (1), a second
    # lap; large batches run one split, which has its own output path
    decode_variants=(("two splits", {"num_splits": 2}), ("one split", {"num_splits": 1}))))


# ---- choosing, and the start-up check ---------------------------------------------

@dataclass(frozen=True)
class AttentionShape:
    """What the kernels are compiled for: the model's heads, the cache's block size and
    dtype. Only the GQA group (num_q_heads / num_kv_heads) matters to the probe, which
    uses two KV heads whatever the model has."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # numpy dtype name of the model (the queries; the KV cache's under kv_cache_dtype auto)
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: an 8-bit cache is probed quantized

    @classmethod
    def of(cls, model_config: Any, block_size: int, dtype: Any, kv_cache_dtype: str = "auto") -> "AttentionShape":
        return cls(model_config.num_attention_heads, model_config.num_key_value_heads,
                   model_config.head_dim, block_size, np.dtype(dtype).name, kv_cache_dtype)


def unsupported_reason(spec: BackendSpec, shape: AttentionShape) -> str | None:
    """Why `spec`, compiled, cannot serve this shape at all, before trying it."""
    reason = spec.unavailable()
    if reason is not None:
        return reason
    for what in spec.power_of_two:
        n = getattr(shape, what)
        if n < 1 or n & (n - 1):
            return f"{spec.name} needs a power-of-two {what}, got {n}"
    if shape.num_q_heads % shape.num_kv_heads:
        return f"{shape.num_q_heads} query heads are not a multiple of {shape.num_kv_heads} KV heads"
    return None


def _probe_inputs(shape: AttentionShape):
    """A decode batch and a ragged batch that touch every path: an idle slot, a first
    token, a block boundary, several inner-loop chunks (and so several decode splits),
    a prompt chunk over a cached prefix, a decode inside a mixed step, padding rows."""
    import jax.numpy as jnp

    BS, D, hkv = shape.block_size, shape.head_dim, 2
    hq = hkv * (shape.num_q_heads // shape.num_kv_heads)
    chunk = max(1, 64 // BS) * BS  # keys per kernel step at the default tiling
    long = 2 * chunk + BS + 3      # three chunks (the last partial): 3 splits by default
    dec_lens = [0, 1, BS + 1, long]
    # ragged (q_len, kv_len): decode, fresh prompt over a block edge, chunk after a prefix
    seqs = [(1, long), (BS + 1, BS + 1), (7, chunk + 7), (0, 0)]
    W = -(-long // BS)
    rng = np.random.default_rng(0)
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
    import kernels_pallas as kp

    stored = kp.kv_storage_dtype(shape.kv_cache_dtype)
    if stored is not None:
        kc, vc = (kp.QuantizedKV(*kp.quantize_kv(c, stored)) for c in (kc, vc))
    decode = (jnp.asarray(rng.standard_normal((len(dec_lens), hq, D)), dt), kc, vc,
              table(dec_lens), jnp.asarray(dec_lens, jnp.int32))
    q_lens = [a for a, _ in seqs]
    T = sum(q_lens) + 5  # padding rows, which must come back 0
    ragged = (jnp.asarray(rng.standard_normal((T, hq, D)), dt), kc, vc,
              table([kv for _, kv in seqs]), jnp.asarray(np.cumsum([0] + q_lens), jnp.int32),
              jnp.asarray([kv for _, kv in seqs], jnp.int32))
    return decode, ragged


def _mismatch(got: Any, want: Any, tol: float) -> str | None:
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want).astype(np.float64)
    if got.shape != want.shape:
        return f"gave shape {got.shape}, expected {want.shape}"
    if not np.isfinite(got).all():
        return "gave non-finite values"
    err = float(np.abs(got - want).max()) if got.size else 0.0
    if not err <= tol:
        return f"differs from the reference by {err:.3g} (tolerance {tol:g})"
    return None


@functools.lru_cache(maxsize=None)
def _jitted_reference() -> AttentionBackend:
    import jax

    ref = REFERENCE.make()
    return AttentionBackend(ref.name, jax.jit(ref.decode, static_argnames="scale"),
                            jax.jit(ref.ragged, static_argnames="scale"))


def probe_kernels(shape: AttentionShape, candidate: AttentionBackend,
                  decode_variants: tuple[tuple[str, dict[str, Any]], ...] = ()) -> str | None:
    """Run candidate.decode (as is, then with each variant's keyword arguments) and
    candidate.ragged once on small inputs of `shape`, and compare with the references at
    full f32 matmul precision. None when all match, else one line saying what failed
    (exceptions included: compile errors surface here, not in warm-up)."""
    import jax

    scale = shape.head_dim ** -0.5
    tol = PROBE_TOL.get(shape.dtype, 3e-2)
    decode, ragged = _probe_inputs(shape)
    ref = _jitted_reference()
    runs: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
        ("decode kernel", lambda: candidate.decode(*decode, scale=scale),
         lambda: ref.decode(*decode, scale=scale))]
    for label, kw in decode_variants:
        runs.append((f"decode kernel ({label})", functools.partial(candidate.decode, *decode, scale=scale, **kw),
                     lambda: ref.decode(*decode, scale=scale)))
    runs.append(("ragged kernel", lambda: candidate.ragged(*ragged, scale=scale),
                 lambda: ref.ragged(*ragged, scale=scale)))
    for what, run, want in runs:
        try:
            got = jax.block_until_ready(run())
        except Exception as e:  # any failure to compile or run is a verdict, not a crash
            return f"{what} raised {type(e).__name__}: {' '.join(str(e).split())[:400]}"
        with jax.default_matmul_precision("highest"):  # no TF32 in the reference on GPU
            bad = _mismatch(got, want(), tol)
        if bad:
            return f"{what} {bad} ({shape})"
    return None


@functools.lru_cache(maxsize=None)
def _verdict(spec: BackendSpec, shape: AttentionShape) -> str | None:
    """A compiled backend's start-up check for a shape, once per process (the engine may
    build more than one runner)."""
    return unsupported_reason(spec, shape) or probe_kernels(shape, spec.make(), spec.decode_variants)


def select_attention_backend(name: str, shape: AttentionShape) -> AttentionBackend:
    """The backend the engine serves with (see the module docstring)."""
    import jax

    BACKENDS.check(name)
    platform = jax.default_backend()
    if name == AUTO:
        spec = next((s for s in BACKENDS.values() if s.auto and s.compiled_on(platform)), REFERENCE)
    else:
        spec = BACKENDS[name]
    if not spec.compiled_on(platform):
        return spec.make(interpret=True)
    if not spec.checked:
        return spec.make()
    reason = _verdict(spec, shape)
    if reason is None:
        return spec.make()
    reason = " ".join(reason.split())  # one line
    if name != AUTO:
        raise RuntimeError(f"--attention-backend {name}: failed the start-up check: {reason}. "
                           f"Use --attention-backend {AUTO} or {REFERENCE.name}.")
    log.warning("attention backend: %s failed the start-up check (%s); serving with the %s backend "
                "(jnp references) instead", spec.name, reason, REFERENCE.name)
    return REFERENCE.make()
