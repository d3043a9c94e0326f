"""ModelRunner: the only place where the scheduler's decisions become device arrays.

A step is two jitted programs over fixed shapes (compilation.py builds them), dispatched
back to back: a forward (the KV cache donated, updated in place) that writes its rows'
logits into the first rows of a persistent [max_num_seqs, V] buffer on the device (donated
too), then a sample program that turns them into tokens (and logprobs), the only results
the host reads.
The sample program has one shape for every step (all max_num_seqs rows, sampled 8 at a
time up to the last row that samples), so it is compiled once; so is the prompt-logprob
program, which only steps that ask prompt logprobs run (after their forward, on the final
hidden states it leaves in a persistent buffer). The forward comes in two kinds:

  decode  one token per occupied slot: token[R], pos[R], slot_mapping[R], block_tables[R, W], kv_lens[R]
  ragged  steps that carry prompt tokens (prefill, or chunks mixed with decodes): the
          step's tokens flattened and padded to a bucket T, cu_q_lens[S+1] per slot

Both read `last_tokens[max_num_seqs + 1]`, each slot's latest sampled token kept on the
device, which the sample program writes (donated). An input token the host does not know
yet (async scheduling: sampled by the step still running, one of the sequence's
num_output_placeholders) is passed as token_src = its slot and read from there; every
sampling row writes its token back (sample_slot).

Why two programs: a row under a structured-output constraint samples under a token
bitmask that depends on its previous token (as does a row with vLLM's logits processors,
logits_controls.py: its bitmask row and its sparse bias and penalty lists; a step with
bias or penalties runs the sample program of its lists' width, compiled on first use). Split, the forward of step N+1 runs on the
device while the host waits for step N's tokens, advances the matchers and fills the
bitmask; only the sample program waits for it (vLLM's execute_model / sample_tokens
split). A step without a constrained row dispatches its sample program at once.

W is max_model_len / block_size, but attention loops only over the blocks actually in
context (see kernels_pallas.py), so the width costs host->device bytes, not FLOPs.
The forward's shapes that vary are the decode row count R (occupied slots, padded to a
bucket) and T, each from a few buckets, all compiled by warmup(): after it, a step never
compiles. execute() dispatches and returns at once (JAX's async dispatch); the host
waits only in InFlightStep.result().
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from attention_backend import AttentionShape, select_attention_backend
from compilation import (SAMPLE_CHUNK, Built, CountedProgram, ProgramKey, spec_branches, step_programs,
                         warmup_summary)
from config import EngineConfig, host_memory_bytes
from distributed import DECODE, RAGGED, SAMPLE, SAMPLE_MASKED, SAMPLE_PENALIZED, STOP, StepChannel
from kvcache import create_kv_caches
from logits_controls import penalty_width
from metrics import EngineStats
from model import ModelConfig
from model_loader import LoadedModel
from parallel import create_sharded_kv_caches, replicate, shard_attention
from runner_output import InFlightStep
from sampler import SamplingTensors, empty_sampling_arrays, fill_slot
from scheduler_output import SchedulerOutput
from sequence import Sequence
from structured import bitmask_width, fill_bitmask


# Rows whose logits one iteration of the prompt-logprob loop holds: the program's
# temporaries are this many x vocab, whatever max_num_batched_tokens. (smollm2, a 512-row
# buffer, from the compiled program's memory_analysis: 51 MB of temporaries; all 512 rows
# at once, inside the forward, added 184 MB, which the KV budget loses.)
PROMPT_LOGPROB_ROWS = 128
# Where a ragged step's prompt-logprob targets sit in its inputs (execute, _idle_args): after
# tokens, token_src, positions, slot_mapping, block_tables, kv_lens and cu_q_lens. They are
# the prompt-logprob program's input, not the forward's (_program, _call).
PROMPT_TARGETS = 7


def prompt_logprob_rows(config: EngineConfig) -> tuple[int, int]:
    """(C, P): the prompt-logprob program's chunk of rows, and the rows of the hidden-state
    buffer it reads (max_num_batched_tokens rounded up to whole chunks)."""
    C = min(config.max_num_batched_tokens, PROMPT_LOGPROB_ROWS)
    return C, -(-config.max_num_batched_tokens // C) * C


@jax.tree_util.register_dataclass
@dataclass
class SpecInputs:
    """A ragged step's verified rows, in the first `rows of bucket` entries (the rest padding)."""

    row: np.ndarray  # [N] i32: the step row (sequence) verified
    slot: np.ndarray  # [N] i32: its slot (padding: the idle one), for last_tokens
    draft: np.ndarray  # [N, K] i32: its draft tokens
    num: np.ndarray  # [N] i32: how many of them are real
    src: np.ndarray  # [N] i32: its row in draft_probs
    bucket: np.ndarray  # [] i32: 0 = no verified row, else 1 + the index of the row-count bucket
    draft_probs: jax.Array | None  # [N, K, V] f32, the proposer's (spec_decode.Proposals)


def _spec_buckets(n: int) -> tuple[int, ...]:
    """Verified-row counts: powers of four up to n (each a branch of one program)."""
    out, b = [], 1
    while b < n:
        out.append(b)
        b *= 4
    return (*out, n)


def _bucket(buckets: tuple[int, ...], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise AssertionError(f"{n} exceeds the largest bucket {buckets[-1]}")


def ragged_rows(config: EngineConfig, T: int) -> int:
    """The sequence rows (and LM-head rows) of a ragged step of T tokens: every scheduled
    sequence computes at least one token, so a step of T tokens has at most T of them.
    A function of T alone, so it adds no program to the token buckets'."""
    return min(T, config.max_num_seqs)


def token_slice(seq: Sequence, start: int, n: int) -> list[int]:
    """seq's tokens at positions start..start+n-1 without building the whole list; 0 for
    a position whose token is still in flight (the step reads it on the device)."""
    p = seq.num_prompt_tokens
    if start + n <= p:
        return seq.prompt_token_ids[start:start + n]
    if start >= p:
        out = seq.output_token_ids[start - p:start - p + n]
    else:
        out = seq.prompt_token_ids[start:] + seq.output_token_ids[:start + n - p]
    return out + [0] * (n - len(out)) if len(out) < n else out


def num_sample_rows(config: EngineConfig) -> int:
    """The sample program's rows: max_num_seqs, rounded up to whole chunks."""
    chunk = min(SAMPLE_CHUNK, config.max_num_seqs)
    return -(-config.max_num_seqs // chunk) * chunk


def logprobs_bytes(config: EngineConfig, model: ModelConfig) -> dict[str, int]:
    """The bytes of the logprob arrays the programs return, by the flag that sizes their
    rows, at their width (EngineConfig.logprobs_width: the vocabulary under --max-logprobs
    -1): per prompt-logprob row, sample row and verified row's position a logprob, a rank
    and the top ids and values. Each is a
    device array, and a step that asked for it copies it whole to the host."""
    width = config.logprobs_width(model.vocab_size)
    K = config.speculative_config.k if config.speculative_config is not None else 0
    _, P = prompt_logprob_rows(config)
    i32 = f32 = 4
    row = f32 + i32 + width * (i32 + f32)
    verified = config.max_num_seqs * (K + 1) * row if K else 0
    return {"max_num_batched_tokens": P * row, "max_num_seqs": num_sample_rows(config) * row + verified}


def host_buffer_bytes(config: EngineConfig, model: ModelConfig, dtype: Any) -> dict[str, int]:
    """The bytes of the host arrays the runner sizes from each flag: those it keeps (the
    logits and hidden-state buffers are built on the host, then copied to the device),
    those its largest step builds, and the logprob arrays' copies (logprobs_bytes)."""
    N, T, W, V = config.max_num_seqs, config.max_num_batched_tokens, config.max_blocks_per_seq, model.vocab_size
    K = config.speculative_config.k if config.speculative_config is not None else 0
    rows = num_sample_rows(config)
    _, P = prompt_logprob_rows(config)
    i32 = 4
    # the hidden-state buffer and its padded targets; a step's tokens, positions, slot
    # mapping, token sources and prompt-logprob targets
    tokens = P * (model.hidden_size * np.dtype(dtype).itemsize + i32) + 5 * T * i32
    # per slot: block table (kept, and gathered by a step: max_model_len's share, a config.json's
    # max_position_embeddings unless --max-model-len), last token, sampling arrays (kept and
    # gathered), three flags, two list entries; per sample row: logits and a bitmask; verified rows' inputs
    block_tables = (N + 1) * 2 * W * i32
    seqs = (N + 1) * (i32 + 2 * 6 * 4 + 3 + 2 * 8) + rows * (V * 4 + bitmask_width(V) * i32) + N * (K + 4) * i32
    logprobs = logprobs_bytes(config, model)
    return {"max_num_batched_tokens": tokens + logprobs["max_num_batched_tokens"],
            "max_num_seqs": seqs + logprobs["max_num_seqs"], "max_model_len": block_tables}


def check_host_buffers(config: EngineConfig, model: ModelConfig, dtype: Any) -> None:
    """A ValueError naming the flag, before anything is allocated, when the runner's host
    arrays would not fit in the host's RAM."""
    need, ram = host_buffer_bytes(config, model, dtype), host_memory_bytes()
    total = sum(need.values())
    if total > ram:
        flag = max(need, key=lambda k: need[k])
        parts = ", ".join(f"{k} {getattr(config, k)}: {v:,} bytes" for k, v in need.items())
        raise ValueError(f"--{flag.replace('_', '-')} {getattr(config, flag)} is too large: the runner's host buffers "
                         f"need {total:,} bytes ({total / 2**30:.1f} GiB; {parts}), more than the host's {ram:,} "
                         f"bytes ({ram / 2**30:.1f} GiB) of memory")


class ModelRunner:
    """Host state lives in persistent per-slot buffers (row `slot` of each, plus one idle
    row that padding rows read): a sequence's block table is written when it takes its
    slot and then only its newly appended blocks; its sampling parameters once. A step
    gathers the scheduled slots' rows with numpy indexing, so its Python cost is one
    short loop over the scheduled sequences, not per-element assignments.

    The device keeps `last_tokens[slot]`, each slot's latest sampled token: a step
    writes its sampled tokens there, and an input token the host does not know yet (in
    flight, under async scheduling) is read from it on the device."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, num_kv_blocks: int, stats: EngineStats,
                 mesh: Mesh | None = None, num_swap_blocks: int = 0, draft_probs: bool = False):
        """mesh: tensor parallelism (parallel.py); loaded's params must already be on it.
        num_swap_blocks: the host pool's size in KV blocks (--preemption-mode swap).
        draft_probs: speculative proposals come with their draft distribution (else one-hot)."""
        check_host_buffers(config, loaded.config, loaded.dtype)
        self.config = config
        self.stats = stats
        self.loaded = loaded
        self.mesh = mesh
        # auto: the Pallas kernels on GPU if they pass a start-up check at these shapes, else
        # xla (the check depends only on the GQA group, the same on every TP shard)
        self.backend = select_attention_backend(
            config.attention_backend,
            AttentionShape.of(loaded.config, config.block_size, loaded.dtype, config.kv_cache_dtype))
        if mesh is not None:
            self.backend = shard_attention(self.backend, mesh)
        self.block_size = config.block_size
        graphdef, self.state = nnx.split(loaded.model)
        self.kv_caches = self.allocate_kv_caches(num_kv_blocks)
        # Multi-host: process 0 posts each scheduled step's inputs; the others follow().
        self.channel = StepChannel() if jax.process_count() > 1 else None
        N, W = config.max_num_seqs, config.max_blocks_per_seq
        self._idle = N  # the idle row: null block table, greedy, never a sampled token's home
        self.last_tokens = jnp.zeros(N + 1, jnp.int32) if mesh is None else replicate(np.zeros(N + 1, np.int32), mesh)
        self._bt = np.zeros((N + 1, W), np.int32)
        self._bt_len = [0] * (N + 1)  # entries at and past it are 0 (the null block, never handed out)
        self._bt_owner: list[list[int] | None] = [None] * (N + 1)  # the block_table list written there
        self._samp = empty_sampling_arrays(N + 1)
        self._wants_logprobs = np.zeros(N + 1, bool)
        # Structured outputs: a step with no constrained row passes an all-ones bitmask
        # kept on the device (no host->device bytes), and skips applying it.
        self._mask_width = bitmask_width(loaded.config.vocab_size)
        self._no_mask: jax.Array | None = None
        # The sample program has one shape: sample_rows rows (max_num_seqs, rounded up to
        # whole chunks), of which it samples only those up to the last sampling row. Each
        # forward writes its logits into the first rows of this buffer (donated: in place)
        # and its sample program reads them there.
        self.sample_rows = num_sample_rows(config)
        logits = np.zeros((self.sample_rows, loaded.config.vocab_size), np.float32)
        self._logits = jnp.asarray(logits) if mesh is None else replicate(logits, mesh)
        self._sample_due = False  # a forward ran whose sample program has not
        # Prompt logprobs are a program of their own, compiled once, run only by the ragged
        # steps that ask: every ragged forward writes its final hidden states into the first
        # rows of this buffer (donated: in place), and that program reads them there. Inside
        # each token bucket's forward (a lax.cond) they cost every ragged program's compile.
        self._prompt_chunk, P = prompt_logprob_rows(config)
        hidden = np.zeros((P, loaded.config.hidden_size), loaded.dtype)
        self._hidden = jnp.asarray(hidden) if mesh is None else replicate(hidden, mesh)
        self._wants_prompt_logprobs = np.zeros(N + 1, bool)
        # the slot's sequence samples under a grammar or logits processors (logits_controls.py)
        self._constrained = np.zeros(N + 1, bool)
        # --logprobs-mode and the top-logprob arrays' width (--max-logprobs): fixed shapes,
        # closed over by every program that computes logprobs
        mode, width = config.logprobs_kind, config.logprobs_width(loaded.config.vocab_size)
        self.logprobs_width = width
        spec = config.speculative_config
        self.spec_k = spec.k if spec is not None else 0
        self.draft_probs = draft_probs
        self._zero_q: jax.Array | None = None  # draft_probs of a step with no verified row
        # Verified rows are padded to one of a few counts; one program (lax.switch) holds them all.
        self.spec_buckets = _spec_buckets(N) if spec is not None else ()
        programs = step_programs(ProgramKey(graphdef, self.backend, mesh, N, mode, width, self.spec_k,
                                            self.spec_buckets, self._prompt_chunk))
        (self._decode, self._ragged, self._sample, self._prompt_logprobs, self._gather_blocks,
         self._scatter_blocks) = (CountedProgram(fn, stats) for fn in programs)
        # Swap preemption: KV blocks [layers, block, ...] to and from a host pool of numpy arrays.
        self.num_swap_blocks = num_swap_blocks
        self.host_kv: list[np.ndarray] | None = None

    def swap(self, swap_out: list[tuple[list[int], list[int]]], swap_in: list[tuple[list[int], list[int]]]) -> None:
        """Copy KV blocks (device block, host block) to the host pool, then others back:
        in that order, because a block swapped in may be one just swapped out. The copy out
        waits for the steps in flight (they may still write those blocks); numbers of
        blocks are padded to powers of two (the padding reads and writes the null block),
        so the two copy programs compile once per bucket."""
        leaves, treedef = jax.tree.flatten(self.kv_caches)
        if self.host_kv is None:  # zeros: the OS maps the pages when first written
            self.host_kv = [np.zeros((x.shape[0], self.num_swap_blocks, *x.shape[2:]), x.dtype) for x in leaves]
        per_block = sum(x.nbytes // x.shape[1] for x in leaves)

        def padded(blocks: list[int]) -> np.ndarray:
            idx = np.zeros(1 << (len(blocks) - 1).bit_length(), np.int32)
            idx[:len(blocks)] = blocks
            return idx

        if swap_out:
            dev = [b for d, _ in swap_out for b in d]
            host = [b for _, h in swap_out for b in h]
            for pool, data in zip(self.host_kv, self._gather_blocks(leaves, padded(dev))):
                pool[:, host] = np.asarray(data)[:, :len(dev)]
        if swap_in:
            dev = [b for d, _ in swap_in for b in d]
            host = [b for _, h in swap_in for b in h]
            idx = padded(dev)
            data = [np.zeros((p.shape[0], len(idx), *p.shape[2:]), p.dtype) for p in self.host_kv]
            for d, pool in zip(data, self.host_kv):
                d[:, :len(dev)] = pool[:, host]
            self.kv_caches = jax.tree.unflatten(treedef, self._scatter_blocks(leaves, idx, data))
        with self.stats.lock:
            n_out, n_in = sum(len(d) for d, _ in swap_out), sum(len(d) for d, _ in swap_in)
            self.stats.swapped_out_blocks += n_out
            self.stats.swapped_in_blocks += n_in
            self.stats.swapped_out_bytes += n_out * per_block
            self.stats.swapped_in_bytes += n_in * per_block

    def allocate_kv_caches(self, num_blocks: int) -> Any:
        loaded, bs = self.loaded, self.config.block_size
        create = functools.partial(create_kv_caches, loaded.config, num_blocks, bs, loaded.dtype,
                                   self.config.kv_cache_dtype)
        return create() if self.mesh is None else create_sharded_kv_caches(create, self.mesh)

    # ------------------------------------------------------------------------------
    def _sync_slot(self, seq: Sequence) -> int:
        """Bring seq's slot row up to date: everything when it is a new occupant (its
        block_table is a list this row has not seen: an admission or a re-admission after
        preemption), else only the blocks appended since the last step."""
        s, bt = seq.slot, seq.block_table
        assert s is not None, f"{seq.request_id} is scheduled without a slot"
        if self._bt_owner[s] is not bt:
            self._bt_owner[s] = bt
            n = len(bt)
            self._bt[s, :n] = bt
            self._bt[s, n:] = 0
            self._bt_len[s] = n
            fill_slot(self._samp, s, seq.params, seq.seed, 0)  # "step" is set per step
            self._wants_logprobs[s] = seq.params.logprobs is not None
            self._wants_prompt_logprobs[s] = seq.params.prompt_logprobs is not None
            # set before the request is queued, never changed
            self._constrained[s] = seq.constraint is not None or seq.controls is not None
        else:
            n, m = self._bt_len[s], len(bt)
            if m != n:  # blocks are only ever appended while a sequence holds its slot
                assert m > n and (n == 0 or self._bt[s, n - 1] == bt[n - 1]), f"{seq.request_id}: block table rewritten"
                self._bt[s, n:m] = bt[n:m]
                self._bt_len[s] = m
        return s

    def _samples_constrained(self, seq: Sequence) -> bool:
        """Whether seq's row this step samples under a constraint. A request whose only
        processor is min_tokens needs none from the output index min_tokens on (nor ever
        again: its output only grows), so its later steps keep the whole async overlap."""
        idle_from = seq.controls.idle_from if seq.constraint is None and seq.controls is not None else None
        # the index this step samples: every known output, then the ones in flight before it
        if idle_from is not None and len(seq.output_token_ids) + seq.num_output_placeholders - 1 >= idle_from:
            self._constrained[seq.slot] = False
            return False
        return True

    def execute(self, out: SchedulerOutput) -> InFlightStep:
        """Dispatch one step and return without waiting for it. Row i of every array is
        out.scheduled[i]: a sequence's slot is its seat in the scheduler's accounting; on
        the device only rows exist, so a decode step computes its scheduled rows (at least
        out.num_occupied: static batching's finished-but-seated sequences), padded to a
        bucket, not max_num_seqs. The scheduler has advanced each sequence past its row."""
        cfg, BS = self.config, self.block_size
        n = len(out.scheduled)
        decode = out.is_decode_only
        # Decodes and verified rows only: the ragged program at the decode row buckets, each
        # row up to 1 + k tokens (a step with prompt tokens: token buckets, ragged_rows rows).
        verify = not decode and out.num_prefill_tokens == 0
        owner, bt_len = self._bt_owner, self._bt_len
        # The one Python loop over the step's sequences: most rows need one identity and
        # one length check of their block table, and a few numbers into a flat list. A
        # decode-only step's rows each compute one token and sample it: two numbers fewer.
        flat: list[int] = []
        for sch in out.scheduled:
            seq = sch.seq
            slot, bt, out_ids = seq.slot, seq.block_table, seq.output_token_ids
            if owner[slot] is not bt or bt_len[slot] != len(bt):
                self._sync_slot(seq)
            # per row: slot, end position, outputs known, outputs in flight, and its latest known
            # output (a decode's input unless it is in flight; 0: none known, so in flight) ...
            flat += (slot, seq.num_computed_tokens, len(out_ids), seq.num_output_placeholders,
                     out_ids[-1] if out_ids else 0)
            if not decode:  # ... new tokens, samples?
                flat += (sch.num_new_tokens, sch.samples)
        # (np.fromiter: a third faster than np.array)
        rows = np.fromiter(flat, np.int32, len(flat)).reshape(n, 5 if decode else 7)
        slots, end, num_out, num_in_flight, last = rows.T[:5]
        if decode:
            q = samples = np.ones(n, np.int32)
        else:
            q, samples = rows.T[5:]
        constrained = []  # (sequence, row) of the rows that sample under a constraint
        if self._constrained.any():
            rows_constrained = np.flatnonzero(self._constrained[slots] & (samples != 0)).tolist()
            for i in rows_constrained:
                if self._samples_constrained(out.scheduled[i].seq):
                    constrained.append((out.scheduled[i].seq, i))
        start = end - q
        # A sampling row's own token is one of the in-flight ones: positions from here on
        # hold tokens sampled by a step still running, read on the device.
        num_known = end + samples - num_in_flight
        assert decode or n == 0 or (q >= 1).all(), "every scheduled sequence computes a token"
        # The block of each row's last position is a real one: past a row's length, _bt holds the null block.
        assert (self._bt[slots, (end - 1) // BS] != 0).all(), "blocks must be allocated before the step"
        if decode:  # every row is a decode: its input is its latest known token, unless one is in flight
            toks = last
        else:  # a verified row: its latest token, then its drafts
            toks = np.array([t for sch in out.scheduled for t in (
                token_slice(sch.seq, sch.seq.num_computed_tokens - sch.num_new_tokens, sch.num_new_tokens)
                if not sch.num_spec_tokens else [sch.seq.output_token_ids[-1], *sch.spec_token_ids])], np.int32)
        num_real = len(toks)
        if decode:
            R = T = _bucket(cfg.decode_buckets, max(out.num_occupied, n))
        elif verify:
            R = _bucket(cfg.decode_buckets, max(out.num_occupied, n))
            T = self._verify_tokens(R)
        else:
            T = _bucket(cfg.token_buckets, num_real)
            R = ragged_rows(cfg, T)
        # per row
        row_slots = np.full(R, self._idle, np.int32)
        row_slots[:n] = slots
        kv_lens = np.zeros(R, np.int32)
        kv_lens[:n] = end
        block_tables = self._bt[row_slots]
        cu_q_lens = np.zeros(R + 1, np.int32)
        np.cumsum(q, out=cu_q_lens[1:n + 1])
        cu_q_lens[n + 1:] = num_real
        # per token
        if decode:
            row_of, pos = slice(None), start  # token i is row i's: a view, not a gather
        else:
            row_of = np.repeat(np.arange(n), q)
            pos = np.arange(num_real, dtype=np.int32) + np.repeat(start - cu_q_lens[:n], q)
        tokens, positions, slot_mapping = (np.zeros(T, np.int32) for _ in range(3))
        token_src = np.full(T, -1, np.int32)
        positions[:num_real] = pos
        slot_mapping[:num_real] = self._bt[slots[row_of], pos // BS] * BS + pos % BS
        unknown = pos >= num_known[row_of]
        tokens[:num_real] = np.where(unknown, 0, toks)
        token_src[:num_real] = np.where(unknown, slots[row_of], -1)
        # sampling, over the sample program's rows: "step" is the index of the output token a
        # row samples (its seed's stream)
        sample_slot = np.full(self.sample_rows, self._idle, np.int32)
        sample_slot[:n] = slots
        samp = {k: v[sample_slot] for k, v in self._samp.items()}
        samp["step"][:n] = num_out + num_in_flight - samples
        samples = samples.astype(bool)
        sample_slot[:n] = np.where(samples, slots, self._idle)
        want_logprobs = bool(self._wants_logprobs.any() and (self._wants_logprobs[slots] & samples).any())
        sampling = SamplingTensors(**samp, want_logprobs=np.bool_(want_logprobs))
        prompt_rows, spec_rows = None, None
        if decode:
            extra: tuple = ()
        else:
            targets = np.full(T, -1, np.int32)
            prompt_rows = self._prompt_targets(out, slots, start, q, cu_q_lens, targets)
            extra = (cu_q_lens, targets)
            if self.spec_buckets:
                spec_rows = [i for i, sch in enumerate(out.scheduled) if sch.num_spec_tokens]
                # Verification draws as sample() does, but applies no bitmask.
                assert not self._constrained[slots[spec_rows]].any(), "a constrained row never speculates"
                extra = (*extra, self._spec_inputs(out, spec_rows, slots, R),
                         SamplingTensors(**{k: v[:R] for k, v in samp.items()}, want_logprobs=sampling.want_logprobs))
                sample_slot[spec_rows] = self._idle  # their tokens come from the forward's verification
        fwd = self._run(DECODE if decode else RAGGED, R, T,
                        (tokens, token_src, positions, slot_mapping, block_tables, kv_lens, *extra))
        with self.stats.lock:
            self.stats.padded_tokens += T - num_real
            self.stats.computed_tokens += T
            self.stats.useful_tokens += num_real
            self.stats.computed_logit_rows += R
            self.stats.useful_logit_rows += int(np.count_nonzero(samples))  # a Python int: stats go to JSON
        step = InFlightStep(fwd, n, want_logprobs, prompt_rows, (sample_slot, sampling), constrained, spec_rows)
        if not constrained:
            self.sample(step)
        return step

    def sample(self, step: InFlightStep) -> None:
        """Dispatch step's sample program. Its constrained rows' bitmask and penalty lists
        are filled now, so the caller first collects every earlier step: each matcher must
        have consumed all of its sequence's tokens but the one this step samples."""
        sample_slot, sampling = step.sample_args
        rows, masks, penalties = [], [], []
        for seq, row in step.constrained:
            if seq.finished:  # ended by the step before: its row is discarded
                continue
            assert seq.num_output_placeholders == 1, f"{seq.request_id}: its mask would miss a token in flight"
            if seq.constraint is not None and seq.constraint.active:  # (before its reasoning ends: free)
                rows.append((seq.constraint, row))
            if seq.controls is not None:
                if (m := seq.controls.mask(seq.output_token_ids)) is not None:
                    masks.append((row, m))
                if (p := seq.controls.penalties(seq.output_token_ids)) is not None:
                    penalties.append((row, p))
        bitmask, raw_mask = None, None
        if rows or masks:
            t0 = time.perf_counter()
            bitmask = np.full((len(sample_slot), self._mask_width), -1, np.int32)
            if rows:
                fill_bitmask(rows, bitmask)
            if masks and step.want_logprobs and self.config.logprobs_kind.raw:
                raw_mask = bitmask.copy()  # raw logprobs see the grammar's rows, not the processors' masks
            for row, m in masks:  # a grammar's row and the processors' both hold
                bitmask[row] &= m.view(np.int32)
            # A row left without any token (its grammar against its allowed_token_ids or
            # bad_words) draws one that none of them allows: its sequence ends without it
            # (Scheduler.update reads the flag when this step's tokens come back).
            empty = ~bitmask.any(axis=1)  # an unmasked row is all ones
            if empty.any():
                for seq, row in step.constrained:
                    if empty[row] and not seq.finished:
                        seq.no_token_allowed = True
            if rows:
                with self.stats.lock:
                    self.stats.structured_output_steps += 1
                    self.stats.structured_output_bitmask_seconds += time.perf_counter() - t0
        # A masked step's inputs end in its bitmask, then the raw logprobs' own when it has
        # one (odd "tokens": _idle_args, the template a follower reads a step with).
        with_raw = int(raw_mask is not None)
        masks_in = (bitmask,) if raw_mask is None else (bitmask, raw_mask)
        if penalties:
            width = penalty_width(max(len(p[0]) for _, p in penalties))
            sampling = dataclasses.replace(sampling, **self._penalty_lists(len(sample_slot), width, penalties))
            if bitmask is None:
                masks_in = (np.full((len(sample_slot), self._mask_width), -1, np.int32),)
            step.sampled = self._run(SAMPLE_PENALIZED, len(sample_slot), width + with_raw,
                                     (sample_slot, sampling, *masks_in))
        # Multi-host, the all-ones bitmask of an unconstrained step is each process's own.
        elif bitmask is None:
            step.sampled = self._run(SAMPLE, len(sample_slot), 0, (sample_slot, sampling))
        else:
            step.sampled = self._run(SAMPLE_MASKED, len(sample_slot), with_raw, (sample_slot, sampling, *masks_in))

    def _penalty_lists(self, rows: int, width: int,
                       entries: list[tuple[int, tuple[np.ndarray, ...]]] | None = None) -> dict[str, np.ndarray]:
        """SamplingTensors' sparse penalty fields, [rows, width]: each (row, (ids, bias, rep,
        sub)) of entries, the rest padding (id V: dropped by the scatter)."""
        out = {"penalty_ids": np.full((rows, width), self.loaded.config.vocab_size, np.int32),
               "penalty_bias": np.zeros((rows, width), np.float32), "penalty_rep": np.ones((rows, width), np.float32),
               "penalty_sub": np.zeros((rows, width), np.float32)}
        for row, values in entries or ():
            n = len(values[0])
            for name, v in zip(out, values):
                out[name][row, :n] = v
        return out

    def _verify_tokens(self, rows: int) -> int:
        """T of a verify step of `rows` rows of 1 + k tokens: at most the budget's tokens."""
        return min(rows * (1 + self.spec_k), self.config.max_num_batched_tokens)

    def _spec_inputs(self, out: SchedulerOutput, spec_rows: list[int], slots: np.ndarray, rows: int) -> SpecInputs:
        """The verified rows' drafts, padded to the smallest branch that holds them."""
        N, K = self.config.max_num_seqs, self.spec_k
        q = out.draft_probs
        if q is not None and self.mesh is not None:  # the draft runs whole on one device, the verifier on the mesh
            q = replicate(q, self.mesh)
        sp = SpecInputs(np.zeros(N, np.int32), np.full(N, self._idle, np.int32), np.zeros((N, K), np.int32),
                        np.zeros(N, np.int32), np.zeros(N, np.int32), np.int32(0), q)
        for r, i in enumerate(spec_rows):
            sch = out.scheduled[i]
            d = sch.spec_token_ids
            assert len(d) == sch.num_spec_tokens, "a row's drafts are proposed before its step runs"
            sp.row[r], sp.slot[r], sp.num[r], sp.src[r] = i, slots[i], len(d), sch.spec_src
            sp.draft[r, :len(d)] = d
        if spec_rows:
            branches = spec_branches(self.spec_buckets, rows)
            sp.bucket = np.int32(1 + branches.index(_bucket(branches, len(spec_rows))))
        assert (out.draft_probs is not None) == self.draft_probs or not spec_rows, "draft_probs and the proposer disagree"
        if self.draft_probs and out.draft_probs is None:  # no verified row: any array of the shape
            sp.draft_probs = self._no_draft_probs()
        return sp

    def _no_draft_probs(self) -> jax.Array:
        if self._zero_q is None:
            V = self.loaded.config.vocab_size
            self._zero_q = jnp.zeros((self.config.max_num_seqs, self.spec_k, V), jnp.float32)
        return self._zero_q

    def _prompt_targets(self, out: SchedulerOutput, slots: np.ndarray, start: np.ndarray, q: np.ndarray, cu_q_lens: np.ndarray,
                        targets: np.ndarray) -> list[tuple[int, int, int, int]]:
        """Fill targets[t] with the prompt token after token t, for the rows that ask
        prompt_logprobs; return those rows as (row, first flat token, first position, count)."""
        rows = []
        if not self._wants_prompt_logprobs[slots].any():
            return rows
        for i, sch in enumerate(out.scheduled):
            seq = sch.seq
            if seq.params.prompt_logprobs is None or seq.output_token_ids:
                continue  # (after its first token, a recomputed prompt's logprobs are known already)
            a, b = int(start[i]), min(int(start[i] + q[i]), seq.num_prompt_tokens - 1)  # positions a..b-1 predict a+1..b
            if b > a:
                flat = int(cu_q_lens[i])
                targets[flat:flat + b - a] = seq.prompt_token_ids[a + 1:b + 1]
                rows.append((i, flat, a, b - a))
        return rows

    def _all_ones(self) -> jax.Array:
        if self._no_mask is None:
            ones = np.full((self.sample_rows, self._mask_width), -1, np.int32)
            self._no_mask = jax.device_put(ones) if self.mesh is None else replicate(ones, self.mesh)
        return self._no_mask

    # ------------------------------------------------------------------------------
    def idle_step(self, decode_rows: int | None = None, tokens: int | None = None) -> None:
        """Run one step on all-idle inputs (every write lands in the null block): a decode
        step of `decode_rows` rows or a ragged step of `tokens` tokens, then its sample
        program. A ragged step asks prompt logprobs on every token (the largest step:
        startup.py measures its activations)."""
        kind = DECODE if decode_rows else RAGGED
        T = decode_rows or tokens
        assert T is not None
        rows = decode_rows or ragged_rows(self.config, T)
        args = self._idle_args(kind, rows, T)
        if kind == RAGGED:
            args[PROMPT_TARGETS][:] = 0
        # Not posted to other processes: every process runs warm-up (and profiling) itself.
        # Waits for every program the step ran (a ragged one runs the prompt-logprob program too).
        outputs = self._call(kind, args)
        jax.block_until_ready((outputs, self._call(SAMPLE, self._idle_args(SAMPLE, self.sample_rows, 0))))

    def _idle_args(self, kind: int, rows: int, T: int) -> tuple:
        """All-idle inputs of one program's shape (also the template a follower fills)."""
        if kind in (SAMPLE, SAMPLE_MASKED, SAMPLE_PENALIZED):
            # T: the width of the penalty lists (a power of two), + 1 when raw logprobs' bitmask follows the bitmask
            penalties = self._penalty_lists(rows, T & ~1) if kind == SAMPLE_PENALIZED else {}
            samp = SamplingTensors(**empty_sampling_arrays(rows), want_logprobs=np.bool_(False), **penalties)
            masks = 0 if kind == SAMPLE else 1 + (T & 1)
            return (np.full(rows, self._idle, np.int32), samp,
                    *(np.full((rows, self._mask_width), -1, np.int32) for _ in range(masks)))
        zeros_t, zeros_r = np.zeros(T, np.int32), np.zeros(rows, np.int32)
        args = (zeros_t, np.full(T, -1, np.int32), zeros_t, zeros_t,
                np.zeros((rows, self.config.max_blocks_per_seq), np.int32), zeros_r)
        if kind == DECODE:
            return args
        args = (*args, np.zeros(rows + 1, np.int32), np.full(T, -1, np.int32))
        if self.spec_buckets:
            samp = SamplingTensors(**empty_sampling_arrays(rows), want_logprobs=np.bool_(False))
            args = (*args, self._spec_inputs(SchedulerOutput(), [], np.zeros(0, np.int32), rows), samp)
        return args

    def _program(self, kind: int, args: tuple) -> tuple[Callable, tuple]:
        """One program and its whole arguments: the device state, then the step's inputs."""
        if kind in (SAMPLE, SAMPLE_MASKED, SAMPLE_PENALIZED):
            sample_slot, sampling, *mask = args
            put = jax.device_put if self.mesh is None else functools.partial(replicate, mesh=self.mesh)
            bitmask = put(mask[0]) if mask else self._all_ones()
            # (one array for both unless the step has raw logprobs' own: no second copy to the device)
            raw = put(mask[1]) if len(mask) > 1 else bitmask
            sampling = dataclasses.replace(sampling, token_bitmask=bitmask, logprobs_bitmask=raw,
                                           use_bitmask=np.bool_(bool(mask)))
            return self._sample, (self.last_tokens, self._logits, sample_slot, sampling)
        if kind == DECODE:
            return self._decode, (self.state, self.kv_caches, self.last_tokens, self._logits, *args)
        return self._ragged, (self.state, self.kv_caches, self.last_tokens, self._logits, self._hidden,
                              *args[:PROMPT_TARGETS], *args[PROMPT_TARGETS + 1:])

    def _prompt_program(self, targets: np.ndarray) -> tuple[Callable, tuple]:
        """The prompt-logprob program on a ragged step's targets ([T], -1: none asked),
        padded to the hidden-state buffer's rows."""
        padded = np.full(self._hidden.shape[0], -1, np.int32)
        padded[:len(targets)] = targets
        return self._prompt_logprobs, (self.state, self._hidden, padded)

    def _call(self, kind: int, args: tuple) -> Any:
        """Run one program: a forward leaves its logits in self._logits for the sample
        program that always follows it (forward and sample alternate, on every process;
        a failed step's forward whose sample program never ran is overwritten by the next)."""
        fn, full = self._program(kind, args)
        if kind in (SAMPLE, SAMPLE_MASKED, SAMPLE_PENALIZED):
            assert self._sample_due, "a sample program without its forward"
            self._sample_due = False
            self.last_tokens, res = fn(*full)
            return res
        if kind == DECODE:
            self.kv_caches, (self._logits, *extra) = fn(*full)
            self._sample_due = True
            return tuple(extra)
        self.kv_caches, (self._logits, self._hidden, *extra) = fn(*full)
        self._sample_due = True
        if self.spec_buckets:  # the verified rows' last tokens, written by the forward
            *extra, self.last_tokens = extra
        targets = args[PROMPT_TARGETS]
        prompt = None
        if (targets >= 0).any():  # a row asks prompt logprobs (on every process: the targets travel with the step)
            prompt_fn, prompt_args = self._prompt_program(targets)
            prompt = prompt_fn(*prompt_args)
        return (prompt, *extra)

    def _run(self, kind: int, rows: int, T: int, args: tuple) -> Any:
        """One scheduled step; multi-host, its inputs go to the other processes first."""
        if self.channel is not None:
            self.channel.post(kind, rows, T, args)
        return self._call(kind, args)

    # ---- multi-host (distributed.py) ----------------------------------------------
    def follow(self) -> None:
        """Processes other than 0: run process 0's steps, in order, until it stops. Anything
        that stops it sooner (an error, a signal) ends the process: os._exit(1)."""
        assert self.channel is not None and jax.process_index() > 0
        if threading.current_thread() is threading.main_thread():
            # a follower stops on SIGTERM as on Ctrl-C: it leaves the group (below), which
            # ends it (process 0 cannot go on alone)
            signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            while (step := self.channel.take(self._idle_args)) is not None:
                jax.block_until_ready(self._call(*step))
        except BaseException as e:
            # This process cannot run the group's next step (the step failed, a signal, process
            # 0 is gone), and process 0 may be waiting for it inside that step's collectives.
            # A normal exit would run jax.distributed's shutdown, whose barrier waits for
            # process 0 (minutes); exiting at once stops the heartbeats instead, so the
            # coordination service fails the group within HEARTBEAT_TIMEOUT_S.
            if isinstance(e, KeyboardInterrupt):
                print(f"process {jax.process_index()}: interrupted, leaving the group", file=sys.stderr)
            else:
                traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    def stop_followers(self) -> None:
        if self.channel is not None and jax.process_index() == 0:
            self.channel.post(STOP, 0, 0, ())
            self.channel = None

    def warmup(self, log: Callable[[str], None]) -> None:
        """Compile the sample program, every decode bucket, every token bucket and the
        prompt-logprob program before serving (with speculation, each token bucket's
        program holds every verified-row bucket, and each decode bucket has a verify program).

        Compiled, not run: a program is traced and lowered here, on the same arguments
        (shapes, shardings, donations) a step passes, so that the jitted call finds its
        executable; running it on idle inputs would cost the prefill buckets' matmuls for
        nothing. (Compiling several at once in threads was slower on 2 cores: XLA's CPU
        compiler already runs its codegen on more than one.)"""
        with Built(self.stats) as built:
            total, loaded = self._warmup(log)
        compiled = built.traced
        # by this engine (the activation probe's step) or by another with its ProgramKey
        ready = f" ({total - compiled} were compiled already)" if 0 < compiled < total else ""
        log(warmup_summary(f"{compiled} programs", f"all {total} programs", built, loaded) + ready)

    def _warmup(self, log: Callable[[str], None]) -> tuple[int, int]:
        """Compile warmup's programs, one line each saying how it was got (compiled, or read
        from the persistent compilation cache); their count, and how many were read."""
        cfg = self.config
        verifying = f", verifying up to {cfg.max_num_seqs} x {1 + self.spec_k}" if self.spec_buckets else ""
        programs = [(SAMPLE, self.sample_rows, 0, f"sampling, up to {self.sample_rows} rows")]
        programs += [(DECODE, R, R, f"decode, {R} rows") for R in cfg.decode_buckets]
        programs += [(RAGGED, ragged_rows(cfg, T), T, f"prefill, {T} tokens{verifying}") for T in cfg.token_buckets]
        programs += [(RAGGED, R, self._verify_tokens(R), f"verify, {R} rows of up to {1 + self.spec_k} tokens")
                     for R in (cfg.decode_buckets if self.spec_buckets else ())]
        # The swap's copy programs: one pair per power-of-two count of blocks a step moves.
        leaves, treedef = jax.tree.flatten(self.kv_caches)
        sizes = [1 << k for k in range((leaves[0].shape[1] - 1).bit_length() + 1)] if self.num_swap_blocks else []
        # Progress lines "warm-up i/N (...)": the summary alone reads "warm-up: ... compiled".
        total, loaded = len(programs) + 1 + 2 * len(sizes), 0
        for i, (kind, rows, T, what) in enumerate(programs):
            fn, args = self._program(kind, self._idle_args(kind, rows, T))
            loaded += self._build(log, f"{i + 1}/{total} ({what})", fn, args)
        fn, args = self._prompt_program(np.zeros(0, np.int32))
        what = f"prompt logprobs, {self._prompt_chunk} rows at a time"
        loaded += self._build(log, f"{len(programs) + 1}/{total} ({what})", fn, args)
        if sizes:
            with Built(self.stats) as built:
                for n in sizes:  # the null block, read and written back as swap() does (host arrays): no K/V changes
                    idx = np.zeros(n, np.int32)
                    data = [np.asarray(d) for d in self._gather_blocks(leaves, idx)]
                    leaves = self._scatter_blocks(leaves, idx, data)
            self.kv_caches = jax.tree.unflatten(treedef, leaves)
            loaded += built.loaded
            log(f"warm-up {len(programs) + 2}-{total}/{total} (KV copy programs for {len(sizes)} block counts, "
                f"swap preemption): {built}")
        return total, loaded

    def _build(self, log: Callable[[str], None], which: str, fn: Callable, args: tuple) -> int:
        """Trace, lower and compile one step program as a step's call on such arguments
        finds it, and log how it was got; 1 if its executable was read from the persistent
        compilation cache, else 0."""
        with Built(self.stats) as built:
            fn.lower(*args).compile()
        log(f"warm-up {which}: {built}")
        return built.loaded
