"""Speculative decoding: the config, the proposers, and what they hand the verifier.

A proposer guesses the next k tokens of a sequence cheaply; the target model then
computes the sequence's last known token and the k guesses in one ragged step (1 + k
query rows over its paged context) and keeps the longest prefix the rejection rule
accepts, plus one token of its own (sampler.py `rejection_sample`), so the output
distribution is exactly that of non-speculative sampling.

Proposers are found in one registry, PROPOSERS: the `method` of vLLM's
--speculative-config names one, and a proposer is one class and its registration. The
class declares what it needs, which SpeculativeConfig reads before any proposer exists:
`aliases` (other spellings of its name), `needs_model` (it drafts with
speculative_config.model), `options` (a frozen dataclass of its own keys, checked in its
__post_init__), `draft_probs` and `drafts_at_scheduling`; nothing else compares a method's
name. `ngram` (prompt lookup) lives here; `draft_model` lives in draft_model.py, which
imports JAX: the registry knows it by name and module (`lazy`) and imports the module,
which registers the class, the first time a config names it, so this module, which
config.py imports, stays free of JAX.

The proposer interface: two Protocols (a HostProposer such as ngram, and the draft model),
told apart by the attribute `drafts_at_scheduling`, on which the engine and the scheduler
dispatch (a type checker narrows `Proposer` on it):

  SchedulingProposer (drafts_at_scheduling = True): its drafts are a pure function of a
    sequence's known tokens, so the scheduler takes them when it reserves their room
  draft(spec, seq, k) -> list[int]   (static) seq's up to k drafts
  StepProposer (drafts_at_scheduling = False): it proposes after scheduling
  propose(seqs, k) -> Proposals      once per step, for the sequences verified in it

and both:

  __init__(config, target, stats)    config: the resolved EngineConfig; target: the
                                     target's LoadedModel (model_loader.py); stats: EngineStats
  aliases, needs_model, options      what SpeculativeConfig reads (above)
  draft_probs: bool                  its Proposals carry draft_probs (else q is one-hot)
  weight_bytes() -> int              its device weights, counted before KV sizing
  kv_bytes_per_block() -> int        its KV bytes per block of block_size tokens (0: none);
                                     its cache has the target's block count and is indexed
                                     by the target's block tables, so KV sizing divides the
                                     budget by target + draft bytes per block
  allocate(num_kv_blocks) -> None    allocate its KV cache (after sizing)
  device_bytes() -> (int, int)       its weights and KV cache as measured on the devices
                                     (after allocate): reported with the target's
  warmup(log) -> None                compile every program it runs, saying so through log;
                                     nothing compiles after
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

import importlib
from dataclasses import dataclass, fields
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol

import numpy as np

from config_file import json_value
from policy import Registry
from sampling_params import is_int

if TYPE_CHECKING:
    import jax

    from config import EngineConfig
    from metrics import EngineStats
    from model_loader import LoadedModel
    from sequence import Sequence

MAX_SPECULATIVE_TOKENS = 16  # each one is a query row per sequence and a [k, V] slice of the verifier


def check_key(ok: bool, key: str, value: object, msg: str) -> None:
    """A ValueError naming speculative_config.`key` unless `ok`: how SpeculativeConfig and a
    method's own options refuse a value."""
    if not ok:
        raise ValueError(f"speculative_config.{key} {msg}, got {value!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config (JSON) / LLM(speculative_config=dict), the keys taxirank
    implements; any other key is a ValueError naming it.

    method: a registered proposer (PROPOSERS) or one of its spellings. As vLLM infers it
    when it is absent: a model that spells a method drafting without a model means that
    method (model="ngram"), any other model the one method that drafts with a model (a
    draft model). options: the method's own keys (its `options` dataclass, None if it has
    none); a key of another method is a ValueError naming it. disable_by_batch_size: no
    speculation in a step with at least this many running sequences (vLLM's knob).
    draft_tensor_parallel_size: vLLM's, taken where it is 1 (the only placement here).
    min_acceptance_rate: a sequence stops speculating once, after acceptance_window
    proposals, its running acceptance rate (accepted / proposed tokens over those
    proposals) is below this (0: never); the rule is documented with its measurement in
    docs/ARCHITECTURE.md."""

    method: str | None = None
    num_speculative_tokens: int | None = None
    model: str | None = None  # for a method that drafts with a model: a path (GGUF or HF directory) or a built-in name
    disable_by_batch_size: int | None = None
    draft_tensor_parallel_size: int | None = None  # vLLM's; a draft runs on one device here: 1 only
    min_acceptance_rate: float = 0.0
    acceptance_window: int = 8
    options: Any = None  # the method's own keys: given as {key: value}, kept as its `options` dataclass

    def __post_init__(self) -> None:
        def need(cond: bool, key: str, msg: str) -> None:
            check_key(cond, key, getattr(self, key), msg)

        need(self.method is not None or self.model is not None, "method",
             f"is needed (one of {', '.join(PROPOSERS.names())}) when no model is given")
        cls = PROPOSERS.find(self.method if self.method is not None else self.model)
        if self.method is None and (cls is None or cls.needs_model):
            with_model = [c.name for c in PROPOSERS.classes() if c.needs_model]
            need(len(with_model) == 1, "method", "is needed: a model alone means the one method that drafts "
                 f"with a model, and these do: {', '.join(with_model) or 'none'}")
            cls = PROPOSERS[with_model[0]]
        need(cls is not None, "method", f"must be one of {', '.join(PROPOSERS.names())}")
        assert cls is not None
        object.__setattr__(self, "method", cls.name)
        if not cls.needs_model and self.model in (cls.name, *cls.aliases):
            object.__setattr__(self, "model", None)  # vLLM's model="[ngram]" beside its method
        if cls.needs_model:
            need(isinstance(self.model, str) and bool(self.model), "model",
                 f"must name the model method {cls.name} drafts with (a path or a built-in name)")
        else:
            need(self.model is None, "model", f"is not taken by method {cls.name} (it drafts without a model)")
        # an instance of the method's options dataclass was checked when it was made (and is
        # what dataclasses.replace hands back); anything else is the method's keys as a dict
        if cls.options is None or not isinstance(self.options, cls.options):
            need(self.options is None or isinstance(self.options, dict), "options",
                 f"must be a dict of method {cls.name}'s own keys")
            object.__setattr__(self, "options", self._method_options(cls, self.options or {}))
        need(is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
             "num_speculative_tokens", f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        need(self.disable_by_batch_size is None or (is_int(self.disable_by_batch_size)
                                                    and self.disable_by_batch_size >= 2),
             "disable_by_batch_size", "must be an integer >= 2 (vLLM's bound)")
        need(self.draft_tensor_parallel_size in (None, 1) and not isinstance(self.draft_tensor_parallel_size, bool),
             "draft_tensor_parallel_size", "must be 1: the draft runs on one device")
        need(isinstance(self.min_acceptance_rate, (int, float)) and not isinstance(self.min_acceptance_rate, bool)
             and 0.0 <= self.min_acceptance_rate <= 1.0, "min_acceptance_rate", "must be a number in [0, 1]")
        need(is_int(self.acceptance_window) and self.acceptance_window >= 1, "acceptance_window",
             "must be an integer >= 1")

    @staticmethod
    def _method_options(method: type[Proposer], given: dict[str, Any]) -> Any:
        """The method's options from the keys given beyond the common ones; a key another
        method takes, or none does, is a ValueError naming it."""
        def keys(m: type[Proposer]) -> set[str]:
            return {f.name for f in fields(m.options)} if m.options is not None else set()

        extra = sorted(set(given) - keys(method), key=str)
        for key in extra:
            owner = next((m.name for m in PROPOSERS.classes() if key in keys(m)), None)
            if owner is not None:
                raise ValueError(f"speculative_config.{key} is for method {owner}, not {method.name}")
        if extra:
            raise ValueError(f"speculative_config: unsupported key(s) {', '.join(map(repr, extra))}; taxirank "
                             f"takes {', '.join(sorted(COMMON_KEYS | keys(method)))} with method {method.name}")
        return method.options(**given) if method.options is not None else None

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the CLI's JSON text, LLM's dict, or an instance; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = json_value(value, "speculative_config")
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        common = {k: v for k, v in value.items() if k in COMMON_KEYS}
        return cls(**common, options={k: v for k, v in value.items() if k not in COMMON_KEYS})

    @property
    def k(self) -> int:
        assert self.num_speculative_tokens is not None
        return self.num_speculative_tokens


COMMON_KEYS = frozenset(f.name for f in fields(SpeculativeConfig)) - {"options"}


@dataclass
class Proposals:
    """One step's proposals, aligned with the sequences propose() was given."""

    token_ids: list[list[int]]  # per sequence, 0..k tokens
    # [rows >= len(seqs), k, V] float32 on the device: the (filtered) distribution each
    # draft token was drawn from; None: deterministic proposals (q one-hot at the token).
    draft_probs: jax.Array | None = None


class _ProposerBase(Protocol):
    """What every proposer has (module docstring)."""

    # What it needs, read by SpeculativeConfig before any proposer exists:
    aliases: tuple[str, ...]  # other spellings of its name, as the method or as the model alone
    needs_model: bool  # it drafts with speculative_config.model (a path or a built-in name)
    options: type | None  # a frozen dataclass of its own keys, checked in its __post_init__ (None: none)
    draft_probs: bool  # its Proposals carry draft_probs (else the verifier takes q one-hot)

    def __init__(self, config: EngineConfig, target: LoadedModel, stats: EngineStats) -> None: ...

    def weight_bytes(self) -> int: ...

    def kv_bytes_per_block(self) -> int: ...

    def allocate(self, num_kv_blocks: int) -> None: ...

    def device_bytes(self) -> tuple[int, int]: ...

    def warmup(self, log: Callable[[str], None]) -> None: ...

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


class ProposerRegistry(Registry[Proposer]):
    """PROPOSERS: Registry's name -> class, plus methods known by name before their module
    is imported (`lazy`: name -> the module whose import registers it), so that a method
    whose module imports JAX (a draft model) costs nothing until a config names it."""

    def __init__(self, field: str, lazy: dict[str, str]) -> None:
        super().__init__(field)
        self.lazy = dict(lazy)

    def register(self, name: str) -> Callable[[type[Proposer]], type[Proposer]]:
        self.lazy.pop(name, None)  # its module was imported by name, not through the lookup below
        return super().register(name)

    def __missing__(self, name: str) -> type[Proposer]:
        if name not in self.lazy:
            raise KeyError(name)
        importlib.import_module(self.lazy.pop(name))  # its import registers it
        return self[name]

    def names(self) -> list[str]:
        """Every method's name, sorted (the same list whichever modules are imported yet)."""
        return sorted([*self, *self.lazy])

    def classes(self) -> list[type[Proposer]]:
        """Every method's class, importing the lazily known ones."""
        return [self[name] for name in self.names()]

    def find(self, spelling: object) -> type[Proposer] | None:
        """The method `spelling` names, or spells (its aliases); a lazily known method's
        module is imported only when no imported method answers."""
        if not isinstance(spelling, str):
            return None
        if spelling in self.lazy:
            return self[spelling]
        match = next((c for c in self.values() if spelling in (c.name, *c.aliases)), None)
        if match is None and self.lazy:
            self.classes()
            return self.find(spelling)
        return match


PROPOSERS = ProposerRegistry("speculative_config.method", lazy={"draft_model": "draft_model"})


def create_proposer(config: EngineConfig, target: LoadedModel, stats: EngineStats) -> Proposer:
    spec = config.speculative_config
    assert spec is not None and spec.method is not None
    proposer: Proposer = PROPOSERS[spec.method](config, target, stats)
    return proposer


def scheduling_drafter(spec: SpeculativeConfig) -> Callable[[Sequence, int], list[int]] | None:
    """The function the scheduler calls, when it reserves a row's draft room, for the row's
    up to k drafts when the proposer knows them before the step (drafts_at_scheduling:
    ngram reads only host tokens), so it reserves exactly them and the rest goes to the
    step's prompt chunks; None for a proposer that proposes after scheduling (a draft
    model), for which the scheduler reserves all k."""
    assert spec.method is not None
    cls: type[Proposer] = PROPOSERS[spec.method]
    return partial(cls.draft, spec) if cls.drafts_at_scheduling else None


class HostProposer:
    """A proposer whose drafts are a pure function of a sequence's host tokens: no
    weights, no KV cache, nothing to compile or free; the scheduler takes its drafts
    (draft()) when it reserves their room. A subclass writes draft() and declares its
    options and aliases, if any."""

    aliases: tuple[str, ...] = ()
    needs_model = False
    options: type | None = None
    draft_probs = False
    drafts_at_scheduling: Literal[True] = True

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

    def warmup(self, log: Callable[[str], None]) -> None:
        pass

    def free(self, seq: Sequence) -> None:
        pass


@dataclass(frozen=True)
class NgramOptions:
    """ngram's keys (vLLM's): the n-gram lengths its lookup tries; vLLM's defaults, both 5
    when neither is given, else the one given for both."""

    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for key, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            check_key(v is None or (is_int(v) and v >= 1), key, v, "must be an integer >= 1")
        lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        check_key(lo <= hi, "prompt_lookup_min", lo, f"must be <= prompt_lookup_max ({hi})")


@PROPOSERS.register("ngram")
class NgramProposer(HostProposer):
    """Prompt lookup (vLLM's ngram method): find the longest n-gram, n in
    [prompt_lookup_min, prompt_lookup_max], that ends the sequence's tokens (prompt and
    outputs) and occurs earlier in them; propose the (up to) k tokens that followed its
    earliest occurrence."""

    aliases = ("[ngram]",)  # vLLM's other spelling
    options = NgramOptions

    @staticmethod
    def draft(spec: SpeculativeConfig, seq: Sequence, k: int) -> list[int]:
        lo, hi = spec.options.prompt_lookup_min, spec.options.prompt_lookup_max
        return ngram_lookup(seq.token_array(), lo, hi, k)


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
