"""ModelRunner: the only place where the scheduler's decisions become device arrays.

Two jitted programs, both over fixed shapes, both with the KV cache donated (updated in
place) and both returning only the sampled tokens (and logprobs) to the host:

  decode  one token per occupied slot: token[R], pos[R], slot_mapping[R], block_tables[R, W], kv_lens[R]
  ragged  steps that carry prompt tokens (prefill, or chunks mixed with decodes): the
          step's tokens flattened and padded to a bucket T, cu_q_lens[S+1] per slot

W is max_model_len / block_size, but attention loops only over the blocks actually in
context (see kernels_pallas.py), so the width costs host->device bytes, not FLOPs.
The shapes that vary are the decode row count R (occupied slots, padded to a power of
two) and T, each from a few buckets, all compiled by warmup(): after it, a step never
compiles.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from config import EngineConfig
from distributed import DECODE, RAGGED, STOP, StepChannel
from kernels_pallas import get_attention_backend
from kvcache import create_kv_caches
from metrics import EngineStats
from model import AttentionInputs, LoadedModel
from parallel import constrain_step_outputs, create_sharded_kv_caches, shard_attention
from sampler import SamplingTensors, empty_sampling_arrays, fill_slot, sample
from scheduler import SchedulerOutput, Sequence


@dataclass
class StepResult:
    """What came back from the device for one step, in SchedulerOutput.scheduled order."""

    tokens: np.ndarray  # [n] i32
    logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # ([n], [n,K] ids, [n,K]) when asked


def _bucket(buckets: tuple[int, ...], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise AssertionError(f"{n} exceeds the largest bucket {buckets[-1]}")


def token_slice(seq: Sequence, start: int, n: int) -> list[int]:
    """seq.all_token_ids[start:start+n] without building the whole list."""
    p = seq.num_prompt_tokens
    if start >= p:
        return seq.output_token_ids[start - p:start - p + n]
    if start + n <= p:
        return seq.prompt_token_ids[start:start + n]
    return seq.prompt_token_ids[start:] + seq.output_token_ids[:start + n - p]


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, num_kv_blocks: int, stats: EngineStats,
                 mesh: Mesh | None = None):
        """mesh: tensor parallelism (parallel.py); loaded's params must already be on it."""
        self.config = config
        self.stats = stats
        self.loaded = loaded
        self.mesh = mesh
        self.backend = get_attention_backend(config.attention_backend)
        if mesh is not None:
            self.backend = shard_attention(self.backend, mesh)
        self.block_size = config.block_size
        graphdef, self.state = nnx.split(loaded.model)
        self.kv_caches = self.allocate_kv_caches(num_kv_blocks)
        # Multi-host: process 0 posts each scheduled step's inputs; the others follow().
        self.channel = StepChannel() if jax.process_count() > 1 else None
        backend = self.backend
        # Under TP the updated cache must come back split as it went in (it is donated).
        keep = (lambda kv, res: (kv, res)) if mesh is None else functools.partial(constrain_step_outputs, mesh=mesh)

        def count_compile() -> None:
            # Runs only while jax traces, i.e. once per compiled program.
            self.stats.num_compilations += 1

        def decode_fn(state, kv_caches, tokens, positions, slot_mapping, block_tables, kv_lens, sampling):
            count_compile()
            model = nnx.merge(graphdef, state)
            attn = AttentionInputs(slot_mapping, block_tables, kv_lens, None)
            hidden, kv_caches = model(tokens, positions, kv_caches, attn, backend)
            return keep(kv_caches, sample(model.compute_logits(hidden), sampling))

        def ragged_fn(state, kv_caches, tokens, positions, slot_mapping, block_tables, kv_lens, cu_q_lens, sampling):
            count_compile()
            model = nnx.merge(graphdef, state)
            attn = AttentionInputs(slot_mapping, block_tables, kv_lens, cu_q_lens)
            hidden, kv_caches = model(tokens, positions, kv_caches, attn, backend)
            # Only each slot's last token of the step can be sampled: the LM head runs on
            # S rows, not T.
            last = jnp.maximum(cu_q_lens[1:] - 1, 0)
            return keep(kv_caches, sample(model.compute_logits(hidden[last]), sampling))

        self._decode = jax.jit(decode_fn, donate_argnums=1)
        self._ragged = jax.jit(ragged_fn, donate_argnums=1)

    def allocate_kv_caches(self, num_blocks: int) -> Any:
        loaded, bs = self.loaded, self.config.block_size
        create = functools.partial(create_kv_caches, loaded.config, num_blocks, bs, loaded.dtype)
        return create() if self.mesh is None else create_sharded_kv_caches(create, self.mesh)

    # ------------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput, num_occupied: int) -> StepResult:
        """Run one step. Row i of every array is out.scheduled[i]: a sequence's slot is
        its seat in the scheduler's accounting; on the device only rows exist, so a
        decode step computes num_occupied rows (padded to a bucket), not max_num_seqs.
        Static batching passes its finished-but-seated sequences in num_occupied: the
        bus computes its empty seats. Results come back in out.scheduled order."""
        cfg = self.config
        W, BS = cfg.max_blocks_per_seq, self.block_size
        n_seqs = len(out.scheduled)
        R = _bucket(cfg.decode_buckets, max(num_occupied, n_seqs)) if out.is_decode_only else cfg.max_num_seqs
        q_lens = np.zeros(R, np.int32)
        q_lens[:n_seqs] = [sch.num_new_tokens for sch in out.scheduled]
        cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        num_real = int(cu_q_lens[-1])
        T = R if out.is_decode_only else _bucket(cfg.token_buckets, num_real)
        tokens, positions, slot_mapping = (np.zeros(T, np.int32) for _ in range(3))
        block_tables = np.zeros((R, W), np.int32)
        kv_lens = np.zeros(R, np.int32)
        samp = empty_sampling_arrays(R)
        want_logprobs = False
        for r, sch in enumerate(out.scheduled):
            seq, n, lo = sch.seq, sch.num_new_tokens, cu_q_lens[r]
            start = seq.num_computed_tokens
            assert n >= 1 and len(seq.block_table) * BS >= start + n, "blocks must be allocated before the step"
            block_tables[r, :len(seq.block_table)] = seq.block_table
            kv_lens[r] = start + n
            pos = np.arange(start, start + n, dtype=np.int32)
            tokens[lo:lo + n] = token_slice(seq, start, n)
            positions[lo:lo + n] = pos
            slot_mapping[lo:lo + n] = block_tables[r, pos // BS] * BS + pos % BS
            fill_slot(samp, r, seq.params, seq.seed, seq.num_output_tokens)
            want_logprobs |= sch.samples and seq.params.logprobs is not None
        sampling = SamplingTensors(**samp, want_logprobs=np.bool_(want_logprobs))
        if out.is_decode_only:
            res = self._run(DECODE, R, T, (tokens, positions, slot_mapping, block_tables, kv_lens, sampling))
        else:
            res = self._run(RAGGED, R, T, (tokens, positions, slot_mapping, block_tables, kv_lens, cu_q_lens, sampling))
        with self.stats.lock:
            self.stats.padded_tokens += T - num_real
        tok, tok_lp, top_ids, top_lp = res
        logprobs = None
        if want_logprobs:
            logprobs = (np.asarray(tok_lp)[:n_seqs], np.asarray(top_ids)[:n_seqs], np.asarray(top_lp)[:n_seqs])
        return StepResult(np.asarray(tok)[:n_seqs], logprobs)

    # ------------------------------------------------------------------------------
    def idle_step(self, decode_rows: int | None = None, tokens: int | None = None) -> None:
        """Run one program on all-idle inputs (every write lands in the null block): a
        decode step of `decode_rows` rows, or a ragged step of `tokens` tokens."""
        kind = DECODE if decode_rows else RAGGED
        rows = decode_rows or self.config.max_num_seqs
        T = decode_rows or tokens
        assert T is not None
        # Not posted to other processes: every process runs warm-up (and profiling) itself.
        jax.block_until_ready(self._call(kind, self._idle_args(kind, rows, T)))

    def _idle_args(self, kind: int, rows: int, T: int) -> tuple:
        """All-idle inputs of one step's shape (also the template a follower fills)."""
        zeros_t, zeros_r = np.zeros(T, np.int32), np.zeros(rows, np.int32)
        samp = SamplingTensors(**empty_sampling_arrays(rows), want_logprobs=np.bool_(False))
        args = (zeros_t, zeros_t, zeros_t, np.zeros((rows, self.config.max_blocks_per_seq), np.int32), zeros_r)
        return args + ((samp,) if kind == DECODE else (np.zeros(rows + 1, np.int32), samp))

    def _call(self, kind: int, args: tuple) -> Any:
        fn = self._decode if kind == DECODE else self._ragged
        self.kv_caches, res = fn(self.state, self.kv_caches, *args)
        return res

    def _run(self, kind: int, rows: int, T: int, args: tuple) -> Any:
        """One scheduled step; multi-host, its inputs go to the other processes first."""
        if self.channel is not None:
            self.channel.post(kind, rows, T, args)
        return self._call(kind, args)

    # ---- multi-host (distributed.py) ----------------------------------------------
    def follow(self) -> None:
        """Processes other than 0: run process 0's steps, in order, until it stops."""
        assert self.channel is not None and jax.process_index() > 0
        while (step := self.channel.take(self._idle_args)) is not None:
            jax.block_until_ready(self._call(*step))

    def stop_followers(self) -> None:
        if self.channel is not None and jax.process_index() == 0:
            self.channel.post(STOP, 0, 0, ())
            self.channel = None

    def warmup(self, log: Callable[[str], None] = print) -> None:
        """Compile every decode bucket and every token bucket before serving."""
        cfg = self.config
        t0 = time.perf_counter()
        total = len(cfg.decode_buckets) + len(cfg.token_buckets)
        for i, R in enumerate(cfg.decode_buckets):
            log(f"warm-up: compiling step program {i + 1}/{total} (decode, {R} rows)")
            self.idle_step(decode_rows=R)
        for i, T in enumerate(cfg.token_buckets):
            log(f"warm-up: compiling step program {len(cfg.decode_buckets) + i + 1}/{total} (prefill, {T} tokens)")
            self.idle_step(tokens=T)
        log(f"warm-up: {self.stats.num_compilations} programs compiled in {time.perf_counter() - t0:.1f}s")
