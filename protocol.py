"""OpenAI's wire format, the server's half that needs no HTTP: a JSON body in (checked
field by field, into token ids, SamplingParams and stop strings), logprobs out, and
every refusal as an ApiError carrying vLLM's error JSON. A chat request's messages
reach the model through chat_format.py's render_chat.

No aiohttp and no JAX here, so the rules can be read (and tested) on their own.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from collections.abc import Iterator, Sequence
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from sampling_params import SamplingParams, SLOTarget, StructuredOutputsParams
from tool_parsers import ToolChoice

if TYPE_CHECKING:
    from outputs import TokenLogprob


# The error `type` of vLLM's create_error_response for a status (the OpenAI client's exception
# name); another status is named as vLLM's HTTPException handler names it, by its phrase.
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 422: "UnprocessableEntityError",
                500: "InternalServerError", 501: "NotImplementedError"}


def _status_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:  # a status http.HTTPStatus does not name
        return "Error"


class ApiError(Exception):
    """A request the server refuses: an HTTP status and vLLM's error JSON (its ErrorInfo:
    message, type, param, and the status as `code`)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param
        self.type = type or _ERROR_TYPES.get(status) or _status_phrase(status)

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.status}}


# ---- requests in ------------------------------------------------------------------

JSON_TYPE = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
              list: "an array", dict: "an object"}

# Options this server does not implement: set to anything but their neutral value they
# get a 400 naming them, never a silently different answer. () : any value is refused.
_NEUTRAL: dict[str, tuple] = {
    # OpenAI's
    "suffix": ("",), "best_of": (1,),
    "functions": ([],), "function_call": ("none", "auto"),  # the deprecated tools: no functions, so no call
    "modalities": (["text"],),  # text out only: no audio
    "audio": (),  # audio output
    "prediction": (),  # predicted outputs (a speculative-decoding hint, with its own usage counts)
    "web_search_options": (),  # a search tool run by the server
    "store": (False,),  # stored completions: nothing is stored here
    "service_tier": ("auto", "default"),  # one tier: every request is served alike
    "verbosity": ("medium",),  # OpenAI's default; other values ask for shorter or longer answers
    "prompt_cache_retention": ("in_memory",),  # the prefix cache lives in memory only
    "moderation": (),  # moderation of input and output
    # vLLM's own extras that taxirank does not implement
    "documents": ([],), "return_prompt_text": (False,), "logprob_token_ids": (), "thinking_token_budget": (),
    "repetition_detection": (), "watermarking": (False,), "vllm_xargs": (),
    "kv_transfer_params": (), "ec_transfer_params": (),  # disaggregated serving's KV and encoder-cache hand-offs
    "logits_processors": ([],),  # custom processors by qualified name (vLLM's --logits-processor-pattern)
}
# Completions' own: embeddings in place of the prompt's tokens (vLLM's --enable-prompt-embeds)
_COMPLETION_NEUTRAL: dict[str, tuple] = {"prompt_embeds": ()}

# OpenAI's fields this server takes and does nothing with, as they ask for nothing a
# client depends on (each is still type-checked): the reason beside each.
_ACCEPTED_NOOP: dict[str, tuple[type, ...]] = {
    "metadata": (dict,),  # tags for stored completions (none are stored)
    "prompt_cache_key": (str,),  # a cache-routing hint: the prefix cache finds shared prefixes itself
    "prompt_cache_options": (dict,),  # likewise
    "safety_identifier": (str,),  # an end-user id for abuse monitoring
    "session_id": (str,),  # vLLM's conversation id for routing related requests: one engine here
}

# Every field a request may carry and the server reads (_NEUTRAL's and _ACCEPTED_NOOP's
# too); anything else is warned about and ignored, as vLLM does with extra fields.
_COMMON_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stream", "stream_options", "stop",
    "stop_token_ids", "include_stop_str_in_output", "seed", "logprobs", "prompt_logprobs", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "add_special_tokens", "response_format", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "priority", "include_metrics", "user", "slo", "tools",
    "tool_choice", "request_id", "truncate_prompt_tokens", "truncation_side", "echo", "return_token_ids",
    "return_tokens_as_token_ids", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "min_tokens", "bad_words", "allowed_token_ids", "cache_salt", "use_beam_search", "length_penalty",
    "stream_interval", *_NEUTRAL,
    *_ACCEPTED_NOOP}
_CHAT_FIELDS = _COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt", "continue_final_message",
    "chat_template_kwargs", "parallel_tool_calls", "reasoning_effort", "include_reasoning", "chat_template"}
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", *_COMPLETION_NEUTRAL}
# Chat's own fields, which mean something else (or nothing) on /v1/completions: refused there.
_CHAT_ONLY = {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs"}
_CHAT_NAMES = {engine: chat for chat, engine in _CHAT_ONLY.items()}


def request_field(name: str | None, body: dict, chat: bool) -> str | None:
    """The request field that a SamplingParams field (named by its ValueError or the
    engine's ParamError) came in, for a 400's `param`: chat's top_logprobs for logprobs,
    and max_completion_tokens for max_tokens when sent (it wins); None if the body has none."""
    if chat and _CHAT_NAMES.get(name) in body:  # type: ignore[arg-type]
        name = _CHAT_NAMES[name]  # type: ignore[index]
    return name if name in body else None


INT64 = (-2**63, 2**63 - 1)


def _same(value: Any, neutral: Any) -> bool:
    """value is the neutral value in JSON's terms: a boolean equals only a boolean (Python's
    0 == False would let `store: 0` or `best_of: true` pass as neutral)."""
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


def unknown_fields(body: dict, chat: bool) -> list[str]:
    """The fields of `body` this server does not read (vLLM warns and ignores them)."""
    return sorted(set(body) - (_CHAT_FIELDS if chat else _COMPLETION_FIELDS))


MAX_BODY_BYTES = 4 * 1024 * 1024  # ~500k token ids as JSON; anything larger is a 413 (server.py, serve_ray.py)
MAX_N = 128  # samples of one request (each one engine request)
# A request's prompts (completions take a batch; vLLM's VLLM_MAX_COMPLETION_PROMPTS is 1024),
# and its engine requests, prompts times n (vLLM leaves that product uncapped)
MAX_SAMPLES = 1024
MAX_STOP_STRINGS = 4  # vLLM's VLLM_MAX_STOP_STRINGS default (OpenAI's documented limit too)
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_REQUEST_ID_CHARS = 256  # vLLM has no cap; one keeps ids, logs and the echoed header bounded
# vLLM's GPU model runner's limits on the ids of logit_bias and allowed_token_ids
MAX_LOGIT_BIAS_TOKENS = MAX_ALLOWED_TOKEN_IDS = 1024
MAX_BAD_WORDS = 256  # before tokenizing (the engine then takes vLLM's 128 token sequences): keeps that bounded
MAX_BAD_WORD_CHARS = 256
# vLLM's API cap on cache_salt and the characters it refuses in one (validate_cache_salt;
# its cache backends use them as key separators)
MAX_CACHE_SALT_CHARS, CACHE_SALT_FORBIDDEN = 128, frozenset("@/\\\x00")


def integer(value: Any) -> int | None:
    """value as a JSON integer, or None if it is not one. A number with no fractional part
    counts (`2.0` is 2), as vLLM's pydantic models take it; a boolean does not (JSON's true
    is no number, though Python's bool is an int)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():  # False for inf and nan
        return int(value)
    return None


def integers(values: list) -> list[int] | None:
    """values as a list of JSON integers (integer()), or None if any one is not."""
    ints = [integer(v) for v in values]
    return None if None in ints else ints  # type: ignore[return-value]


def id_list(body: dict, name: str, most: int) -> list[int] | None:
    """body[name] as a list of at most `most` token ids (integers; their range is the
    engine's check), None when unset, else a 400 naming it."""
    ids = field(body, name, (list,))
    if ids is not None and (ids := integers(ids)) is None:
        raise ApiError(f"'{name}' must be an array of integers", param=name)
    if ids is not None and len(ids) > most:
        raise ApiError(f"'{name}' takes at most {most} ids", param=name)
    return ids


def field(body: dict, name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    """body[name] when set (null counts as unset) and of one of `kinds`, else a 400 naming it.
    Where an integer is due, a number with no fractional part is taken as one (integer())."""
    value = body.get(name)
    if value is None:
        return default
    if int in kinds and float not in kinds and isinstance(value, float):
        if integer(value) is None:
            got = "a number with a fractional part" if math.isfinite(value) else "a number"
            raise ApiError(f"'{name}' must be an integer, got {got}", param=name)
        return integer(value)
    # JSON true is a bool, and bool is an int in Python: refuse it where a number is due.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        want = " or ".join(JSON_TYPE[k] for k in kinds)
        raise ApiError(f"'{name}' must be {want}, got {JSON_TYPE.get(type(value), type(value).__name__)}", param=name)
    if isinstance(value, float) or (float in kinds and isinstance(value, int)):
        try:
            finite = math.isfinite(value)
        except OverflowError:  # a JSON integer past a float's range, where a number is due
            finite = False
        if not finite:
            raise ApiError(f"'{name}' must be a finite number", param=name)
    return value


def client_request_id(body: dict, header: str | None) -> str | None:
    """vLLM's base of the response id (`cmpl-<id>`, `chatcmpl-<id>`): the X-Request-Id header,
    else the body's `request_id`; None when neither is set. Both are checked as they come:
    a string of 1 to MAX_REQUEST_ID_CHARS printable characters."""
    for value, name in ((field(body, "request_id", (str,)), "request_id"), (header, "X-Request-Id")):
        if value is not None and not (0 < len(value) <= MAX_REQUEST_ID_CHARS and value.isprintable()):
            raise ApiError(f"'{name}' must be 1 to {MAX_REQUEST_ID_CHARS} printable characters",
                           param="request_id" if name == "request_id" else None)
    return header if header is not None else body.get("request_id")


def cache_salt(body: dict) -> Any:
    """The body's cache_salt, refused as vLLM's API refuses one (validate_cache_salt): over
    MAX_CACHE_SALT_CHARS characters, or holding one of CACHE_SALT_FORBIDDEN. Whether it is a
    non-empty string is the engine's check (sampling_params.check_cache_salt, offline too)."""
    salt = body.get("cache_salt")
    if isinstance(salt, str) and (len(salt) > MAX_CACHE_SALT_CHARS or not CACHE_SALT_FORBIDDEN.isdisjoint(salt)):
        raise ApiError(f"Parameter 'cache_salt' must be at most {MAX_CACHE_SALT_CHARS} characters and must not "
                       "contain '@', '/', '\\\\', or NUL.", param="cache_salt")
    return salt


def prompt_batch(body: dict) -> list[str | list]:
    """The completions prompts as sent, one per batch entry (vLLM's prompt: a string, a list
    of token ids, or a batch of either); a 400 for anything else, or for no prompt."""
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError("'prompt' is required", param="prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and not any(isinstance(p, (str, list)) for p in prompt)):
        batch = [prompt]
    elif isinstance(prompt, list) and (all(isinstance(p, str) for p in prompt)
                                       or all(isinstance(p, list) for p in prompt)):
        batch = prompt
    else:
        raise ApiError("'prompt' must be a string, a list of token ids, or a non-empty list of either (one kind)",
                       param="prompt")
    if len(batch) > MAX_SAMPLES:
        raise ApiError(f"'prompt' takes at most {MAX_SAMPLES} prompts, got {len(batch)}", param="prompt")
    return batch


def parse_prompts(body: dict, tokenizer: Any, vocab_size: int) -> tuple[list[list[int]], list[str | list]]:
    """The completions prompts as token ids, a string's with the tokenizer's special tokens
    unless add_special_tokens is false (vLLM's CompletionRequest, default true); and the
    prompts as sent (prompt_batch), which echo returns."""
    batch = prompt_batch(body)
    special = field(body, "add_special_tokens", (bool,), True)
    return [_prompt_ids(p, tokenizer, vocab_size, "'prompt'" if len(batch) == 1 else f"prompt {i}", special)
            for i, p in enumerate(batch)], batch


def _prompt_ids(prompt: str | list, tokenizer: Any, vocab_size: int, name: str, special: bool = True) -> list[int]:
    """One prompt as token ids: a string, tokenized (special: with the tokenizer's special
    tokens), or token ids in the vocabulary."""
    if not prompt:
        raise ApiError(f"{name} is empty", param="prompt")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ApiError("this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
        return tokenizer.encode(prompt, add_special_tokens=special)
    ids = [integer(t) for t in prompt]
    for t, i in zip(prompt, ids):
        if i is None or not 0 <= i < vocab_size:
            raise ApiError(f"{name}: token id {t!r} is not in the vocabulary [0, {vocab_size})", param="prompt")
    return ids  # type: ignore[return-value]


def truncate_prompt(body: dict, prompt_ids: list[int], max_model_len: int, chat: bool) -> list[int]:
    """vLLM's truncate_prompt_tokens k, on the prompt's token ids (after the chat template):
    its last k tokens (truncation_side "left", the default) or its first k ("right"); -1 is
    as many as the context leaves beside the requested max_tokens. A k larger than that is
    vLLM's 400."""
    side = field(body, "truncation_side", (str,), "left")
    if side not in ("left", "right"):
        raise ApiError(f"'truncation_side' must be 'left' or 'right', got {side[:40]!r}", param="truncation_side")
    k = field(body, "truncate_prompt_tokens", (int,))
    if k is None:
        return prompt_ids
    if k == 0 or k < -1:
        raise ApiError(f"'truncate_prompt_tokens' must be at least 1, or -1 (the context length less max_tokens), "
                       f"got {k}", param="truncate_prompt_tokens")
    # vLLM's room for the prompt: the context less the max_tokens asked (none asked, or null:
    # chat's 0, completions' default 16); a bad max_tokens is parse_sampling's to refuse.
    limit = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_output = field(body, limit, (int,), 0 if chat else 16)
    max_input = max_model_len - max_output
    if k > max_input:
        raise ApiError(f"truncate_prompt_tokens={k} cannot be greater than max_model_len - {limit} = {max_input}. "
                       f"Please request a smaller truncation size. (parameter=truncate_prompt_tokens, value={k})",
                       param="truncate_prompt_tokens")  # vLLM's TokenizeParams words
    k = max_input if k == -1 else k
    if k < 1:  # max_tokens leaves no room: parse_sampling says so
        return prompt_ids
    return prompt_ids[-k:] if side == "left" else prompt_ids[:k]


def loads_checked(data: str | bytes, what: str, param: str | None = None) -> Any:
    """JSON from a client, checked as every tokenizer and encoder downstream needs it: a
    400 naming `what` for text that is not JSON, nesting past the parser's stack, or a
    string whose \\ud800-style escapes decode to a lone surrogate (no tokenizer encodes one)."""
    try:
        value = json.loads(data)
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(f"{what} has a string that is not valid Unicode (a lone surrogate): {e}", param=param) from e
    except ValueError as e:  # not JSON, or bytes that are not UTF-8
        raise ApiError(f"{what} is not valid JSON: {e}", param=param) from e
    except RecursionError as e:
        raise ApiError(f"{what} is nested too deeply", param=param) from e
    return value


def parse_sampling(body: dict, prompt_len: int, max_model_len: int, chat: bool,
                   tools: ToolChoice | None = None, defaults: dict[str, Any] | None = None) -> SamplingParams:
    """SamplingParams (stop strings included, and n: 1 for a beam search, whose n is its width)
    from the OpenAI fields; a 400 for anything off.
    tools: the ToolChoice of the request's tool_choice() (a forced call constrains the
    output); defaults: the engine's sampling_defaults (the model's generation config) for the
    fields left out."""
    defaults = defaults or {}
    for name, neutral in (_NEUTRAL if chat else _NEUTRAL | _COMPLETION_NEUTRAL).items():
        if body.get(name) is not None and not any(_same(body[name], v) for v in neutral):
            allowed = f" (accepted only as {' or '.join(json.dumps(v) for v in neutral)})" if neutral else ""
            raise ApiError(f"'{name}' is not supported by this server{allowed}", param=name)
    for name, kinds in _ACCEPTED_NOOP.items():
        field(body, name, kinds)
    if not chat:
        for name, instead in _CHAT_ONLY.items():
            if body.get(name) is not None:
                raise ApiError(f"'{name}' is a chat completions field; /v1/completions takes '{instead}'",
                               param=name)
    n = field(body, "n", (int,), 1)
    # vLLM's cap (VLLM_MAX_N_SEQUENCES) is 16384: a lower one keeps a request's samples within a queue's reach
    if not 1 <= n <= MAX_N:
        raise ApiError(f"'n' must be in [1, {MAX_N}], got {n}", param="n")
    max_tokens, limit = field(body, "max_tokens", (int,)), "max_tokens"  # limit: the field it came from
    if chat and field(body, "max_completion_tokens", (int,)) is not None:  # the newer name wins (as vLLM)
        max_tokens, limit = body["max_completion_tokens"], "max_completion_tokens"
    # vLLM's renderer (TokenizeParams) checks the lengths in its words, which clients parse
    # (the numbers after "You passed", "requested" and "is only") to fit the prompt or lower
    # max_tokens and retry; its VLLMValidationError's str ends "(parameter=..., value=...)".
    # The output it counts: the max_tokens asked, else completions' default 16, chat's 0.
    if max_tokens is not None and max_tokens > max_model_len:  # ("=max_total_tokens=": vLLM's f"{x=}" spelling)
        raise ApiError(f"{limit}={max_tokens} cannot be greater than max_model_len=max_total_tokens={max_model_len}. "
                       f"Please request fewer output tokens. (parameter={limit}, value={max_tokens})", param=limit)
    asked = max(0, max_tokens if max_tokens is not None else 0 if chat else 16)
    if prompt_len > max_model_len - asked:
        raise ApiError(f"You passed {prompt_len} input tokens and requested {asked} output tokens. However, the "
                       f"model's context length is only {max_model_len} tokens, resulting in a maximum input length "
                       f"of {max_model_len - asked} tokens. Please reduce the length of the input prompt. "
                       f"(parameter=input_tokens, value={prompt_len})",
                       param="input_tokens")
    if prompt_len >= max_model_len:  # (chat, no max_tokens) a prompt that leaves no room for one token
        raise ApiError(f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                       f"{prompt_len} input tokens. Please reduce the length of the input messages.",
                       param="input_tokens")
    # Chat: whatever room the context leaves; completions: 16, left out or null (vLLM's
    # normalize_null_max_tokens: a client's null must not run to the end of the context).
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len if chat else 16  # (the prompt leaves room: checked above)
    if max_tokens <= 0:
        raise ApiError(f"'{limit}' must be at least 1, got {max_tokens}", param=limit)
    # vLLM's get_max_tokens: the generation config's max_new_tokens caps an asked max_tokens too
    max_tokens = min(max_tokens, defaults.get("max_tokens", max_tokens))
    seed = field(body, "seed", (int,))  # vLLM's range: any 64-bit integer (the engine maps it to 32 bits)
    if seed is not None and not INT64[0] <= seed <= INT64[1]:
        raise ApiError(f"'seed' must be a 64-bit integer, in [{INT64[0]}, {INT64[1]}]", param="seed")

    stop = field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise ApiError("'stop' must be a non-empty string or an array of them", param="stop")
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
        raise ApiError(f"'stop' takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} "
                       "characters each", param="stop")
    stop_token_ids = id_list(body, "stop_token_ids", MAX_STOP_TOKEN_IDS)

    bad_words = field(body, "bad_words", (list,), [])
    if not all(isinstance(w, str) for w in bad_words):
        raise ApiError("'bad_words' must be an array of strings", param="bad_words")
    if len(bad_words) > MAX_BAD_WORDS or any(len(w) > MAX_BAD_WORD_CHARS for w in bad_words):
        raise ApiError(f"'bad_words' takes at most {MAX_BAD_WORDS} words of at most {MAX_BAD_WORD_CHARS} characters "
                       "each", param="bad_words")
    allowed = id_list(body, "allowed_token_ids", MAX_ALLOWED_TOKEN_IDS)
    logit_bias = field(body, "logit_bias", (dict,))
    if logit_bias is not None and len(logit_bias) > MAX_LOGIT_BIAS_TOKENS:
        raise ApiError(f"'logit_bias' takes at most {MAX_LOGIT_BIAS_TOKENS} token ids", param="logit_bias")
    if logit_bias and not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in logit_bias.values()):
        raise ApiError("'logit_bias' must map token ids to numbers", param="logit_bias")

    if chat:  # chat: logprobs is a flag, top_logprobs how many alternatives
        logprobs = field(body, "top_logprobs", (int,), 0) if field(body, "logprobs", (bool,), False) else None
        if logprobs is None and field(body, "top_logprobs", (int,), 0) != 0:  # vLLM's 400, never ignored
            raise ApiError("when using 'top_logprobs', 'logprobs' must be set to true", param="top_logprobs")
    else:
        logprobs = field(body, "logprobs", (int,))
        if logprobs is not None and logprobs < 0:  # vLLM's: -1 (the vocabulary) is chat's and prompt_logprobs' only
            raise ApiError(f"'logprobs' must be a non-negative integer, got {logprobs}", param="logprobs")
    prompt_logprobs = field(body, "prompt_logprobs", (int,))  # vLLM's extra field
    if prompt_logprobs is not None and prompt_logprobs != 0 and field(body, "stream", (bool,), False):
        # vLLM's: a stream has no place for them (an echo's, asked by `logprobs`, go in its first chunk)
        raise ApiError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
    if field(body, "echo", (bool,), False) and prompt_logprobs is None:
        # vLLM's: the echoed prompt's tokens get logprobs as the completion's do; a chat echo's
        # are top_logprobs' whether or not logprobs is asked (0 when left out, none when null),
        # which fills the response's prompt_logprobs
        prompt_logprobs = field(body, "top_logprobs", (int,), None if "top_logprobs" in body else 0) if chat \
            else logprobs
    try:
        params = SamplingParams(
            # (a beam search's n is its width: it samples with params of its own, parse_beam_search's)
            n=1 if field(body, "use_beam_search", (bool,), False) else n,
            max_tokens=max_tokens,
            temperature=field(body, "temperature", (int, float), defaults.get("temperature", 1.0)),  # OpenAI's
            top_p=field(body, "top_p", (int, float), defaults.get("top_p", 1.0)),
            top_k=field(body, "top_k", (int,), defaults.get("top_k", -1)),  # 0, -1: off; above the vocabulary: clipped
            min_p=field(body, "min_p", (int, float), defaults.get("min_p", 0.0)),
            seed=seed,
            stop_token_ids=stop_token_ids,
            stop=tuple(stop),
            # vLLM's extra: the matched stop string (or stop token's text) stays in the text
            include_stop_str_in_output=field(body, "include_stop_str_in_output", (bool,), False),
            ignore_eos=field(body, "ignore_eos", (bool,), False),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            # the tool parser reads tags some tokenizers mark special: vLLM's hermes parser
            # (adjust_request) keeps them in the text of a request whose calls it parses
            skip_special_tokens=field(body, "skip_special_tokens", (bool,), True) and not (
                tools is not None and tools.mode == "auto"),
            spaces_between_special_tokens=field(body, "spaces_between_special_tokens", (bool,), True),
            structured_outputs=parse_structured(body, tools),
            min_tokens=field(body, "min_tokens", (int,), 0),  # vLLM's extras, from here on
            allowed_token_ids=allowed,
            bad_words=tuple(bad_words),
            logit_bias=logit_bias,  # OpenAI's: clamped to [-100, 100] (SamplingParams)
            presence_penalty=field(body, "presence_penalty", (int, float), 0.0),
            frequency_penalty=field(body, "frequency_penalty", (int, float), 0.0),
            repetition_penalty=field(body, "repetition_penalty", (int, float), defaults.get("repetition_penalty", 1.0)),
            stream_interval=field(body, "stream_interval", (int,)),  # read by a stream only, checked on any
        )
    except ValueError as e:  # SamplingParams names the field first: "top_p must be in (0, 1]..."
        name, message = str(e).split()[0].rstrip(":"), str(e)
        param = request_field(name, body, chat)
        if param is not None and param != name:  # chat's name for it (top_logprobs)
            message = message.replace(name, param, 1)
        raise ApiError(message, param=param) from e
    return params


# ---- structured outputs in ----------------------------------------------------------

# vLLM's older names for the fields of structured_outputs
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_STRUCTURED_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


def tool_choice(body: dict, chat: bool, auto: bool) -> tuple[ToolChoice | None, list[dict] | None]:
    """What a request's tools and tool_choice ask, or None for no tool call (no tools, or
    tool_choice "none"); and its tools, checked whatever the choice, as rendered_tools gives
    them (None: none). auto: the server parses calls out of free text (its
    --enable-auto-tool-choice with a --tool-call-parser); without, "auto" (the default
    with tools) is vLLM's 400."""
    tools = field(body, "tools", (list,), [])
    choice = body.get("tool_choice")
    if not chat and (tools or choice is not None):
        raise ApiError("'tools' and 'tool_choice' are only for /v1/chat/completions", param="tools")
    if chat and body.get("tools") == []:  # vLLM's and OpenAI's 400, not a request without tools
        raise ApiError("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                       "entirely.", param="tools")
    if not tools:
        if choice is None or choice == "none":
            return None, None
        raise ApiError("'tool_choice' needs 'tools'", param="tool_choice")
    # vLLM defaults only a left-out tool_choice to "auto"; an explicit null's output it parses
    # as "auto"'s where the server can, and leaves content where it cannot (no 400)
    unset = choice is None and "tool_choice" in body and not auto
    if (choice is None or choice == "auto") and not auto and not unset:
        raise ApiError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                       param="tool_choice")
    tools = rendered_tools(body)
    if choice == "none" or unset:  # no call; the tools (checked above) may still reach the template
        return None, tools
    # a name defined twice is vLLM's too: a named choice takes its last definition (vLLM's
    # name -> function dict), "required" admits a call of any (required_tools_schema)
    by_name = dict(function_schemas(tools))
    if choice is None or choice in ("auto", "required"):
        return ToolChoice(choice or "auto", by_name, tools), tools
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type", "function") == "function" and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise ApiError("'tool_choice' must be 'none', 'auto', 'required' or "
                       "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if name not in by_name:
        raise ApiError(f"tool_choice names function {name[:80]!r}, which is not in 'tools'", param="tool_choice")
    return ToolChoice("named", {name: by_name[name]}, tools), tools


def rendered_tools(body: dict, as_given: bool = False) -> list[dict] | None:
    """A request's `tools` checked, as the chat template gets them: vLLM's dump of its
    ChatCompletionToolsParam (tool.model_dump()), whose serializers keep their own fields
    only, in their order, description and parameters null where left out, strict and
    defer_loading only where set (a tool's defer_loading its function's too where that has
    none). That order and those nulls show in a template's `tools | tojson`. as_given:
    each tool as sent, "function" its type where left out (LLM.chat, whose dicts vLLM hands
    over as they are). None when the body has none; an empty list stays one: /tokenize and
    LLM.chat hand it to the template as vLLM does."""
    tools = field(body, "tools", (list,))
    if tools is None:
        return None
    for i, t in enumerate(tools):  # (a left-out type is "function", vLLM's default)
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", param="tools")
        if not isinstance(fn.get("description", ""), (str, type(None))):  # vLLM's: a string or null
            raise ApiError(f"tools[{i}].function.description must be a string", param="tools")
        if not isinstance(fn.get("parameters", {}), (dict, type(None))):
            raise ApiError(f"tools[{i}].function.parameters must be a JSON schema (an object)", param="tools")
        for where, key in ((fn, "strict"), (fn, "defer_loading"), (t, "defer_loading")):
            if not isinstance(where.get(key, False), (bool, type(None))):
                raise ApiError(f"tools[{i}]{'.function' if where is fn else ''}.{key} must be a boolean",
                               param="tools")
    if as_given:
        return [t if "type" in t else {"type": "function", **t} for t in tools]
    return [_tool_dump(t) for t in tools]


def _tool_dump(tool: dict) -> dict:
    """One checked tool as vLLM's ChatCompletionToolsParam.model_dump() writes it."""
    fn = tool["function"]
    function = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
    defer = fn.get("defer_loading") if fn.get("defer_loading") is not None else tool.get("defer_loading")
    function |= {k: v for k, v in (("strict", fn.get("strict")), ("defer_loading", defer)) if v is not None}
    return {"type": "function", "function": function} | (
        {} if tool.get("defer_loading") is None else {"defer_loading": tool["defer_loading"]})


def function_schemas(tools: list[dict]) -> list[tuple[str, dict]]:
    """(name, parameters' JSON schema) of each of rendered_tools' tools, in order. Parameters
    left out, null or {} (vLLM's "required" schema) are a function of no parameters, whose
    arguments are still an object."""
    return [(t["function"]["name"], t["function"].get("parameters") or {"type": "object", "properties": {}})
            for t in tools]


def required_tools_schema(tools: list[dict]) -> dict:
    """vLLM's schema for tool_choice "required" over rendered_tools' tools: a non-empty
    array of calls, each {"name": one of the tools, "parameters": that tool's parameters}.
    Each tool's `$defs` move to the top of it, where the tool's `#/$defs/...` references
    resolve now that its parameters sit deeper (vLLM's); a name two tools define
    differently is vLLM's 400."""
    defs: dict = {}
    calls = []
    for name, params in function_schemas(tools):
        if isinstance(params.get("$defs"), dict):
            params = dict(params)  # (a copy: the tools the template renders keep theirs)
            for key, schema in params.pop("$defs").items():
                if defs.setdefault(key, schema) != schema:
                    raise ApiError(f"Tool definition '{key[:80]}' has multiple schemas, which is not supported.",
                                   param="tools")
        calls.append({"properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                      "required": ["name", "parameters"]})
    return {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}} | (
        {"$defs": defs} if defs else {})


def parse_structured(body: dict, tools: ToolChoice | None) -> StructuredOutputsParams | None:
    """The one output constraint a request asks for, from whichever of OpenAI's
    response_format, vLLM's structured_outputs or guided_* fields, or a forced tool call
    (tools: the request's ToolChoice, from tool_choice()) carries it; a 400 for more than one, or
    for any malformed one. Whether the schema,
    regex or grammar itself is valid is llguidance's to say (the server compiles it next)."""
    found = _constraints(body, tools)
    if not found:
        return None
    if len(found) > 1:
        raise ApiError(f"only one output constraint per request, got {', '.join(n for n, _ in found)}",
                       param=found[1][0])
    name, kw = found[0]
    if not isinstance(kw.get("choice", []), list):
        raise ApiError(f"'{name}': choice must be an array of strings", param=name)
    return _structured(name, kw)


def _structured(name: str, kw: dict) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kw)
    except (ValueError, TypeError) as e:
        raise ApiError(f"'{name}': {e}", param=name) from e


def structured_field(body: dict, tools: ToolChoice | None) -> str | None:
    """The request field that parse_structured() took the one output constraint from (a 400
    from compiling it names that field), or None without one."""
    found = _constraints(body, tools)
    return found[0][0] if found else None


def _constraints(body: dict, tools: ToolChoice | None) -> list[tuple[str, dict]]:
    """(request field, StructuredOutputsParams keywords) for each output constraint the
    request carries; a 400 for a malformed response_format or structured_outputs."""
    found: list[tuple[str, dict]] = []
    fmt = field(body, "response_format", (dict,))
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            js = fmt.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)) \
                    or not isinstance(js.get("name"), str):  # vLLM's and OpenAI's: the name is required
                raise ApiError("response_format json_schema must be {'name': ..., 'schema': {...}, 'strict': ...}",
                               param="response_format")
            if js.get("strict") is not None and not isinstance(js["strict"], bool):
                raise ApiError("response_format.json_schema.strict must be a boolean", param="response_format")
            found.append(("response_format", {"json": js.get("schema", {})}))  # OpenAI: no schema, any JSON
        elif kind == "structural_tag":  # vLLM's: the whole object is the tag
            found.append(("response_format", {"structural_tag": fmt}))
        elif kind != "text":
            raise ApiError("response_format type must be 'text', 'json_object', 'json_schema' or 'structural_tag'",
                           param="response_format")
    so = field(body, "structured_outputs", (dict,))
    if so is not None:
        unknown = set(so) - {*_STRUCTURED_KEYS, *_STRUCTURED_OPTIONS}
        if unknown:
            raise ApiError(f"structured_outputs: unsupported key(s) {', '.join(sorted(unknown))[:200]}",
                           param="structured_outputs")
        kw = {k: so[k] for k in (*_STRUCTURED_KEYS, *_STRUCTURED_OPTIONS) if so.get(k) is not None}
        if not any(k in kw for k in _STRUCTURED_KEYS):  # options alone: vLLM's 400, whatever else is set
            _structured("structured_outputs", kw)
        found.append(("structured_outputs", kw))
    for name, key in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, {key: body[name]}))
    if tools is not None and tools.mode != "auto":  # ("auto": the model's free text, parsed after)
        found.append(("tool_choice", {"json": next(iter(tools.tools.values())) if tools.mode == "named"
                                      else required_tools_schema(tools.definitions)}))
    return found


def parse_slo(body: dict) -> SLOTarget | None:
    """The `slo` object, {"ttft_ms": number, "tpot_ms": number} (either may be left out), for
    the slo scheduling policy; a policy that does not read it refuses it (the engine says so)."""
    slo = field(body, "slo", (dict,))
    if slo is None:
        return None
    unknown = sorted(set(slo) - {"ttft_ms", "tpot_ms"})
    if unknown:
        raise ApiError(f"'slo' takes ttft_ms and tpot_ms, not {unknown[0][:40]!r}", param="slo")
    try:
        return SLOTarget(ttft_ms=field(slo, "ttft_ms", (int, float)), tpot_ms=field(slo, "tpot_ms", (int, float)))
    except ApiError as e:
        raise ApiError(f"slo.{e}".replace("slo.'", "'slo.", 1), param="slo") from e
    except ValueError as e:
        raise ApiError(str(e), param="slo") from e


# ---- logprobs out -----------------------------------------------------------------

def token_text(tokenizer: Any, token_id: int, as_id: bool = False, context: Sequence[int] = ()) -> str:
    """A token's text in logprobs, vLLM's (convert_ids_list_to_tokens, then its
    LogprobsProcessor's _verify_tokens): the token decoded alone, with the leading spaces a
    SentencePiece decode strips from it put back (a "▁Paris" piece is " Paris", not "Paris",
    so the tokens join into the text); a token that alone decodes to part of a character
    (ending in U+FFFD) is the character it completes after `context` (the tokens before it
    in its sequence, oldest first), or "" (the character is the completing token's). as_id
    (vLLM's return_tokens_as_token_ids), or no tokenizer: "token_id:N", which any JSON
    carries whatever the token's bytes."""
    if not tokenizer or as_id:
        return f"token_id:{token_id}"
    text = _alone(tokenizer, token_id)
    return _completed_character(tokenizer, token_id, context) if text.endswith("\ufffd") else text


def _alone(tokenizer: Any, token_id: int) -> str:
    """token_id decoded alone, the leading spaces a SentencePiece decode strips put back
    (not on part of a character). Remembered on the tokenizer, at most one entry a
    vocabulary token: a response's logprobs name the same tokens many times over."""
    cache = getattr(tokenizer, "_taxirank_alone", None)
    if cache is None:
        cache = tokenizer._taxirank_alone = {}
    text = cache.get(token_id)
    if text is None:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        marker = _space_marker(tokenizer)
        if marker is not None and not text.endswith("\ufffd"):
            piece = tokenizer.convert_ids_to_tokens(token_id) or ""
            missing = (len(piece) - len(piece.lstrip(marker))) - (len(text) - len(text.lstrip(" ")))
            text = " " * missing + text if missing > 0 else text
        cache[token_id] = text
    return text


def _completed_character(tokenizer: Any, token_id: int, context: Sequence[int]) -> str:
    """vLLM's _correct_decoded_token: the text token_id adds to the last 1..4 tokens of
    `context` (a UTF-8 character spans at most 4 bytes) once they decode to whole
    characters, those of its own character included (the partial tokens before it are "");
    "" when no such run ends on it. A run ends on a whole character only if it reaches back
    to the character's first byte, which a longer run does too: the longest is tried first,
    so a token that completes nothing (most top entries of a split character) costs one decode."""
    longest = list(context[-4:])
    if not longest or tokenizer.decode(longest + [token_id], skip_special_tokens=False).endswith("\ufffd"):
        return ""
    for n in range(1, len(longest) + 1):
        run = longest[-n:]
        whole = tokenizer.decode(run + [token_id], skip_special_tokens=False)
        if whole.endswith("\ufffd"):
            continue
        clean = n  # the run before its trailing partial tokens, whose text is not this token's
        while clean and _alone(tokenizer, run[clean - 1]).endswith("\ufffd"):
            clean -= 1
        before = tokenizer.decode(run[:clean], skip_special_tokens=False) if clean else ""
        return whole[len(os.path.commonprefix([before, whole])):]
    return ""


def logprob_contexts(lps: Sequence[TokenLogprob | int | None], before: Sequence[int] = ()) -> Iterator[list[int]]:
    """Each position's context for token_text: the last 4 tokens before it (vLLM's
    _get_sampled_context_ids), starting after `before`; an echoed prompt's first token,
    a bare id, counts too (a character split over the first two is the second's)."""
    context = list(before)[-4:]
    for lp in lps:
        yield context
        if lp is not None:
            context = (context + [lp if isinstance(lp, int) else lp.token_id])[-4:]


def _space_marker(tokenizer: Any) -> str | None:
    """The character a Metaspace pre-tokenizer (SentencePiece's: Llama 2, Mistral) writes
    for a space, whose leading run a decode strips; None for any other tokenizer (a
    byte-level BPE's pieces keep their spaces). vLLM's _get_leading_space_marker: read
    from the tokenizer's own JSON, once per tokenizer (kept on it)."""
    marker = getattr(tokenizer, "_taxirank_space_marker", False)
    if marker is not False:
        return marker
    try:
        pre = json.loads(tokenizer.backend_tokenizer.to_str()).get("pre_tokenizer") or {}
    except Exception:  # no backend tokenizer (the byte tokenizer), or one that does not serialize
        pre = {}
    found = [p for p in [pre, *(pre.get("pretokenizers") or [])] if p.get("type") == "Metaspace"]
    marker = found[0].get("replacement", "▁") if found else None
    tokenizer._taxirank_space_marker = marker
    return marker


def finite(logprob: float) -> float:
    """A logprob as JSON can carry it: a token the step's grammar ruled out is -inf, which
    JSON has no number for; -9999.0 is what OpenAI and vLLM send instead. So is a NaN: the
    processed logprobs of a row whose masks left no token (allowed_token_ids that min_tokens,
    bad_words or a grammar rule out) are all NaN, and `NaN` is no JSON either."""
    return logprob if logprob >= -9999.0 else -9999.0


def _with_sampled(lp: TokenLogprob) -> dict[int, float]:
    """The sampled token, then the top ones (vLLM's per-position dict: the sampled token
    first, once even when it is among the top)."""
    return {lp.token_id: lp.logprob} | {t: v for t, v in lp.top if t != lp.token_id}


def completion_logprobs(tokenizer: Any, lps: list[TokenLogprob | int], offset: int, top: int | None = None,
                        as_ids: bool = False, before: Sequence[int] = ()) -> dict:
    """OpenAI's legacy completions logprobs; `offset` is where this text starts. Each
    position's top_logprobs holds the sampled token besides the top `logprobs` (OpenAI's
    "logprobs + 1" entries when the sampled token is not among them), as vLLM; `top`: at
    most top + 1 entries (an echoed prompt position holds prompt_logprobs' top ones). A
    bare token id is a token without a logprob (an echoed prompt's first): null logprob
    and top_logprobs, as vLLM. as_ids: tokens as "token_id:N" (return_tokens_as_token_ids).
    before: the tokens sampled before lps (a stream's earlier chunks), token_text's context."""
    contexts = list(logprob_contexts(lps, before))
    tokens = [token_text(tokenizer, lp if isinstance(lp, int) else lp.token_id, as_ids, ctx)
              for lp, ctx in zip(lps, contexts)]
    keep = None if top is None else top + 1
    return {"tokens": tokens,
            "token_logprobs": [None if isinstance(lp, int) else finite(lp.logprob) for lp in lps],
            "top_logprobs": [None if isinstance(lp, int) else
                             {token_text(tokenizer, t, as_ids, ctx): finite(v) for t, v in
                              itertools.islice(_with_sampled(lp).items(), keep)} for lp, ctx in zip(lps, contexts)],
            "text_offset": list(itertools.accumulate((len(t) for t in tokens), initial=offset))[:-1]}


def prompt_logprobs_json(tokenizer: Any, lps: list[TokenLogprob | None]) -> list[dict | None]:
    """vLLM's prompt_logprobs in a response: per prompt token (the first None) a dict from
    token id (a string, as JSON keys are) to its logprob, rank and text: the prompt token
    and the top N."""
    def entry(token_id: int, logprob: float, rank: int, context: list[int]) -> tuple[str, dict]:
        return str(token_id), {"logprob": finite(logprob), "rank": rank,
                               "decoded_token": token_text(tokenizer, token_id, context=context)}
    return [None if lp is None else dict([entry(lp.token_id, lp.logprob, lp.rank, ctx),
                                          *(entry(t, v, r, ctx) for r, (t, v) in enumerate(lp.top, 1))])
            for lp, ctx in zip(lps, logprob_contexts(lps))]


def chat_logprobs(tokenizer: Any, lps: list[TokenLogprob], top: int, as_ids: bool = False,
                  before: Sequence[int] = ()) -> dict:
    """Chat's logprobs: per token its own and a top_logprobs list of `top` entries (the
    request's top_logprobs; -1: all there are), vLLM's: the first of the sampled token and
    then the top ones (the most likely `top` when the sampled token is among them, as it is
    in greedy decoding). `top`, not each TokenLogprob's list, sets the length: a beam
    search's lists hold each step's 2 x beam_width candidates. as_ids: tokens as
    "token_id:N"; a sampled token's bytes stay its text's, vLLM's (its decoded_token's), and
    a top entry's are its token's. before: as completion_logprobs'."""
    keep = None if top == -1 else top
    def entry(token_id: int, logprob: float, context: list[int], sampled: bool = False) -> dict:
        text = token_text(tokenizer, token_id, as_ids, context)
        raw = token_text(tokenizer, token_id, context=context) if sampled and as_ids else text
        return {"token": text, "logprob": finite(logprob), "bytes": list(raw.encode())}
    return {"content": [entry(lp.token_id, lp.logprob, ctx, sampled=True) | {
        "top_logprobs": [entry(t, v, ctx) for t, v in itertools.islice(_with_sampled(lp).items(), keep)]}
        for lp, ctx in zip(lps, logprob_contexts(lps, before))]}


def route_path(path: str, root_path: str) -> str:
    """The path a request is routed by (Starlette's get_route_path, which FastAPI's root_path
    goes through): under root_path, the rest of it ("" for root_path itself); any other
    path as it is. "/api/v1/models" with root_path "/api" is "/v1/models"; "/apix" is "/apix"."""
    if not root_path or not path.startswith(root_path):
        return path
    if path == root_path:
        return ""
    return path[len(root_path):] if path[len(root_path)] == "/" else path


# What a beam search reads of SamplingParams (beam_search.BeamSearchParams, the text's
# decoding), and stream_interval, which asks nothing of a search (its stream sends each
# sequence whole); any other field the body set is a 400, where vLLM would silently drop it.
BEAM_SEARCH_FIELDS = ("max_tokens", "temperature", "ignore_eos", "include_stop_str_in_output", "logprobs",
                      "skip_special_tokens", "spaces_between_special_tokens", "stream_interval")


def parse_beam_search(body: dict, params: SamplingParams, defaults: dict[str, Any], chat: bool,
                      tools: ToolChoice | None) -> dict | None:
    """vLLM's use_beam_search: BeamSearchParams' fields (n is the beam width), or None for an
    ordinary request. length_penalty is beam search's only. params: parse_sampling's answer
    to the same body; defaults: the engine's sampling_defaults it was built over; tools: a
    chat request's ToolChoice, from tool_choice() (a forced call is an output constraint)."""
    beam = field(body, "use_beam_search", (bool,), False)
    length_penalty = field(body, "length_penalty", (int, float), 1.0)
    if not beam:
        if length_penalty != 1:
            raise ApiError("'length_penalty' is for beam search (use_beam_search: true)", param="length_penalty")
        return None
    if not math.isfinite(length_penalty):
        raise ApiError(f"'length_penalty' must be a finite number, got {length_penalty}", param="length_penalty")
    for name in ("echo", "include_metrics"):  # (before the fields: echo sets prompt_logprobs)
        if field(body, name, (bool,), False):
            raise ApiError(f"'{name}' is not supported with use_beam_search", param=name)
    plain = SamplingParams(**{**defaults, **{f: getattr(params, f) for f in BEAM_SEARCH_FIELDS}})
    for f in dataclasses.fields(SamplingParams):
        if getattr(params, f.name) != getattr(plain, f.name):
            if f.name == "structured_outputs":  # response_format, or tools' forced call, may carry it
                name = structured_field(body, tools) or f.name
            else:
                name = request_field(f.name, body, chat) or f.name
            raise ApiError(f"'{name}' is not supported with use_beam_search", param=name)
    return dict(beam_width=field(body, "n", (int,), 1), max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                temperature=params.temperature, length_penalty=float(length_penalty),
                include_stop_str_in_output=params.include_stop_str_in_output, logprobs=params.logprobs)
