"""ModelRunner: the only place where the scheduler's decisions become device arrays.

Two jitted programs, both over fixed shapes, both with the KV cache donated (updated in
place) and both returning only the sampled tokens (and logprobs) to the host:

  decode  one token per slot: token[S], pos[S], slot_mapping[S], block_tables[S, W], kv_lens[S]
  ragged  steps that carry prompt tokens (prefill, or chunks mixed with decodes): the
          step's tokens flattened and padded to a bucket T, cu_q_lens[S+1] per slot

W is max_model_len / block_size, but attention loops only over the blocks actually in
context (see kernels_pallas.py), so the width costs host->device bytes, not FLOPs.
The only shape that varies is T, from a few power-of-two buckets, all compiled by
warmup(): after it, a step never compiles.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from config import EngineConfig
from kernels_pallas import get_attention_backend
from kvcache import create_kv_caches
from metrics import EngineStats
from model import AttentionInputs, LoadedModel
from sampler import SamplingTensors, empty_sampling_arrays, fill_slot, sample
from scheduler import SchedulerOutput, Sequence


@dataclass
class StepResult:
    """What came back from the device for one step, indexed by slot."""

    tokens: np.ndarray  # [S] i32
    logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # ([S], [S,K] ids, [S,K]) when asked


def token_slice(seq: Sequence, start: int, n: int) -> list[int]:
    """seq.all_token_ids[start:start+n] without building the whole list."""
    p = seq.num_prompt_tokens
    if start >= p:
        return seq.output_token_ids[start - p:start - p + n]
    if start + n <= p:
        return seq.prompt_token_ids[start:start + n]
    return seq.prompt_token_ids[start:] + seq.output_token_ids[:start + n - p]


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, num_kv_blocks: int, stats: EngineStats):
        self.config = config
        self.stats = stats
        self.backend = get_attention_backend(config.attention_backend)
        self.block_size = config.block_size
        graphdef, self.state = nnx.split(loaded.model)
        self.kv_caches = create_kv_caches(loaded.config, num_kv_blocks, config.block_size, loaded.dtype)
        backend = self.backend

        def count_compile() -> None:
            # Runs only while jax traces, i.e. once per compiled program.
            self.stats.num_compilations += 1

        def decode_fn(state, kv_caches, tokens, positions, slot_mapping, block_tables, kv_lens, sampling):
            count_compile()
            model = nnx.merge(graphdef, state)
            attn = AttentionInputs(slot_mapping, block_tables, kv_lens, None)
            hidden, kv_caches = model(tokens, positions, kv_caches, attn, backend)
            return kv_caches, sample(model.compute_logits(hidden), sampling)

        def ragged_fn(state, kv_caches, tokens, positions, slot_mapping, block_tables, kv_lens, cu_q_lens, sampling):
            count_compile()
            model = nnx.merge(graphdef, state)
            attn = AttentionInputs(slot_mapping, block_tables, kv_lens, cu_q_lens)
            hidden, kv_caches = model(tokens, positions, kv_caches, attn, backend)
            # Only each slot's last token of the step can be sampled: the LM head runs on
            # S rows, not T.
            last = jnp.maximum(cu_q_lens[1:] - 1, 0)
            return kv_caches, sample(model.compute_logits(hidden[last]), sampling)

        self._decode = jax.jit(decode_fn, donate_argnums=1)
        self._ragged = jax.jit(ragged_fn, donate_argnums=1)

    # ------------------------------------------------------------------------------
    def bucket(self, num_tokens: int) -> int:
        for b in self.config.token_buckets:
            if b >= num_tokens:
                return b
        raise AssertionError(f"{num_tokens} tokens exceed max_num_batched_tokens")

    def execute(self, out: SchedulerOutput) -> StepResult:
        cfg = self.config
        S, W, BS = cfg.max_num_seqs, cfg.max_blocks_per_seq, self.block_size
        block_tables = np.zeros((S, W), np.int32)
        kv_lens = np.zeros(S, np.int32)
        samp = empty_sampling_arrays(S)
        want_logprobs = False
        rows: list[tuple[int, Sequence, int, int]] = []  # (slot, seq, start, n)
        for sch in out.scheduled:
            seq = sch.seq
            s, start, n = seq.slot, seq.num_computed_tokens, sch.num_new_tokens
            assert s is not None and 0 <= s < S and n >= 1
            assert len(seq.block_table) * BS >= start + n, "blocks must be allocated before the step"
            block_tables[s, :len(seq.block_table)] = seq.block_table
            kv_lens[s] = start + n
            fill_slot(samp, s, seq.params, seq.seed, seq.num_output_tokens)
            want_logprobs |= sch.samples and seq.params.logprobs is not None
            rows.append((s, seq, start, n))
        sampling = SamplingTensors(**samp, want_logprobs=np.bool_(want_logprobs))

        num_real = sum(n for _, _, _, n in rows)
        if out.is_decode_only:
            T = S
            tokens, positions, slot_mapping = (np.zeros(S, np.int32) for _ in range(3))
            for s, seq, start, _ in rows:
                tokens[s] = token_slice(seq, start, 1)[0]
                positions[s] = start
                slot_mapping[s] = seq.block_table[start // BS] * BS + start % BS
            self.kv_caches, res = self._decode(self.state, self.kv_caches, tokens, positions, slot_mapping,
                                               block_tables, kv_lens, sampling)
        else:
            T = self.bucket(num_real)
            tokens, positions, slot_mapping = (np.zeros(T, np.int32) for _ in range(3))
            q_lens = np.zeros(S, np.int32)
            for s, _, _, n in rows:
                q_lens[s] = n
            cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
            for s, seq, start, n in rows:
                lo = cu_q_lens[s]
                pos = np.arange(start, start + n, dtype=np.int32)
                tokens[lo:lo + n] = token_slice(seq, start, n)
                positions[lo:lo + n] = pos
                slot_mapping[lo:lo + n] = np.asarray(seq.block_table, np.int32)[pos // BS] * BS + pos % BS
            self.kv_caches, res = self._ragged(self.state, self.kv_caches, tokens, positions, slot_mapping,
                                               block_tables, kv_lens, cu_q_lens, sampling)
        with self.stats.lock:
            self.stats.padded_tokens += T - num_real
        tok, tok_lp, top_ids, top_lp = res
        logprobs = (np.asarray(tok_lp), np.asarray(top_ids), np.asarray(top_lp)) if want_logprobs else None
        return StepResult(np.asarray(tok), logprobs)

    # ------------------------------------------------------------------------------
    def warmup(self, log=print) -> None:
        """Compile the decode program and every token bucket of the ragged program, on
        all-idle inputs (every write lands in the null block)."""
        cfg = self.config
        S, W = cfg.max_num_seqs, cfg.max_blocks_per_seq
        t0 = time.perf_counter()
        zeros_s = np.zeros(S, np.int32)
        bt = np.zeros((S, W), np.int32)
        samp = SamplingTensors(**empty_sampling_arrays(S), want_logprobs=np.bool_(False))
        self.kv_caches, res = self._decode(self.state, self.kv_caches, zeros_s, zeros_s, zeros_s, bt, zeros_s, samp)
        jax.block_until_ready(res)
        buckets = cfg.token_buckets
        for i, T in enumerate(buckets):
            log(f"warm-up: compiling step programs {i + 2}/{len(buckets) + 1} (prefill bucket {T} tokens)")
            zeros_t = np.zeros(T, np.int32)
            self.kv_caches, res = self._ragged(self.state, self.kv_caches, zeros_t, zeros_t, zeros_t, bt, zeros_s,
                                               np.zeros(S + 1, np.int32), samp)
            jax.block_until_ready(res)
        log(f"warm-up: {self.stats.num_compilations} programs compiled in {time.perf_counter() - t0:.1f}s")
