"""The draft model of speculative decoding: a smaller model with the target's vocabulary
proposes each sequence's next k tokens, which the target then verifies in its ragged step.

The draft runs in the same engine, on its own paged KV cache: its own K/V arrays (its own
layers, heads and head_dim) indexed by the SAME block tables and slot mapping as the
target's, with the same block size and number of blocks, so the scheduler allocates and
frees once for both. Its bytes per block count in the KV sizing.

Per step, `DraftModelProposer.propose(seqs, k)` dispatches two kinds of programs:

- **catch-up** (one per token bucket, as the target's ragged step): a ragged pass over
  each sequence's tokens the draft has not seen yet: the whole prompt the first time (or
  after a preemption or a prefix-cache admission: a new block table), then normally the
  one or two tokens the last verification added (the recovered or bonus token, and the
  last draft token when all k were accepted). More than max_num_batched_tokens of them go
  in several passes; the last pass holds each sequence's last token, whose hidden state
  the draft program starts from.
- **draft** (one per decode bucket): k autoregressive steps inside one program (a
  `lax.scan` over k - 1 decodes; the LM head k times), each token drawn from the draft's
  filtered distribution with the request's sampling parameters (greedy: argmax), and the
  distribution q it was drawn from returned beside it, [rows, k, V] on the device.

Which draft K/V is valid needs no hook from the verifier: the draft remembers the tokens
it wrote past the known ones, and at the next proposal keeps the positions whose tokens
the sequence really has (the accepted prefix); every later position is written again
before it is read (attention reads a row's first kv_len positions only). free(seq) on a
preemption or a finish forgets the sequence; so does a change in the blocks under its
trusted positions. A sequence admitted with a prefix-cache hit has its whole prefix
computed again by the draft: the cached blocks' draft K/V may never have been written
(their owner did not speculate), and rewriting a position with the same tokens writes
the same values.

A draft that exists for smollm2 here is a **layer-skip** of the same checkpoint: a subset
of its decoder layers with its embeddings, final norm and LM head, unchanged and untrained
(the first N: an early exit; first and last layers: the middle skipped, as in
self-speculative decoding, Zhang et al. 2023). `python draft_model.py layer-skip smollm2
0-5,24-29 DIR` writes it as a Hugging Face safetensors directory, which `"model": "DIR"`
then names in the speculative config, and which any loader (transformers too) reads as an
ordinary model of that many layers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import checkpoint
from attention_backend import AttentionBackend, AttentionShape, select_attention_backend
from compilation import Built, CountedProgram, count_compile, shared_programs, warmup_summary
from config import EngineConfig
from hf_config import read_json
from kvcache import blocks_needed, create_kv_caches, kv_cache_bytes_per_block
from metrics import EngineStats
from model import AttentionInputs, ModelConfig, device_bytes, param_bytes
from model_loader import LoadedModel, hf_state_dict, load_model, quantize_loaded
from quant import weight_quant_for
from quant_methods import QUANTIZATION_METHODS
from sampler import SamplingTensors, empty_sampling_arrays, fill_slot, filtered_probs
from sampling_params import SAMPLING_EPS
from sequence import Sequence
from spec_decode import PROPOSERS, Proposals, check_key
from tokenizer import ByteTokenizer

# The draft's random stream is fold_in(fold_in(key(seed), output index), DRAFT_STREAM):
# apart from every stream the target's sampling and the verifier draw from (fold_in(key,
# index) itself, and its folds 1 and 2), as the rejection rule needs: the draft's choice
# must be independent of the acceptance test. A proposal for an output index is drawn
# again with the same key after a rejection, which is still independent of everything
# emitted: no token at or past that index had been emitted, so the earlier draw decided
# nothing that was kept.
DRAFT_STREAM = 0x64726674


# ---- loading --------------------------------------------------------------------------

def load_draft(name: str, config: EngineConfig, target: LoadedModel,
               log: Callable[[str], None] = print) -> LoadedModel:
    """The draft model `name` (a built-in, a .gguf file, an HF directory or a converted
    checkpoint: what --model takes), checked against the target it drafts for. It runs on
    the default device, whole, also when the target is sharded over a mesh (--tensor-parallel-size:
    its proposals and q go to the verifier's mesh; KV sizing counts its weights and cache on
    that one device); EngineConfig refuses speculation over more hosts."""
    path = os.path.expanduser(name)
    spec = config.speculative_config
    assert spec is not None
    quantization = spec.options.quantization
    if os.path.isdir(path) and checkpoint.is_checkpoint(path):
        draft = quantize_loaded(checkpoint.load(path, config.dtype), weight_quant_for(quantization, None))
    else:
        draft = load_model(path, config.dtype, config.seed, log=log, quantization=quantization)
    check_vocabulary(target, draft)
    if draft.config.max_model_len < config.max_model_len:
        raise ValueError(f"the draft model {name!r} runs up to {draft.config.max_model_len} positions, "
                         f"less than max_model_len {config.max_model_len}: lower --max-model-len")
    return draft


def check_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft token must mean what the target's token of that id means: the same
    vocabulary size, special ids and (when both have one) tokenizer. ValueError if not."""
    t, d = target.config, draft.config
    what = f"the draft model {draft.name!r} and the target {target.name!r}"
    if t.vocab_size != d.vocab_size:
        raise ValueError(f"{what} have different vocabulary sizes ({d.vocab_size} vs {t.vocab_size})")
    if (t.bos_token_id, set(t.eos_token_ids)) != (d.bos_token_id, set(d.eos_token_ids)):
        raise ValueError(f"{what} have different special ids (bos {d.bos_token_id} vs {t.bos_token_id}, "
                         f"eos {sorted(d.eos_token_ids)} vs {sorted(t.eos_token_ids)})")
    ft, fd = _vocabulary(target.tokenizer), _vocabulary(draft.tokenizer)
    if ft is not None and fd is not None and ft != fd:
        raise ValueError(f"{what} have different tokenizers (the same id names different tokens)")


def _vocabulary(tokenizer: Any) -> Any:
    """What identifies a tokenizer's id -> token map; None: no tokenizer to compare."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, ByteTokenizer):
        return "bytes"
    return sorted(tokenizer.get_vocab().items())


def parse_layers(text: str) -> list[int]:
    """"8" -> the first 8 layers; "0-5,24-29" -> those layers (ranges inclusive), in order."""
    try:
        if text.isdigit():
            return list(range(int(text)))
        out = []
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"layers must be a count (8) or ranges (0-5,24-29), got {text!r}") from None
    return out


def write_layer_skip(source: str, layers: list[int], out: str, log: Callable[[str], None] = print) -> str:
    """Write the decoder layers `layers` (indices into source's, increasing) of `source`
    (a GGUF file, a built-in GGUF name such as smollm2, or an HF directory), with its
    embeddings, final norm and LM head, as an HF safetensors directory `out` (config.json
    with num_hidden_layers = len(layers), model.safetensors, the tokenizer): the model
    that skips every other layer. Weights are copied as loaded (a GGUF file's dequantized
    to float32), untrained. Returns out."""
    from safetensors.numpy import save_file

    import gguf_loader

    if os.path.exists(out):
        raise FileExistsError(f"{out} exists: choose a new directory")
    if source in gguf_loader.BUILTIN_GGUF or source.endswith(".gguf"):
        path = gguf_loader.resolve_builtin(source, log) if source in gguf_loader.BUILTIN_GGUF else source
        hf_config, where = dict(gguf_loader.read_gguf(path).hf_config), f"{path} (GGUF metadata)"
    elif os.path.isfile(where := os.path.join(source, "config.json")):
        hf_config = read_json(where)
    else:
        raise ValueError(f"{source!r} is neither a GGUF file (or built-in GGUF name) nor an HF directory: "
                         "a layer-skip draft is cut from a trained checkpoint")
    full = ModelConfig.from_hf(hf_config, where).num_hidden_layers
    if not (layers and layers == sorted(set(layers)) and 0 <= layers[0] and layers[-1] < full
            and len(layers) < full):
        raise ValueError(f"layers must be increasing indices in 0..{full - 1}, fewer than all {full} "
                         f"({source}'s), got {layers}")
    loaded = load_model(source, "float32", log=log)
    renamed = {f"model.layers.{old}.": f"model.layers.{new}." for new, old in enumerate(layers)}
    tensors = {}
    for name, x in hf_state_dict(loaded.model).items():
        if name.startswith("model.layers."):
            prefix = ".".join(name.split(".")[:3]) + "."
            if prefix not in renamed:
                continue
            name = renamed[prefix] + name[len(prefix):]
        tensors[name] = x
    if isinstance(hf_config.get("layer_types"), list):  # transformers' per-layer attention kinds
        hf_config["layer_types"] = [hf_config["layer_types"][i] for i in layers]
    hf_config.update(num_hidden_layers=len(layers), torch_dtype="float32",
                     taxirank_layer_skip={"source": source, "source_layers": full, "kept_layers": layers})
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".layer-skip-", dir=parent)  # renamed into place when complete
    try:
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=1)
        if hasattr(loaded.tokenizer, "save_pretrained"):
            loaded.tokenizer.save_pretrained(tmp)
        generation = os.path.join(source, "generation_config.json")
        if os.path.isfile(generation):  # its extra stop ids are part of the vocabulary check
            shutil.copy(generation, tmp)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"layer-skip draft: layers {layers} of the {full} of {source} (+ embeddings, final norm, LM head) in {out}")
    return out


# ---- sampling the draft tokens ------------------------------------------------------------

def sample_draft(logits: jax.Array, t: SamplingTensors, step: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(token [S], q [S, V]): each row's draft token and the filtered distribution it was
    drawn from (sampler.filtered_probs: the target's own filters; one-hot at the argmax
    for a greedy row); step [S] is the output index the token is proposed for. The sort
    is skipped when every row is greedy."""
    V = logits.shape[1]
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    is_greedy = t.temperature < SAMPLING_EPS

    def sampled() -> tuple[jax.Array, jax.Array]:
        q = filtered_probs(logits, t)
        keys = jax.vmap(lambda seed, n: jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), n),
                                                           DRAFT_STREAM))(t.seed, step)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
        tok = jnp.argmax(jnp.where(q > 0, jnp.log(q), -jnp.inf) + gumbel, axis=-1).astype(jnp.int32)
        return jnp.where(is_greedy, greedy_tok, tok), q

    return jax.lax.cond(jnp.all(is_greedy), lambda: (greedy_tok, jax.nn.one_hot(greedy_tok, V, dtype=jnp.float32)),
                        sampled)


# ---- the draft model in the engine ------------------------------------------------------

@dataclass
class _DraftKV:
    """What the draft's cache holds for one sequence."""

    valid: int  # positions 0..valid-1 hold the K/V of the sequence's own tokens
    speculated: list[int]  # draft tokens written at valid, valid + 1, ...: valid while accepted
    blocks: list[int]  # the blocks those positions were written in


# Shared like the target's step programs (compilation.step_programs): another engine in this
# process with the same draft model and shapes reuses these, traces and compiles included.
@shared_programs(maxsize=8)
def draft_programs(graphdef: Any, backend: AttentionBackend, K: int, BS: int, N: int) -> tuple[Callable, Callable]:
    """The draft's two jitted programs: catch_up (a ragged forward over the tokens its
    cache lacks) and draft (k tokens, each from the last)."""

    def catch_up(state, kv_caches, tokens, positions, slot_mapping, block_tables, kv_lens, cu_q_lens):
        count_compile()
        model = nnx.merge(graphdef, state)
        hidden, kv_caches = model(tokens, positions, kv_caches,
                                  AttentionInputs(slot_mapping, block_tables, kv_lens, cu_q_lens), backend)
        return kv_caches, hidden[jnp.maximum(cu_q_lens[1:] - 1, 0)]  # each row's last token

    def draft(state, kv_caches, last_hidden, hidden_row, block_tables, first_pos, num_draft, samp):
        """d_1 from each row's last hidden state, then d_j (j < num_draft) decoded at
        first_pos + j - 1 to give d_{j+1}. Rows write K/V only for j < num_draft."""
        count_compile()
        model = nnx.merge(graphdef, state)
        W = block_tables.shape[1]
        sampling = SamplingTensors(**samp, want_logprobs=jnp.bool_(False))
        tok, q = sample_draft(model.compute_logits(last_hidden[hidden_row]), sampling, sampling.step)

        def body(carry, j):
            kv_caches, tok = carry
            pos = first_pos + j - 1
            write = j < num_draft
            block = jnp.take_along_axis(block_tables, jnp.clip(pos // BS, 0, W - 1)[:, None], axis=1)[:, 0]
            attn = AttentionInputs(jnp.where(write, block * BS + pos % BS, 0), block_tables,
                                   jnp.where(write, pos + 1, 0), None)
            hidden, kv_caches = model(tok, pos, kv_caches, attn, backend)
            tok, q = sample_draft(model.compute_logits(hidden), sampling, sampling.step + j)
            return (kv_caches, tok), (tok, q)

        toks, qs = [tok[:, None]], [q[:, None]]
        if K > 1:
            (kv_caches, _), (more_toks, more_qs) = jax.lax.scan(body, (kv_caches, tok), jnp.arange(1, K))
            toks.append(more_toks.T)
            qs.append(jnp.swapaxes(more_qs, 0, 1))
        q = jnp.concatenate(qs, axis=1)
        if q.shape[0] < N:  # the verifier's programs take q at one shape: max_num_seqs rows
            q = jnp.zeros((N, *q.shape[1:]), q.dtype).at[:q.shape[0]].set(q)
        return kv_caches, jnp.concatenate(toks, axis=1), q

    return jax.jit(catch_up, donate_argnums=1), jax.jit(draft, donate_argnums=1)


@dataclass(frozen=True)
class DraftOptions:
    """draft_model's keys (vLLM's): quantization, the --quantization method that stores the
    draft's linears (None: as the draft's file stores them), whatever the target's is."""

    quantization: str | None = None

    def __post_init__(self) -> None:
        q = self.quantization
        check_key(q is None or isinstance(q, str) and q in QUANTIZATION_METHODS, "quantization", q,
                  f"must be one of {', '.join(map(str, QUANTIZATION_METHODS))} (or null)")


@PROPOSERS.register("draft_model")
class DraftModelProposer:
    """The draft's weights, KV cache and programs (module docstring), behind spec_decode's
    StepProposer protocol: propose() returns, for each sequence, up to k draft tokens and, on
    the device, the distributions they were drawn from."""

    aliases: tuple[str, ...] = ()
    needs_model = True  # speculative_config.model: the draft
    options = DraftOptions
    draft_probs = True  # its proposals are sampled: the verifier reads q
    drafts_at_scheduling: Literal[False] = False  # it runs after scheduling, in the blocks reserved for all k

    def __init__(self, config: EngineConfig, target: LoadedModel, stats: EngineStats,
                 log: Callable[[str], None] = print) -> None:
        spec = config.speculative_config
        assert spec is not None and spec.model is not None and config.max_model_len is not None
        draft = load_draft(spec.model, config, target, log)
        self.config, self.loaded, self.stats = config, draft, stats
        self.k = spec.k
        self.block_size = config.block_size
        self.backend = select_attention_backend(
            config.attention_backend,
            AttentionShape.of(draft.config, config.block_size, draft.dtype, config.kv_cache_dtype))
        graphdef, self.state = nnx.split(draft.model)
        self.kv_caches: Any = None
        self._seqs: weakref.WeakKeyDictionary[Sequence, _DraftKV] = weakref.WeakKeyDictionary()
        catch_up, draft = draft_programs(graphdef, self.backend, self.k, config.block_size, config.max_num_seqs)
        self._catch_up, self._draft = CountedProgram(catch_up, stats), CountedProgram(draft, stats)

    def weight_bytes(self) -> int:
        return param_bytes(self.loaded.model)

    def kv_bytes_per_block(self) -> int:
        """What one block costs in the draft's cache (added to the target's in KV sizing)."""
        return kv_cache_bytes_per_block(self.loaded.config, self.block_size, self.loaded.dtype,
                                        self.config.kv_cache_dtype)

    def allocate(self, num_blocks: int) -> None:
        """The draft's cache: as many blocks as the target's (the same block tables index both)."""
        self.kv_caches = create_kv_caches(self.loaded.config, num_blocks, self.block_size, self.loaded.dtype,
                                          self.config.kv_cache_dtype)

    def device_bytes(self) -> tuple[int, int]:
        """Its weights and KV cache on the device, measured from the arrays (metrics)."""
        return device_bytes(nnx.state(self.loaded.model, nnx.Param)), device_bytes(self.kv_caches)

    def free(self, seq: Sequence) -> None:
        """Forget seq (finished, or preempted: its blocks are gone)."""
        self._seqs.pop(seq, None)

    # ---- one proposal -------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], k: int) -> Proposals:
        """Up to min(k, num_speculative_tokens) draft tokens per sequence (fewer where its
        block table or max_model_len ends), from its known tokens (prompt + outputs), and
        q [max_num_seqs, num_speculative_tokens, V] on the device: row i the distributions
        sequence i's tokens were drawn from (rows and columns past the proposals are
        padding). The draft program computes the decode bucket of len(seqs) rows."""
        cfg, BS = self.config, self.block_size
        n = len(seqs)
        assert 0 < n <= cfg.max_num_seqs and 1 <= k
        k = min(k, self.k)
        segments: list[list[int]] = []  # per sequence: [row, first position to compute, end]
        tokens_of: list[list[int]] = []
        num_draft = np.zeros(n, np.int32)
        for i, seq in enumerate(seqs):
            ids = seq.all_token_ids
            known, covered = len(ids), len(seq.block_table) * BS
            track = self._seqs.get(seq)
            valid = 0
            if track is not None:
                valid = track.valid
                # The drafts' K/V holds up to the first token the sequence did not accept. That
                # is not always its last: a step that gave the row no draft room decodes after it.
                for t, want in zip(track.speculated, ids[valid:]):
                    if t != want:
                        break
                    valid += 1
                # The verifier gives back the blocks past its computed tokens, never those
                # below: a block of the trusted positions that changed means the sequence
                # lost its blocks (free() was not told), and nothing is trusted.
                n_blocks = blocks_needed(valid, BS)
                if seq.block_table[:n_blocks] != track.blocks[:n_blocks]:
                    valid = 0
            end = min(known, covered)
            start = min(valid, end - 1) if end == known else min(valid, end)
            # d_1 sits at position `known`; d_j's K/V is written at known + j - 1 for j < num_draft.
            num_draft[i] = max(0, min(k, cfg.max_model_len - known, covered - known + 1)) if end == known else 0
            segments.append([i, start, end])
            tokens_of.append(ids)
        last_hidden, hidden_row = self._run_catch_up(seqs, segments, tokens_of)
        R = next(b for b in cfg.decode_buckets if b >= n)
        W = cfg.max_blocks_per_seq
        block_tables = np.zeros((R, W), np.int32)
        first_pos, nd, rows = np.zeros(R, np.int32), np.zeros(R, np.int32), np.zeros(R, np.int32)
        sampling = empty_sampling_arrays(R)
        for i, seq in enumerate(seqs):
            block_tables[i, :len(seq.block_table)] = seq.block_table
            first_pos[i], nd[i], rows[i] = len(tokens_of[i]), num_draft[i], hidden_row[i]
            fill_slot(sampling, i, seq.params, seq.seed or 0, seq.num_output_tokens)
        self.kv_caches, toks, q = self._draft(self.state, self.kv_caches, last_hidden, rows, block_tables,
                                              first_pos, nd, sampling)
        toks = np.asarray(toks)
        proposals = []
        for i, seq in enumerate(seqs):
            d = toks[i, :num_draft[i]].tolist()
            proposals.append(d)
            end = segments[i][2]
            written = blocks_needed(end + max(len(d) - 1, 0), cfg.block_size)
            self._seqs[seq] = _DraftKV(end, d[:-1], seq.block_table[:written])
        return Proposals(proposals, q)

    def _run_catch_up(self, seqs: list[Sequence], segments: list[list[int]],
                      tokens_of: list[list[int]]) -> tuple[jax.Array, np.ndarray]:
        """Compute the draft K/V of each segment [row, start, end): in one ragged pass when
        they fit in max_num_batched_tokens, else earlier passes take tokens from the
        segments' fronts so that the last pass holds every segment's tail. Returns the
        last pass's per-row last hidden states and, per sequence, its row there."""
        cfg = self.config
        T_max = cfg.max_num_batched_tokens
        todo = [s for s in segments if s[2] > s[1]]
        total = sum(e - s for _, s, e in todo)
        while total > T_max:
            budget, chunk = min(T_max, total - T_max), []
            for seg in todo:
                take = min(budget, seg[2] - seg[1] - 1)  # each keeps its last token for the final pass
                if take > 0:
                    chunk.append((seg[0], seg[1], seg[1] + take))
                    seg[1] += take
                    budget -= take
                    total -= take
                if budget == 0:
                    break
            self._catch_up_pass(seqs, chunk, tokens_of)
        final = [(i, s, e) for i, s, e in todo]
        hidden_row = np.zeros(len(seqs), np.int32)
        for row, (i, _, _) in enumerate(final):
            hidden_row[i] = row
        return self._catch_up_pass(seqs, final, tokens_of), hidden_row

    def _catch_up_pass(self, seqs: list[Sequence], chunk: list[tuple[int, int, int]],
                       tokens_of: list[list[int]]) -> jax.Array:
        cfg, BS = self.config, self.block_size
        S, W = cfg.max_num_seqs, cfg.max_blocks_per_seq
        num = sum(e - s for _, s, e in chunk)
        T = next(b for b in cfg.token_buckets if b >= max(num, 1))
        tokens, positions, slot_mapping = (np.zeros(T, np.int32) for _ in range(3))
        block_tables = np.zeros((S, W), np.int32)
        kv_lens, cu_q_lens = np.zeros(S, np.int32), np.full(S + 1, num, np.int32)
        cu_q_lens[0] = 0
        t = 0
        for row, (i, s, e) in enumerate(chunk):
            bt = np.asarray(seqs[i].block_table, np.int32)
            block_tables[row, :len(bt)] = bt
            pos = np.arange(s, e, dtype=np.int32)
            tokens[t:t + e - s] = tokens_of[i][s:e]
            positions[t:t + e - s] = pos
            slot_mapping[t:t + e - s] = bt[pos // BS] * BS + pos % BS
            kv_lens[row] = e
            t += e - s
            cu_q_lens[row + 1] = t
        self.kv_caches, last_hidden = self._catch_up(self.state, self.kv_caches, tokens, positions, slot_mapping,
                                                     block_tables, kv_lens, cu_q_lens)
        return last_hidden

    def warmup(self, log: Callable[[str], None]) -> None:
        """Compile the draft's programs: catch-up per token bucket, draft per decode bucket."""
        with Built(self.stats) as built:
            self._warmup()
        log(warmup_summary(f"the draft model's {built.traced} programs", "the draft model's programs", built,
                           built.loaded))

    def _warmup(self) -> None:
        cfg = self.config
        S, W = cfg.max_num_seqs, cfg.max_blocks_per_seq
        last_hidden = None
        for T in cfg.token_buckets:
            z = np.zeros(T, np.int32)
            self.kv_caches, last_hidden = self._catch_up(self.state, self.kv_caches, z, z, z, np.zeros((S, W), np.int32),
                                                         np.zeros(S, np.int32), np.zeros(S + 1, np.int32))
        for R in cfg.decode_buckets:
            z = np.zeros(R, np.int32)
            self.kv_caches, toks, _ = self._draft(self.state, self.kv_caches, last_hidden, z,
                                                  np.zeros((R, W), np.int32), z, z, empty_sampling_arrays(R))
        jax.block_until_ready(toks)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="build a draft model for speculative decoding")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("layer-skip", help="LAYERS of SRC (+ embeddings, final norm, LM head) into DST")
    c.add_argument("src", help="a GGUF file, a built-in GGUF name (smollm2) or an HF directory")
    c.add_argument("layers", help="a count (8: the first 8) or ranges (0-5,24-29)")
    c.add_argument("dst", help="a new directory: pass it as the speculative config's \"model\"")
    a = p.parse_args(argv)
    try:
        write_layer_skip(a.src, parse_layers(a.layers), os.path.expanduser(a.dst))
    except (ValueError, OSError) as e:  # a bad source, layer list or destination: one line, as server.py's
        p.exit(2, f"{p.prog}: error: {e}\n")


if __name__ == "__main__":
    main()
