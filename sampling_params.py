"""SamplingParams and the rest of what one request asks beyond its prompt: its output
constraint (StructuredOutputsParams), its SLO, its cache salt, and ParamError for a value
the engine cannot run; vLLM keeps these in vllm/sampling_params.py.

No JAX here: the scheduler reads a request's SamplingParams and SLOTarget, and config.py
checks --override-generation-config with sampling_defaults.
"""

from __future__ import annotations

import copy
import dataclasses
import json as _json  # StructuredOutputsParams has a field named json
import logging
import math
import typing
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

log = logging.getLogger("taxirank.sampling_params")


# A constraint's text (schema JSON, regex, grammar, choices together): larger is refused
# where it enters, so that compiling it stays within llguidance's limits (structured.py).
MAX_STRUCTURED_CHARS = 64 * 1024
MAX_CHOICES = 256
# vLLM's VLLM_MAX_N_SEQUENCES default: the most samples SamplingParams takes (the server's
# protocol.MAX_N is lower); more would hold LLM.generate for hours instead of refusing
MAX_N_SEQUENCES = 16384


def is_int(x: object) -> bool:
    """A Python integer, and not a bool (True is no count), as a request's integer fields take."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_finite_number(x: object) -> bool:
    """An int or float that is a finite number: not nan or inf, nor an integer past a
    float's range (float() of a huge JSON integer overflows)."""
    try:
        return (is_int(x) or isinstance(x, float)) and math.isfinite(float(x))
    except OverflowError:
        return False


class ParamError(ValueError):
    """A request value the engine cannot run, naming the request field it came in (the
    server's 400 `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_cache_salt(salt: object) -> None:
    """vLLM's cache_salt (None: unsalted): a non-empty string, which keeps the request's
    prefix-cache blocks apart from those of requests without the same salt
    (Scheduler._block_hashes). Hashed once per request: no cap here (an API request's is
    protocol.cache_salt's, vLLM's)."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ParamError("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")


# What a generation_config.json may set of a request's sampling defaults, as vLLM reads it
# (Hugging Face's max_new_tokens is max_tokens).
GENERATION_DEFAULT_KEYS = ("repetition_penalty", "temperature", "top_p", "top_k", "min_p", "max_new_tokens")


def sampling_defaults(values: Any, where: str) -> dict[str, Any]:
    """values (GENERATION_DEFAULT_KEYS, from a file or a flag) as SamplingParams keyword
    arguments; a ValueError naming `where`, the key and its value for an unknown key, an
    integer past 64 bits, or a value SamplingParams refuses."""
    if not isinstance(values, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(values).__name__}")
    unknown = sorted(set(values) - set(GENERATION_DEFAULT_KEYS))
    if unknown:
        raise ValueError(f"{where}: {', '.join(map(str, unknown))[:200]} not among the sampling defaults it may set "
                         f"({', '.join(GENERATION_DEFAULT_KEYS)})")
    for key, value in values.items():
        # JSON integers have no bound: a top_k or max_new_tokens past 64 bits is a broken file, not
        # a setting (offline, such a max_new_tokens would fail every generate() that leaves it out)
        if key in ("top_k", "max_new_tokens") and isinstance(value, int) and not -2**63 <= value < 2**63:
            raise ValueError(f"{where}: {key} must be a 64-bit integer, got {value}"[:300])
    out = {"max_tokens" if k == "max_new_tokens" else k: v for k, v in values.items() if v is not None}
    try:
        SamplingParams(**out)
    except (ValueError, TypeError) as e:  # SamplingParams names its own field: max_tokens is the file's max_new_tokens
        raise ValueError(f"{where}: {str(e).replace('max_tokens', 'max_new_tokens', 1)}"[:300]) from None
    return out


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint, as vLLM's StructuredOutputsParams: exactly one of a JSON
    schema (a dict or its JSON text), any JSON object, a regex, a choice of strings, a
    Lark / GBNF grammar, or a structural tag (free text in which each trigger starts a
    structure: its begin, JSON that follows a schema, its end). Hashable: JSON is kept as
    canonical text, which is also the key of the compiled-grammar cache (structured.py).

    vLLM's options for the JSON kinds (json, json_object, a structural tag's schemas; the
    others ignore them, as vLLM does): disable_any_whitespace, no whitespace between JSON
    tokens (taxirank's default already); whitespace_pattern, a regex for the whitespace
    allowed there instead (unless disable_any_whitespace); disable_additional_properties,
    `additionalProperties: false` in every object schema that lists properties and says
    nothing of others."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        set_ = [k for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                if getattr(self, k) is not None]
        if len(set_) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object or "
                             f"structural_tag, got {', '.join(set_) or 'none'}")
        if self.json_object is not None and self.json_object is not True:  # vLLM's check and message
            raise ValueError("structured_outputs.json_object must be True if set; omit structured_outputs to disable "
                             "structured outputs")
        for k in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, k), bool):
                raise ValueError(f"structured_outputs.{k} must be a boolean")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError("structured_outputs.whitespace_pattern must be a string (a regex)")
        closed = _closed_objects if self.disable_additional_properties else lambda schema: schema
        if self.json is not None:
            schema = _json_value("json", self.json)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
            schema = _nested("json", closed, _object_schema("structured_outputs.json", schema))
            object.__setattr__(self, "json", _canonical("json", schema))
        if self.structural_tag is not None:
            tag = _json_value("structural_tag", self.structural_tag)
            _check_structural_tag(tag)
            tag = tag | {"structures": [s | {"schema": _nested("structural_tag", closed, _object_schema(
                f"structured_outputs.structural_tag.structures[{i}].schema", s["schema"]))}
                for i, s in enumerate(tag["structures"])]}  # (a copy: the caller's stays)
            object.__setattr__(self, "structural_tag", _canonical("structural_tag", tag))
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            # (a regex of spaces matches spaces; a grammar of them has no rules: vLLM's check)
            if v is not None and (not isinstance(v, str) or not (v.strip() if k == "grammar" else v)):
                raise ValueError(f"structured_outputs.{k} must be a non-empty string")
        if self.regex is not None and "\x00" in self.regex:  # vLLM's check and message
            raise ValueError("structured_outputs.regex must not contain a NUL character ('\\x00')")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not 0 < len(self.choice) <= MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice takes 1 to {MAX_CHOICES} strings")
        size = len(self.text) + len(self.whitespace_pattern or "")
        if size > MAX_STRUCTURED_CHARS:
            raise ValueError(f"the {self.kind} constraint is {size} characters, over the limit of "
                             f"{MAX_STRUCTURED_CHARS}")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                    if getattr(self, k))

    @property
    def text(self) -> str:
        if self.choice is not None:
            return "".join(self.choice)
        return self.json or self.regex or self.grammar or self.structural_tag or ""


def _json_value(key: str, value: str | dict) -> Any:
    """value (JSON text, or already a value) as a value; a ValueError naming the key."""
    try:
        return _json.loads(value) if isinstance(value, str) else value
    except RecursionError:  # nested past the JSON codec's stack
        raise ValueError(f"structured_outputs.{key} is nested too deeply") from None
    except ValueError as e:
        raise ValueError(f"structured_outputs.{key} is not valid JSON: {e}") from None


def _nested(key: str, f: Any, value: Any) -> Any:
    """f(value); a ValueError naming the key for a value nested past Python's stack."""
    try:
        return f(value)
    except RecursionError:
        raise ValueError(f"structured_outputs.{key} is nested too deeply") from None


# Where JSON Schema keeps subschemas: maps of them, and single ones or lists of them. Only
# these are walked, so a property named "properties", or a const value, is never read as a schema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "additionalItems",
               "unevaluatedItems", "not", "if", "then", "else", "items", "prefixItems", "allOf", "anyOf", "oneOf")


def _closed_objects(schema: Any) -> Any:
    """A copy of schema in which each object schema that lists properties (or patterns of
    them) and says nothing of others allows no others (vLLM's disable_additional_properties)."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: _closed_objects(s) for name, s in out[k].items()}
    for k in _SUBSCHEMAS:
        if isinstance(out.get(k), (dict, list)):
            out[k] = _closed_objects(out[k])
    if "additionalProperties" not in out and any(isinstance(out.get(k), dict) for k in _SCHEMA_MAPS[:2]):
        out["additionalProperties"] = False
    return out


def _object_schema(where: str, schema: dict | bool) -> dict:
    """A JSON schema as an object: JSON Schema's `true` is `{}` (any value; llguidance takes
    objects only), and `false` (no value) is refused."""
    if schema is False:
        raise ValueError(f"{where} is false: no output satisfies it")
    return {} if schema is True else schema


def _canonical(key: str, value: Any) -> str:
    try:
        text = _json.dumps(value, sort_keys=True, separators=(",", ":"))
    except RecursionError:
        raise ValueError(f"structured_outputs.{key} is nested too deeply") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"structured_outputs.{key} is not valid JSON: {e}") from None
    if "Infinity" in text or "NaN" in text:  # (cheap: most schemas have neither, even in a string)
        try:
            _json.loads(text, parse_constant=lambda constant: _not_finite(key, constant))
        except RecursionError:
            raise ValueError(f"structured_outputs.{key} is nested too deeply") from None
    return text


def _not_finite(key: str, constant: str) -> None:
    """Python's JSON reads a number past a float's range (1e400) as Infinity, and takes the
    NaN and Infinity literals, none of which JSON has (llguidance refuses them unnamed)."""
    raise ValueError(f"structured_outputs.{key} has a number out of range ({constant}): JSON numbers must be "
                     "finite, within a 64-bit float's range (about 1.8e308 either side of 0)")


def _check_structural_tag(tag: Any) -> None:
    """vLLM's structural tag (its "legacy" form, the one its llguidance backend reads):
    {"type": "structural_tag", "structures": [{"begin", "schema", "end"}, ...],
    "triggers": [...]}, each structure's begin starting with one of the triggers."""
    where = "structured_outputs.structural_tag"
    if not isinstance(tag, dict):
        raise ValueError(f"{where} must be an object with 'structures' and 'triggers'")
    if "format" in tag:
        raise ValueError(f"{where}: the 'format' form (xgrammar's) is not supported; give 'structures' and "
                         "'triggers'")
    unknown = set(tag) - {"type", "structures", "triggers"}
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(map(str, unknown)))[:200]}")
    if tag.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"{where}.type must be 'structural_tag'")
    triggers, structures = tag.get("triggers"), tag.get("structures")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError(f"{where}.triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError(f"{where}.structures must be a non-empty list")
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or set(s) - {"begin", "schema", "end"} or not isinstance(s.get("begin"), str) \
                or not isinstance(s.get("end"), str) or not isinstance(s.get("schema"), (dict, bool)):
            raise ValueError(f"{where}.structures[{i}] must be {{'begin': string, 'schema': a JSON schema, "
                             "'end': string}")
        if not any(s["begin"].startswith(t) for t in triggers):
            raise ValueError(f"{where}.structures[{i}].begin {s['begin'][:80]!r} starts with none of the triggers")


@dataclass(frozen=True)
class SLOTarget:
    """A request's service-level objective, read by the slo policy: its first token within
    ttft_ms of arrival, then on average one token per tpot_ms (None: no target)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v <= 0):
                raise ValueError(f"slo.{name} must be a number > 0, got {v!r}")

    @property
    def seconds(self) -> tuple[float | None, float | None]:
        """(ttft, tpot) in seconds, as a Sequence holds them."""
        return (None if self.ttft_ms is None else self.ttft_ms / 1e3,
                None if self.tpot_ms is None else self.tpot_ms / 1e3)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, as vLLM's SamplingParams, with vLLM's defaults (temperature
    1.0: random sampling unless asked otherwise). Stop strings are text: the engine
    detokenizes a request that has them as its tokens arrive (tokenizer.IncrementalDetokenizer)
    and ends it with "stop" on the token that completes one, the output text ending before
    it (after it with include_stop_str_in_output); skip_special_tokens and spaces_between_special_tokens say how token ids become text
    (server and LLM.generate)."""

    # vLLM's parallel sampling: samples of the prompt, each run as an engine request of its
    # own (LLM.generate and the server expand them; the engine itself takes n = 1 only)
    n: int = 1
    # None: as many as the context leaves beside the prompt (vLLM's), which LLMEngine.validate
    # resolves per prompt; every request the engine runs has a number
    max_tokens: int | None = 16
    temperature: float = 1.0  # 0: greedy; in (0, MIN_TEMPERATURE): raised to it (vLLM's)
    top_p: float = 1.0
    top_k: int = -1  # 0 or -1: disabled (vLLM); above the vocabulary: clipped by the engine
    min_p: float = 0.0
    seed: int | None = None  # any integer; the engine maps it into the sampler's 32-bit seeds
    stop_token_ids: tuple[int, ...] | None = None
    stop: tuple[str, ...] | None = ()  # stop strings (a str or a list is taken too, and None, as vLLM)
    # vLLM's: the matched stop string (and an ending stop token's text) stays in the output text
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per sampled position
    # number of top logprobs per prompt position (besides the prompt token's own); such a
    # request never takes a prefix-cache hit: its prompt's logits are all computed
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (structured.py)
    # vLLM's logits processors (logits_controls.py), applied in vLLM's order: allowed_token_ids,
    # bad_words, min_tokens, logit_bias, then repetition, frequency and presence penalties.
    min_tokens: int = 0  # EOS and stop_token_ids are masked (and stop strings unchecked) before it
    allowed_token_ids: tuple[int, ...] | None = None  # only these ids may be sampled
    bad_words: tuple[str, ...] | None = ()  # words whose last token is masked where the output ends in the rest
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, clamped to [-100, 100]
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from the logit of every output token
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 0: a prompt or output token's logit / it if > 0, else * it
    # vLLM's: tokens per streamed chunk (None, or one below the server's --stream-interval:
    # the server's), read by a server's stream only (LLM.generate's outputs are whole)
    stream_interval: int | None = None
    # vLLM's: False leaves the outputs' texts empty (their token ids only), skipping the
    # decode; stop strings need the text, so they are refused with it (vLLM's check)
    detokenize: bool = True
    # vLLM's: arbitrary arguments for custom sampling code, which no in-tree sampling reads
    # there either; kept on the params for the caller's own use
    extra_args: dict[str, Any] | None = None
    # vLLM's fields for what taxirank does not run, taken unset only (_UNSUPPORTED_FIELDS):
    # a thinking budget (-1: unlimited, vLLM's unset too), the logprobs of chosen token ids,
    # logprobs in vLLM's flat layout
    thinking_token_budget: int | None = None
    logprob_token_ids: tuple[int, ...] | None = None
    flat_logprobs: bool = False

    def __post_init__(self) -> None:
        # numpy scalars (a max_tokens drawn with numpy, a token id read from an array) become
        # the plain Python values every check below and the sampler's arrays expect
        def plain(x: object) -> object:
            return x.item() if isinstance(x, (np.integer, np.floating, np.bool_)) else x

        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, np.ndarray):
                value = value.tolist()
            elif isinstance(value, (list, tuple)):
                value = type(value)(plain(x) for x in value)
            elif isinstance(value, dict):  # logit_bias (token id -> bias), extra_args
                value = {plain(k): plain(v) for k, v in value.items()}
            object.__setattr__(self, f.name, plain(value))
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, tuple):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        for name in ("stop", "bad_words"):  # vLLM's None: none
            if getattr(self, name) is None:
                object.__setattr__(self, name, ())
        if isinstance(self.bad_words, list):
            object.__setattr__(self, "bad_words", tuple(self.bad_words))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        if is_int(self.seed) and self.seed == -1:  # vLLM's __post_init__: -1 is no seed (a stream of its own)
            object.__setattr__(self, "seed", None)
        for name in ("logprobs", "prompt_logprobs"):  # vLLM's __post_init__: True asks for 1 (False stays refused)
            if getattr(self, name) is True:
                object.__setattr__(self, name, 1)

        if not is_int(self.n):  # vLLM's messages
            raise ValueError(f"n must be an int, but is of type {type(self.n)}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.n > MAX_N_SEQUENCES:
            raise ValueError(f"n must be at most {MAX_N_SEQUENCES}, got {self.n}.")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_finite_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature > MAX_TEMPERATURE:  # vLLM's (and OpenAI's) range
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}.")
        if 0 < self.temperature < MIN_TEMPERATURE:  # vLLM's __post_init__, with its warning
            log.warning("temperature %s is less than %s, which may cause numerical errors nan or inf in tensors. "
                        "We have maxed it out to %s.", self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        if not is_finite_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or (self.top_k != -1 and self.top_k < 1):
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        if not is_finite_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not is_int(self.seed) or not -2**63 <= self.seed < 2**63):
            raise ValueError(f"seed must be a 64-bit integer, in [{-2**63}, {2**63 - 1}], got {self.seed!r}")
        if self.stop_token_ids is not None and (not isinstance(self.stop_token_ids, tuple)
                                                or not all(is_int(t) for t in self.stop_token_ids)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}"[:200])
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        # a truthy non-bool (ignore_eos="no") would silently switch the option on
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}"[:200])
        if self.stop and not self.detokenize:  # vLLM's check and message
            raise ValueError("stop strings are only supported when detokenize is True. Set detokenize=True to use stop.")
        if is_int(self.thinking_token_budget) and self.thinking_token_budget == -1:
            object.__setattr__(self, "thinking_token_budget", None)
        for name, (unset, why) in _UNSUPPORTED_FIELDS.items():
            value = getattr(self, name)
            if value is not unset and not (type(value) is type(unset) and value == unset):
                raise ValueError(f"{name} is not supported: {why} (got {value!r})"[:300])
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict, got {type(self.extra_args).__name__}")
        # -1: the whole vocabulary, as vLLM's (the most a request may ask is the engine's
        # --max-logprobs: LLMEngine.validate, which resolves -1)
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < -1):
            raise ValueError(f"logprobs must be non-negative or -1, got {self.logprobs!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs) or self.prompt_logprobs < -1):
            raise ValueError(f"prompt_logprobs must be non-negative or -1, got {self.prompt_logprobs!r}")
        # vLLM's checks and messages (its SamplingParams._verify_args)
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}")
        if self.stream_interval is not None and not is_int(self.stream_interval):
            raise ValueError(f"stream_interval must be an integer, got {self.stream_interval!r}")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_finite_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not is_finite_number(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be a finite number greater than zero, "
                             f"got {self.repetition_penalty!r}")
        if not isinstance(self.bad_words, tuple) or not all(isinstance(w, str) for w in self.bad_words):
            raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}"[:200])
        if any(not w for w in self.bad_words):
            raise ValueError(f"bad_words cannot contain an empty string. Got bad_words={list(self.bad_words)}"[:200])
        # vLLM's _verify_greedy_sampling, after the checks of its _verify_args above (a greedy
        # request with a bad top_p hears of its top_p): greedy samples would all be one
        if self.greedy and self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")
        if self.allowed_token_ids is not None:
            if not all(is_int(t) for t in self.allowed_token_ids):
                raise ValueError(f"allowed_token_ids must be integers, got {self.allowed_token_ids!r}"[:200])
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids is not None and empty!")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a mapping of token ids to numbers, got {self.logit_bias!r}"[:200])
            bias = {}
            for token, value in self.logit_bias.items():
                try:  # OpenAI's keys are strings of integers (JSON's keys are strings)
                    token_id = token if is_int(token) else int(token) if isinstance(token, str) else None
                except ValueError:
                    token_id = None
                if token_id is None:
                    raise ValueError(f"logit_bias: found token_id {token!r} that is not an integer or string "
                                     "representing an integer"[:200])
                if not is_finite_number(value):
                    raise ValueError(f"logit_bias: the bias of token_id {token_id} must be a number, got {value!r}"[:200])
                bias[token_id] = min(100.0, max(-100.0, float(value)))  # OpenAI's range, clamped as vLLM
            object.__setattr__(self, "logit_bias", bias or None)

    def clone(self) -> SamplingParams:
        """vLLM's: a deep copy (its extra_args and logit_bias too), which the caller may
        change (dataclasses.replace) without touching this one."""
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def masks_tokens(self) -> bool:
        """Whether a logits processor masks some tokens at some step (logits_controls.py)."""
        return bool(self.min_tokens or self.allowed_token_ids is not None or self.bad_words)

    @property
    def penalized(self) -> bool:
        """Whether the logits get a bias or penalties (logits_controls.py)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    def stop_token(self, token: int, eos_token_ids: typing.Container[int]) -> Literal["eos", "stop_token_id"] | None:
        """Whether an output `token` ends the request, and as what: EOS first (unless
        ignore_eos), then one of stop_token_ids (vLLM's order; its stop_reason is None for
        the one, the token for the other); None: it ends nothing."""
        if token in eos_token_ids and not self.ignore_eos:
            return "eos"
        if self.stop_token_ids and token in self.stop_token_ids:
            return "stop_token_id"
        return None


# SamplingParams' fields of vLLM's that taxirank takes at their defaults only: the default, and why
_UNSUPPORTED_FIELDS: dict[str, tuple[Any, str]] = {
    "thinking_token_budget": (None, "no thinking budget is enforced here"),
    "logprob_token_ids": (None, "logprobs are the sampled token's and the top ones (logprobs=N, or -1 for all)"),
    "flat_logprobs": (False, "logprobs come as TokenLogprob entries (each also vLLM's dict of Logprob)"),
}

SAMPLING_EPS = 1e-5  # as vLLM: a temperature below this samples greedily (SamplingParams' only 0)
# vLLM's _MAX_TEMP: SamplingParams raises a temperature in (0, this) to it, as vLLM, since
# dividing the logits by less can overflow them to inf (and a softmax of infinities is NaN)
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 2.0  # vLLM's _verify_args: above it a request is refused
