"""Speculative decoding: the config, the proposers, and what they hand the verifier.

A proposer guesses the next k tokens of a sequence cheaply; the target model then
computes the sequence's last known token and the k guesses in one ragged step (1 + k
query rows over its paged context) and keeps the longest prefix the rejection rule
accepts, plus one token of its own (sampler.py `rejection_sample`), so the output
distribution is exactly that of non-speculative sampling.

Proposers are found in one registry, PROPOSERS (policy.py's Registry): the `method` of
vLLM's --speculative-config names one. `ngram` (prompt lookup) lives here; `draft_model`
lives in draft_model.py, which registers itself on import: `create_proposer` imports the
module that registers a method (_PROPOSER_MODULES) before it looks the method up, so this
module never imports a model (and stays free of JAX, as config.py imports it).

The proposer interface: two Protocols (ngram and the draft model share no code), told
apart by the attribute `drafts_at_scheduling`, on which the engine and the scheduler
dispatch (a type checker narrows `Proposer` on it):

  SchedulingProposer (drafts_at_scheduling = True): its drafts are a pure function of a
    sequence's known tokens, so the scheduler takes them when it reserves their room
  draft(spec, seq, k) -> list[int]   (static) seq's up to k drafts
  StepProposer (drafts_at_scheduling = False): it proposes after scheduling
  propose(seqs, k) -> Proposals      once per step, for the sequences verified in it

and both:

  __init__(config, target, stats)    config: the resolved EngineConfig; target: the
                                     target's LoadedModel (model_loader.py); stats: EngineStats
  draft_probs: bool                  its Proposals carry draft_probs (else q is one-hot)
  weight_bytes() -> int              its device weights, counted before KV sizing
  kv_bytes_per_block() -> int        its KV bytes per block of block_size tokens (0: none);
                                     its cache has the target's block count and is indexed
                                     by the target's block tables, so KV sizing divides the
                                     budget by target + draft bytes per block
  allocate(num_kv_blocks) -> None    allocate its KV cache (after sizing)
  device_bytes() -> (int, int)       its weights and KV cache as measured on the devices
                                     (after allocate): reported with the target's
  warmup() -> None                   compile every program it runs; nothing compiles after
  free(seq) -> None                  seq was preempted (its blocks are gone) or finished

Drafts known at scheduling time are what vLLM keeps on the request (`spec_token_ids`) for
its scheduler to read: the scheduler reserves room for exactly them, once per row and
step. A proposer that must run after scheduling (a draft model writes its own K/V into
the blocks the scheduler allocates) gets all k reserved, and the scheduler trims each row
to what propose() returned (Scheduler.take_proposals).

propose() is called after every token of those sequences is known on the host (a step
with proposals runs synchronously). For each seq the scheduler has already allocated
blocks covering positions up to seq.num_tokens - 1 + k, so a draft may write its own K/V
at positions num_tokens - 1 .. num_tokens + k - 2 through seq.block_table. Writing a
position again with the same token sequence before it writes identical values, so a
draft may recompute positions it is unsure of (a block shared through the prefix cache,
a position whose proposal was rejected): that is how it stays in step with no other hook.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol

import numpy as np

from policy import Registry
from sampling_params import is_int

if TYPE_CHECKING:
    import jax

    from config import EngineConfig
    from metrics import EngineStats
    from model_loader import LoadedModel
    from sequence import Sequence

# The module whose import registers each method (this one for ngram).
_PROPOSER_MODULES = {"ngram": __name__, "draft_model": "draft_model"}
MAX_SPECULATIVE_TOKENS = 16  # each one is a query row per sequence and a [k, V] slice of the verifier


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config (JSON) / LLM(speculative_config=dict), the keys taxirank
    implements; any other key is a ValueError naming it.

    method: "ngram" (prompt lookup) or "draft_model"; as vLLM, model="ngram" alone means
    ngram, and a model path alone means draft_model. disable_by_batch_size: no
    speculation in a step with at least this many running sequences (vLLM's knob).
    draft_tensor_parallel_size: vLLM's, taken where it is 1 (the only placement here).
    min_acceptance_rate: a sequence stops speculating once, after acceptance_window
    proposals, its running acceptance rate (accepted / proposed tokens over those
    proposals) is below this (0: never); the rule is documented with its measurement in
    docs/ARCHITECTURE.md."""

    method: str | None = None
    num_speculative_tokens: int | None = None
    model: str | None = None  # draft_model: a path (GGUF or HF directory) or a built-in name
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None
    draft_tensor_parallel_size: int | None = None  # vLLM's; a draft runs on one device here: 1 only
    min_acceptance_rate: float = 0.0
    acceptance_window: int = 8

    def __post_init__(self) -> None:
        def need(cond: bool, key: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"speculative_config.{key} {msg}, got {getattr(self, key)!r}")

        # vLLM spells ngram "ngram" or "[ngram]", as the method or as the model alone
        ngram = ("ngram", "[ngram]")
        method = "ngram" if self.method in ngram else self.method
        if method is None:
            need(self.model is not None, "method", "is needed (ngram or draft_model) when no model is given")
            method = "ngram" if self.model in ngram else "draft_model"
        if method == "ngram" and self.model in ngram:
            object.__setattr__(self, "model", None)
        object.__setattr__(self, "method", method)
        need(isinstance(method, str) and method in _PROPOSER_MODULES, "method",  # (a list is no key: a TypeError)
             f"must be one of {', '.join(_PROPOSER_MODULES)}")
        need(is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
             "num_speculative_tokens", f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        if method == "ngram":
            need(self.model is None, "model", "is for method draft_model, not ngram")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for key, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                need(v is None or (is_int(v) and v >= 1), key, "must be an integer >= 1")
            # vLLM's defaults: both 5 when neither is given, else the one given for both.
            lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
            need(lo <= hi, "prompt_lookup_min", f"must be <= prompt_lookup_max ({hi})")
        else:
            need(isinstance(self.model, str) and bool(self.model), "model", "must name the draft model (a path or "
                 "a built-in name)")
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                need(getattr(self, key) is None, key, "is for method ngram")
        need(self.disable_by_batch_size is None or (is_int(self.disable_by_batch_size)
                                                    and self.disable_by_batch_size >= 2),
             "disable_by_batch_size", "must be an integer >= 2 (vLLM's bound)")
        need(self.draft_tensor_parallel_size in (None, 1) and not isinstance(self.draft_tensor_parallel_size, bool),
             "draft_tensor_parallel_size", "must be 1: the draft runs on one device")
        need(isinstance(self.min_acceptance_rate, (int, float)) and not isinstance(self.min_acceptance_rate, bool)
             and 0.0 <= self.min_acceptance_rate <= 1.0, "min_acceptance_rate", "must be a number in [0, 1]")
        need(is_int(self.acceptance_window) and self.acceptance_window >= 1, "acceptance_window",
             "must be an integer >= 1")

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the CLI's JSON text, LLM's dict, or an instance; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except RecursionError:  # nested past the decoder's stack
                raise ValueError("speculative_config is nested too deeply") from None
            except ValueError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unsupported key(s) {', '.join(map(repr, unknown))}; "
                             f"taxirank takes {', '.join(sorted(known))}")
        return cls(**value)

    @property
    def k(self) -> int:
        assert self.num_speculative_tokens is not None
        return self.num_speculative_tokens


@dataclass
class Proposals:
    """One step's proposals, aligned with the sequences propose() was given."""

    token_ids: list[list[int]]  # per sequence, 0..k tokens
    # [rows >= len(seqs), k, V] float32 on the device: the (filtered) distribution each
    # draft token was drawn from; None: deterministic proposals (q one-hot at the token).
    draft_probs: jax.Array | None = None


class _ProposerBase(Protocol):
    """What every proposer has (module docstring)."""

    draft_probs: bool  # its Proposals carry draft_probs (else the verifier takes q one-hot)

    def __init__(self, config: EngineConfig, target: LoadedModel, stats: EngineStats) -> None: ...

    def weight_bytes(self) -> int: ...

    def kv_bytes_per_block(self) -> int: ...

    def allocate(self, num_kv_blocks: int) -> None: ...

    def device_bytes(self) -> tuple[int, int]: ...

    def warmup(self) -> None: ...

    def free(self, seq: Sequence) -> None: ...


class SchedulingProposer(_ProposerBase, Protocol):
    """Drafts known from a sequence's host tokens: the scheduler takes them from draft()."""

    drafts_at_scheduling: Literal[True]

    @staticmethod
    def draft(spec: SpeculativeConfig, seq: Sequence, k: int) -> list[int]: ...


class StepProposer(_ProposerBase, Protocol):
    """Proposes after scheduling, in the room reserved for all k drafts (the engine calls propose())."""

    drafts_at_scheduling: Literal[False]

    def propose(self, seqs: list[Sequence], k: int) -> Proposals: ...


Proposer = SchedulingProposer | StepProposer


PROPOSERS: Registry[Proposer] = Registry("speculative_config.method")


def create_proposer(config: EngineConfig, target: LoadedModel, stats: EngineStats) -> Proposer:
    spec = config.speculative_config
    assert spec is not None and spec.method is not None
    __import__(_PROPOSER_MODULES[spec.method])  # its import registers it
    proposer: Proposer = PROPOSERS[spec.method](config, target, stats)
    return proposer


def scheduling_drafter(spec: SpeculativeConfig) -> Callable[[Sequence, int], list[int]] | None:
    """The function the scheduler calls, when it reserves a row's draft room, for the row's
    up to k drafts when the proposer knows them before the step (drafts_at_scheduling:
    ngram reads only host tokens), so it reserves exactly them and the rest goes to the
    step's prompt chunks; None for a proposer that proposes after scheduling (a draft
    model), for which the scheduler reserves all k."""
    assert spec.method is not None
    __import__(_PROPOSER_MODULES[spec.method])  # its import registers it
    cls: type[Proposer] = PROPOSERS[spec.method]
    return partial(cls.draft, spec) if cls.drafts_at_scheduling else None


@PROPOSERS.register("ngram")
class NgramProposer:
    """Prompt lookup (vLLM's ngram method): find the longest n-gram, n in
    [prompt_lookup_min, prompt_lookup_max], that ends the sequence's tokens (prompt and
    outputs) and occurs earlier in them; propose the (up to) k tokens that followed its
    earliest occurrence. Host-only: no weights, no KV cache, nothing to compile; the
    scheduler takes its drafts (draft()) when it reserves their room."""

    draft_probs = False
    drafts_at_scheduling: Literal[True] = True  # a pure function of the tokens so far

    @staticmethod
    def draft(spec: SpeculativeConfig, seq: Sequence, k: int) -> list[int]:
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        return ngram_lookup(seq.token_array(), spec.prompt_lookup_min, spec.prompt_lookup_max, k)

    def __init__(self, config: EngineConfig, target: LoadedModel, stats: EngineStats) -> None:
        pass

    def weight_bytes(self) -> int:
        return 0

    def kv_bytes_per_block(self) -> int:
        return 0

    def allocate(self, num_kv_blocks: int) -> None:
        pass

    def device_bytes(self) -> tuple[int, int]:
        return 0, 0

    def warmup(self) -> None:
        pass

    def free(self, seq: Sequence) -> None:
        pass


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The up to k tokens after the earliest earlier occurrence of the longest suffix
    n-gram of `tokens` with min_n <= n <= max_n; [] when none occurs (or k <= 0)."""
    L = len(tokens)
    if k <= 0 or L < min_n + 1:
        return []
    # Candidate ends: earlier positions holding the last token (the suffix itself excluded).
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    match_len = np.zeros(len(ends), np.int64)  # how far back each candidate matches, capped at max_n
    alive = np.ones(len(ends), bool)
    for d in range(max_n):
        if d:
            idx = ends - d
            alive &= idx >= 0
            alive[alive] &= tokens[idx[alive]] == tokens[L - 1 - d]
        match_len += alive
        if not alive.any():
            break
    if not len(ends) or match_len.max() < min_n:
        return []
    best = match_len.max()
    end = ends[np.flatnonzero(match_len == best)[0]]  # the earliest occurrence of the longest match
    return tokens[end + 1:end + 1 + k].tolist()
