"""The step programs as compiled objects: a runner's jitted forward, sample, prompt-logprob
and KV-copy programs (runner.py's docstring describes a step), the key they are built from,
and how the engines of one process share them and count their compiles.

Engines with equal keys share one set of programs (shared_programs); a trace, the only
time a program's Python runs, counts as a compile for the engine whose call caused it
(CountedProgram). The draft model (draft_model.py) shares and counts its programs the
same way.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from attention_backend import AttentionBackend
from config import LogprobsKind
from metrics import EngineStats
from model import AttentionInputs
from parallel import constrain_step_outputs
from sampler import SamplingTensors, emitted_logprobs, rejection_sample, sample_rows, token_logprobs

# Rows the sample program samples at a time (sampler.sample_rows): 8 x a 49152-token
# vocabulary is 1.5 MB of f32, which stays in cache through the sampler's passes.
SAMPLE_CHUNK = 8


def prompt_logprobs(logits_fn: Callable[[jax.Array], jax.Array], hidden: jax.Array, targets: jax.Array,
                    chunk: int, width: int) -> tuple[jax.Array, ...]:
    """For each of the P rows of hidden (a ragged step's final hidden states, flat tokens
    first): the logprob of targets[t] (the next prompt token; -1: none asked) under the
    logits of t, its rank, and the top `width`. Raw logprobs whatever --logprobs-mode, as
    vLLM's prompt logprobs. `chunk` rows at a time (lax.map), so
    the program's logits buffer is bounded, and a chunk without a target is skipped
    (lax.cond): a step pays for the rows of the chunks that ask."""
    P = hidden.shape[0]
    assert P % chunk == 0, (P, chunk)

    def compute(h: jax.Array, tg: jax.Array) -> tuple[jax.Array, ...]:
        return token_logprobs(logits_fn(h).astype(jnp.float32), jnp.maximum(tg, 0), False, width)

    def skip(h: jax.Array, tg: jax.Array) -> tuple[jax.Array, ...]:
        return (jnp.zeros(chunk, jnp.float32), jnp.zeros(chunk, jnp.int32),
                jnp.zeros((chunk, width), jnp.int32), jnp.zeros((chunk, width), jnp.float32))

    def rows(c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        return jax.lax.cond(jnp.any(c[1] >= 0), compute, skip, *c)

    n = P // chunk
    out = jax.lax.map(rows, (hidden.reshape(n, chunk, hidden.shape[1]), targets.reshape(n, chunk)))
    return tuple(x.reshape(P, *x.shape[2:]) for x in out)


@dataclass(frozen=True)
class ProgramKey:
    """All that a runner's step programs close over. Runners with equal keys (the same
    model structure, attention backend, mesh and shapes: another engine built in this
    process on the same model and flags) share one set of jitted programs, and with them
    every trace, lowering and compile already done; an engine's weights and caches are
    the programs' arguments, never part of them."""

    graphdef: Any  # nnx.GraphDef: the model's modules, its ModelConfig and weight quantization
    backend: AttentionBackend  # equal when its functions are the same objects
    mesh: Mesh | None
    max_num_seqs: int  # N: the idle slot's index, and the verifier's padded rows
    logprobs: LogprobsKind
    logprobs_width: int
    spec_k: int
    spec_buckets: tuple[int, ...]
    prompt_chunk: int


class StepPrograms(NamedTuple):
    decode: Callable
    ragged: Callable
    sample: Callable
    prompt_logprobs: Callable
    gather_blocks: Callable  # swap preemption's copies of KV blocks, out and in
    scatter_blocks: Callable


# The runner a program is being called for, per thread: a trace (the only time a
# program's Python runs) is a compile, counted in that runner's EngineStats.
_caller = threading.local()


def count_compile() -> None:
    stats = getattr(_caller, "stats", None)
    if stats is not None:
        stats.num_compilations += 1


class CountedProgram:
    """One shared program as one runner calls it: a compile it causes is that runner's."""

    __slots__ = ("fn", "stats")

    def __init__(self, fn: Callable, stats: EngineStats) -> None:
        self.fn, self.stats = fn, stats

    def __call__(self, *args: Any) -> Any:
        _caller.stats = self.stats
        return self.fn(*args)

    def lower(self, *args: Any) -> Any:
        _caller.stats = self.stats
        return self.fn.lower(*args)


_PROGRAM_CACHES: list[Any] = []  # every shared_programs factory of the process


def shared_programs(maxsize: int) -> Callable[[Callable], Callable]:
    """A factory of jitted programs, cached by its (hashable) arguments: engines that
    call it with equal arguments share the programs. Bounded: a process that builds
    engines of many shapes (a test run, a notebook) keeps the latest few."""
    def wrap(build: Callable) -> Callable:
        cached = functools.lru_cache(maxsize=maxsize)(build)
        _PROGRAM_CACHES.append(cached)
        return cached
    return wrap


@contextlib.contextmanager
def persistent_cache_hits():
    """[n]: the executables JAX loaded from its persistent compilation cache meanwhile, in
    this process (instead of compiling them)."""
    hits = [0]

    def count(event: str, **_: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            hits[0] += 1

    jax.monitoring.register_event_listener(count)
    try:
        yield hits
    finally:
        jax.monitoring.unregister_event_listener(count)


class Built:
    """`with Built(stats) as b:` the programs built meanwhile for the engine whose stats
    they are, once the block ends: b.traced (a trace is a build: CountedProgram), b.loaded
    (of those, the ones whose executable JAX read from its persistent compilation cache
    instead of compiling it), b.seconds; str(b) says how they were got."""

    def __init__(self, stats: EngineStats) -> None:
        self.stats = stats
        self.traced = self.loaded = 0
        self.seconds = 0.0

    def __enter__(self) -> Built:
        self._t0, self._before = time.perf_counter(), self.stats.num_compilations
        self._listening = persistent_cache_hits()
        self._hits = self._listening.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._listening.__exit__(*exc)
        self.traced = self.stats.num_compilations - self._before
        self.loaded = min(self._hits[0], self.traced)
        self.seconds = time.perf_counter() - self._t0

    def __str__(self) -> str:
        if not self.traced:  # an engine of this process with the same ProgramKey built them
            return "compiled already"
        if not self.loaded:
            how = "compiled"
        elif self.loaded == self.traced:
            how = "loaded from the compilation cache"
        else:
            how = f"{self.loaded} loaded from the compilation cache, {self.traced - self.loaded} compiled"
        return f"{how} in {self.seconds:.1f}s"


def warmup_summary(programs: str, every: str, built: Built, loaded: int) -> str:
    """A warm-up's line: '<programs> compiled in Xs', or how many of them (loaded) came from
    the persistent cache (a restart traces every program again, but XLA compiles none that
    the cache holds). Where `built` saw none built, '<every> were compiled already': an
    earlier engine of this process with the same ProgramKey (model structure, not weights,
    and the settings that shape a step) built them."""
    compiled, seconds = built.traced, built.seconds
    if not compiled:
        return f"warm-up: {every} were compiled already, by an engine of this process with the same model structure " \
               "and settings"
    if not loaded:
        return f"warm-up: {programs} compiled in {seconds:.1f}s"
    hits = min(loaded, compiled)
    return f"warm-up: {programs} in {seconds:.1f}s: {hits} loaded from the compilation cache, " \
           f"{compiled - hits} compiled"


def clear_program_caches() -> None:
    """Engines built after this trace and compile programs of their own (or load them from
    the persistent cache), as in a new process; the caches' executables are freed once no
    engine holds them. Build times measured after it are whole builds."""
    for cached in _PROGRAM_CACHES:
        cached.cache_clear()


def spec_branches(buckets: tuple[int, ...], rows: int) -> tuple[int, ...]:
    """The verified-row counts a program of `rows` rows has a branch for."""
    return (*(b for b in buckets if b < rows), rows)


@shared_programs(maxsize=16)
def step_programs(key: ProgramKey) -> StepPrograms:
    """The jitted programs of a runner with this key (a step: runner.py's docstring)."""
    graphdef, backend, mesh, N = key.graphdef, key.backend, key.mesh, key.max_num_seqs
    mode, width, K = key.logprobs, key.logprobs_width, key.spec_k
    # Under TP the updated cache must come back split as it went in (it is donated).
    keep = (lambda kv, rest: (kv, *rest)) if mesh is None else functools.partial(constrain_step_outputs, mesh=mesh)

    def forward(state, kv_caches, last_tokens, logits, tokens, token_src, positions, attn, rows,
                hidden_buf=None, spec_in=None, sampling=None):
        model = nnx.merge(graphdef, state)
        tokens = jnp.where(token_src >= 0, last_tokens[jnp.maximum(token_src, 0)], tokens)
        hidden, kv_caches = model(tokens, positions, kv_caches, attn, backend)
        row_logits = model.compute_logits(hidden if rows is None else hidden[rows])
        extra: tuple = (logits.at[:row_logits.shape[0]].set(row_logits),)
        if hidden_buf is not None:  # for the prompt-logprob program, when a row asks
            assert hidden.dtype == hidden_buf.dtype, (hidden.dtype, hidden_buf.dtype)
            extra = (*extra, hidden_buf.at[:hidden.shape[0]].set(hidden))
        if spec_in is not None:
            # A verified row's tokens are decided here, by rejection sampling over its
            # 1 + K positions: its last one goes to last_tokens now (the sample program
            # that follows leaves verified rows alone: their sample_slot is the idle one).
            spec_out = verify(model.compute_logits, hidden, attn.cu_q_lens, sampling, spec_in)
            last = jnp.take_along_axis(spec_out[0], (spec_out[1] - 1)[:, None], axis=1)[:, 0]
            extra = (*extra, spec_out, last_tokens.at[spec_in.slot].set(last))
        kv_caches, *extra = keep(kv_caches, extra)
        return kv_caches, tuple(extra)

    def verify(logits_fn, hidden, cu_q_lens, sampling, sp):
        """The LM head on each verified row's 1 + K positions (its last known token and
        its drafts), then rejection sampling; outputs padded to max_num_seqs rows."""
        branches = spec_branches(key.spec_buckets, cu_q_lens.shape[0] - 1)

        def rows(b):
            def branch():
                r = sp.row[:b]
                idx = cu_q_lens[r][:, None] + jnp.minimum(jnp.arange(K + 1)[None, :], sp.num[:b, None])
                logits = logits_fn(hidden[idx.reshape(-1)]).astype(jnp.float32).reshape(b, K + 1, -1)
                t = SamplingTensors(sampling.temperature[r], sampling.top_p[r], sampling.top_k[r],
                                    sampling.min_p[r], sampling.seed[r], sampling.step[r], sampling.want_logprobs)
                q = None if sp.draft_probs is None else sp.draft_probs[sp.src[:b]]
                toks, num = rejection_sample(logits, sp.draft[:b], sp.num[:b], t, q)
                out = (toks, num, *emitted_logprobs(logits, toks, t, sampling.want_logprobs, mode, width))
                return tuple(jnp.pad(x, [(0, N - b)] + [(0, 0)] * (x.ndim - 1)) for x in out)
            return branch

        def none():
            return (jnp.zeros((N, K + 1), jnp.int32), jnp.ones(N, jnp.int32),
                    jnp.zeros((N, K + 1), jnp.float32), jnp.zeros((N, K + 1), jnp.int32),
                    jnp.zeros((N, K + 1, width), jnp.int32),
                    jnp.zeros((N, K + 1, width), jnp.float32))

        return jax.lax.switch(sp.bucket, [none] + [rows(b) for b in branches])

    def decode_fn(state, kv_caches, last_tokens, logits, tokens, token_src, positions, slot_mapping,
                  block_tables, kv_lens):
        count_compile()
        attn = AttentionInputs(slot_mapping, block_tables, kv_lens, None)
        return forward(state, kv_caches, last_tokens, logits, tokens, token_src, positions, attn, None)

    def ragged_fn(state, kv_caches, last_tokens, logits, hidden_buf, tokens, token_src, positions, slot_mapping,
                  block_tables, kv_lens, cu_q_lens, spec_in=None, sampling=None):
        count_compile()
        attn = AttentionInputs(slot_mapping, block_tables, kv_lens, cu_q_lens)
        # Only each slot's last token of the step can be sampled: the LM head runs on
        # S rows, not T (all T only in the prompt-logprob program, when asked; 1 + K
        # for a verified row: spec_in).
        last = jnp.maximum(cu_q_lens[1:] - 1, 0)
        return forward(state, kv_caches, last_tokens, logits, tokens, token_src, positions, attn, last,
                       hidden_buf, spec_in, sampling)

    def sample_fn(last_tokens, logits, sample_slot, sampling):
        count_compile()
        # Rows up to the last one that samples (the others write the idle entry, N).
        num_rows = jnp.max(jnp.where(sample_slot != N, jnp.arange(1, sample_slot.shape[0] + 1), 0))
        res = sample_rows(logits, sampling, num_rows, min(SAMPLE_CHUNK, N), mode, width)
        _, last_tokens, res = keep((), (last_tokens.at[sample_slot].set(res[0]), res))
        return last_tokens, res

    def prompt_fn(state, hidden_buf, targets):
        count_compile()
        res = prompt_logprobs(nnx.merge(graphdef, state).compute_logits, hidden_buf, targets, key.prompt_chunk, width)
        _, res = keep((), (res,))
        return res

    def gather_fn(caches, idx):
        count_compile()
        return [c[:, idx] for c in caches]

    def scatter_fn(caches, idx, data):
        count_compile()
        return [c.at[:, idx].set(d) for c, d in zip(caches, data)]

    return StepPrograms(jax.jit(decode_fn, donate_argnums=(1, 3)), jax.jit(ragged_fn, donate_argnums=(1, 3, 4)),
                        jax.jit(sample_fn, donate_argnums=(0,)), jax.jit(prompt_fn), jax.jit(gather_fn),
                        jax.jit(scatter_fn, donate_argnums=0))
