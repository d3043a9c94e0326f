"""The offline front door, vLLM's `LLM`: generate, chat and beam search over prompts
given at once, stepping an LLMEngine (engine.py) on the caller's thread until every
request is done.

  from llm import LLM, SamplingParams
  outputs = LLM(model="tiny").generate(["Hello"], SamplingParams(max_tokens=16))
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Sequence as Seq

import numpy as np

from config import VLLM_SPELLINGS, EngineConfig
from engine import EngineRequest, LLMEngine, child_requests, decode_output
from metrics import EngineStats, RequestMetrics
from outputs import CompletionOutput, RequestOutput, TokenLogprob, stop_reason
from sampling_params import SamplingParams, is_int
from sequence import Sequence

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]

# One prompt of LLM.generate: a text, token ids, or vLLM's TextPrompt / TokensPrompt dict
Prompt = str | Seq[int] | dict


_deferring = 0  # calls of LLM.generate, chat or beam_search under way, in any thread (under the lock)
_deferring_lock = threading.Lock()
_saved_threshold = gc.get_threshold()


@contextlib.contextmanager
def _full_collections_deferred() -> Iterator[None]:
    """For one call, Python's collector makes no full collection (its young ones go on).
    A full collection walks every object the process holds, the model's, the tokenizer's
    and JAX's too, and a batch's own objects trigger one every few seconds: vLLM freezes
    its engine's start-up heap (freeze_gc_heap) against the same cost. The offline LLM
    runs in the caller's process, so it neither freezes (an LLM dropped later would keep
    its reference cycles for good, and a freeze of the caller's own would be undone) nor
    collects: it raises the oldest generation's threshold for the call and puts the
    caller's thresholds back after it. (On Python 3.14's incremental collector that
    threshold is ignored, and so is this.)"""
    global _deferring, _saved_threshold
    with _deferring_lock:
        if _deferring == 0:
            _saved_threshold = gc.get_threshold()
            gc.set_threshold(_saved_threshold[0], _saved_threshold[1], 1_000_000_000)
        _deferring += 1
    try:
        yield
    finally:
        with _deferring_lock:
            _deferring -= 1
            if _deferring == 0:
                gc.set_threshold(*_saved_threshold)


# vLLM's LLM keyword arguments (its EngineArgs) that have no EngineConfig field here: each is
# taken at the values that ask for what taxirank does anyway, and any other value is a
# ValueError naming it, so that a vLLM script's LLM(...) runs or says what it cannot have.
_VLLM_ONLY_KWARGS: dict[str, tuple[tuple[Any, ...], str]] = {
    # (no model code but taxirank's own ever runs, so the permission is never used)
    "trust_remote_code": ((False, True), ""),
    "enforce_eager": ((False,), "every step runs as a compiled JAX program (there are no CUDA graphs to skip); "
                                "warmup=False skips compiling them ahead"),
    "tokenizer_mode": (("auto", "hf"), "the tokenizer is always the model's Hugging Face tokenizer (or tokenizer=)"),
    "skip_tokenizer_init": ((False,), "a model without a tokenizer already takes token ids and gives empty texts"),
    "revision": ((None,), "models are local paths or built-in names; there is no hub revision to pick"),
    "tokenizer_revision": ((None,), "tokenizers are local paths; there is no hub revision to pick"),
    "code_revision": ((None,), "no remote code runs"),
    "download_dir": ((None,), "models are local paths or built-in names (TAXIRANK_CACHE moves the built-in's)"),
    "load_format": (("auto",), "the format is read from the model path (HF folder, GGUF, orbax checkpoint)"),
    "hf_token": ((None,), "nothing is downloaded from the Hugging Face hub"),
    "hf_overrides": ((None, {}), "the model's config is read as it is"),
    "cpu_offload_gb": ((0, 0.0), "weights are not offloaded to host memory"),
    "compilation_config": ((None, {}), "JAX's compilation has no such options here"),
    "disable_custom_all_reduce": ((False, True), ""),  # XLA's collectives are the only all-reduce
    "disable_log_stats": ((True,), "the offline LLM logs no stats; LLM.stats holds its counters"),
    "task": (("auto", "generate"), "taxirank runs text generation only"),
    "runner": (("auto", "generate"), "taxirank runs text generation only"),
    "allowed_local_media_path": (("",), "taxirank takes no multimodal inputs"),
    "mm_processor_kwargs": ((None,), "taxirank takes no multimodal inputs"),
    "enable_lora": ((False,), "taxirank has no LoRA"),
}


# vLLM's keyword names of EngineConfig fields named otherwise here (config.VLLM_SPELLINGS' long flags)
_VLLM_KWARG_NAMES: dict[str, str] = {flag[2:].replace("-", "_"): name for name, flags in VLLM_SPELLINGS.items()
                                     for flag in flags if flag.startswith("--")}


def _check_vllm_only_kwargs(kwargs: dict[str, Any]) -> None:
    """Pops the _VLLM_ONLY_KWARGS from kwargs, refusing a value taxirank cannot honour, and
    renames vLLM's spellings of EngineConfig fields (kv_cache_memory_bytes: kv_cache_memory)."""
    for vllm_name, name in _VLLM_KWARG_NAMES.items():
        if vllm_name in kwargs:
            if name in kwargs:
                raise TypeError(f"{vllm_name} and {name} are one setting: pass one of them")
            kwargs[name] = kwargs.pop(vllm_name)
    for name in [k for k in kwargs if k in _VLLM_ONLY_KWARGS]:
        value = kwargs.pop(name)
        accepted, why = _VLLM_ONLY_KWARGS[name]
        # (== alone would take 0 for False and 1.0 for True: the type must match too)
        if not any(type(value) is type(a) and value == a for a in accepted):
            raise ValueError(f"{name}={value!r} is not supported: {why} (taken: "
                             f"{', '.join(map(repr, accepted))})")


# vLLM's prompt dict keys for inputs other than text and token ids (its TextPrompt's and
# TokensPrompt's multimodal fields, its EmbedsPrompt's embeddings)
_MULTIMODAL_PROMPT_KEYS = {"multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "prompt_embeds"}


def _check_no_lora(lora_request: Any) -> None:
    """vLLM's lora_request of generate, chat and beam_search: None is what every call here
    runs (the base model); an adapter is refused rather than left unapplied."""
    if lora_request is not None:
        raise ValueError(f"lora_request is not supported: taxirank has no LoRA (got {type(lora_request).__name__}); "
                         "pass None")


class LLM:
    """Offline generation, as vLLM's `LLM`: LLM(model="tiny", max_num_seqs=...).generate(...)."""

    def __init__(self, model: str = "tiny", log: Callable[[str], None] = print, record_trace: bool = False,
                 **kwargs):
        _check_vllm_only_kwargs(kwargs)
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs), log=log, record_trace=record_trace)
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def get_tokenizer(self) -> Any:
        """vLLM's: the tokenizer prompts are encoded and outputs decoded with (a transformers
        tokenizer); a ValueError for a model without one, as vLLM's with skip_tokenizer_init."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids, and read outputs' token_ids")
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the SamplingParams generate() and chat() use when given none, the model's
        generation config's sampling defaults (and --override-generation-config's) over
        vLLM's own."""
        return SamplingParams(**self.engine.sampling_defaults)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.engine.reset_prefix_cache(reset_running_requests)

    @_full_collections_deferred()
    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., Any] | None = None,
                 priority: Seq[int] | None = None, lora_request: Any = None) -> list[RequestOutput]:
        """vLLM's (its keyword names too): one RequestOutput per prompt, in order, each with its
        sampling_params.n samples.
        A prompt is a string, a list of token ids, or vLLM's dict form: {"prompt": text} or
        {"prompt_token_ids": ids} (and the "prompt" they came from, kept as the output's),
        either with a "cache_salt" (its prefix-cache blocks are shared only with prompts of
        the same salt).
        priority: one integer per prompt (vLLM's), read by a policy that uses priorities.
        lora_request: vLLM's, None only (taxirank has no LoRA)."""
        _check_no_lora(lora_request)
        read = self._read_prompts(prompts)
        return self._generate([ids for ids, _, _ in read], [text for _, text, _ in read], sampling_params, use_tqdm,
                              priority, cache_salts=[salt for _, _, salt in read])

    def _generate(self, encoded: list[list[int]], texts: list[str | None],
                  params: SamplingParams | Seq[SamplingParams] | None, use_tqdm: bool | None,
                  priority: Seq[int] | None, thinking: bool = True,
                  cache_salts: list[str | None] | None = None) -> list[RequestOutput]:
        params = params if params is not None else self.get_default_sampling_params()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(encoded)
        if len(plist) != len(encoded):
            raise ValueError(f"{len(plist)} SamplingParams for {len(encoded)} prompts")
        for p in plist:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"expected SamplingParams or a list of them, got {type(p).__name__}")
        if isinstance(priority, np.ndarray):  # as prompts of NumPy ids are taken
            priority = priority.tolist()
        if priority is not None and (isinstance(priority, (str, bytes)) or not isinstance(priority, Seq)):
            raise TypeError(f"priority must be a list of integers, one per prompt, got {type(priority).__name__}")
        # (a NumPy integer is its int, as in SamplingParams and the token ids)
        priorities = [int(p) if isinstance(p, np.integer) else p for p in priority] if priority is not None \
            else [0] * len(encoded)
        if len(priorities) != len(encoded):
            raise ValueError(f"{len(priorities)} priorities for {len(encoded)} prompts")
        # Every prompt is checked before any is added: a bad one leaves nothing queued. Its
        # samples differ in their seeds only, which no check reads, so one sample stands for
        # them all, checked before the n are made (a huge n fails on a bad prompt at once).
        request_ids = [f"offline-{self._counter + i}" for i in range(len(encoded))]
        # They arrive before their grammars compile: nothing runs until every one has, so, as in
        # vLLM (whose engine compiles them after the requests arrived), TTFT counts the compiles.
        arrival = time.monotonic()
        checked = []  # each with its grammar compiled once: the cache may not hold them all until they are added
        salts = cache_salts or [None] * len(encoded)
        for i, (rid, ids, p, prio, salt) in enumerate(zip(request_ids, encoded, plist, priorities, salts)):
            try:
                checked.append(self.engine.validate(EngineRequest(
                    rid, ids, p if p.n == 1 else dataclasses.replace(p, n=1), arrival_time=arrival, priority=prio,
                    thinking=thinking, cache_salt=salt)))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e
        self._counter += len(encoded)
        # (the samples of the params validate checked: a max_tokens of None is its prompt's room there)
        children = [child_requests(rid, request.params if p.n == 1 else dataclasses.replace(request.params, n=p.n))
                    for rid, p, request in zip(request_ids, plist, checked)]
        seqs: dict[str, Sequence] = {}
        parent: dict[str, int] = {}  # sample's request id -> its prompt's index
        unfinished = [len(samples) for samples in children]
        logprobs: dict[str, list[TokenLogprob]] = {}
        prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}
        bar = None
        if use_tqdm or (use_tqdm is None and len(encoded) >= 16):
            from tqdm import tqdm
            # vLLM's use_tqdm may be a tqdm-like factory (tqdm.notebook's, a quiet one): it makes the bar
            bar = (use_tqdm if callable(use_tqdm) else tqdm)(total=len(encoded), desc="generate", unit="req")
        try:
            for i, (request, samples) in enumerate(zip(checked, children)):
                for rid, p, par in samples:
                    seqs[rid] = self.engine.enqueue(dataclasses.replace(request, request_id=rid, params=p,
                                                                        parent=par))
                    parent[rid] = i
            while self.engine.has_unfinished():
                deltas = self.engine.step()
                for d in deltas:
                    if d.error is not None:  # offline there is no stream to end: abort the rest, raise
                        raise RuntimeError(f"request {d.request_id} failed: {d.error!r}") from d.error
                    if d.new_logprobs:
                        logprobs.setdefault(d.request_id, []).extend(d.new_logprobs)
                    if d.prompt_logprobs is not None:
                        prompt_logprobs[d.request_id] = d.prompt_logprobs
                    if d.finished and d.request_id in parent:
                        i = parent.pop(d.request_id)
                        unfinished[i] -= 1
                        if bar is not None and not unfinished[i]:
                            bar.update(1)
        except BaseException:
            # A failure or an interrupt (Ctrl-C), even while its requests are being added, ends
            # the call: every request it added is aborted, so their slots and KV blocks are free
            # and the next call does not run or wait on them.
            for samples in children:
                for rid, _, _ in samples:
                    self.engine.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        assert not parent, "every request must finish"
        return [self._output(rid, text, [seqs[c] for c, _, _ in samples], logprobs, prompt_logprobs)
                for rid, text, samples in zip(request_ids, texts, children)]

    @_full_collections_deferred()
    def chat(self, messages: Seq[dict] | Seq[Seq[dict]], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, chat_template_content_format: str = "auto",
             tools: list[dict] | None = None, lora_request: Any = None,
             mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"} dicts) or a list
        of them, each rendered by the model's chat template (or `chat_template`), then
        generated as generate() does; one RequestOutput per conversation.
        chat_template_content_format: "string", "openai" or "auto" (chat_format), as the
        server's --chat-template-content-format. tools: OpenAI's function definitions, for
        a template that renders them (as vLLM, no call is parsed out of the output).
        lora_request and mm_processor_kwargs: vLLM's, None only (no LoRA, no multimodal inputs)."""
        _check_no_lora(lora_request)
        if mm_processor_kwargs is not None:
            raise ValueError("mm_processor_kwargs is not supported: taxirank takes no multimodal inputs")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template: use generate() with token ids")
        import chat_format
        from protocol import ApiError, rendered_tools

        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be set: the first "
                             "opens a new assistant turn, the second continues the last message")
        if chat_template is not None and not isinstance(chat_template, str):
            raise TypeError(f"chat_template must be a string, got {type(chat_template).__name__}")
        chat_format.check_content_format(chat_template_content_format, self.tokenizer, "chat_template_content_format")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Seq):
            raise TypeError(f"messages must be a list of message dicts or a list of such lists, "
                            f"got {type(messages).__name__}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        # The server's checks and rendering (roles, contents, template variables), so the
        # offline API refuses what a chat request is refused for, with the same message.
        body = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                "chat_template_kwargs": chat_template_kwargs or {}}
        try:  # checked as a request's tools, and handed to the template as they are ([] too), as vLLM's
            tools = rendered_tools({"tools": tools}, as_given=True)
        except ApiError as e:
            raise ValueError(str(e)) from None
        texts = []
        for i, conversation in enumerate(conversations):
            try:
                if isinstance(conversation, tuple):  # a sequence of messages, as the list the server takes
                    conversation = list(conversation)
                texts.append(chat_format.render_chat(body | {"messages": conversation}, self.tokenizer, tools,
                                                     chat_template=chat_template,
                                                     content_format=chat_template_content_format))
            except ApiError as e:
                raise ValueError(f"conversation {i}: {e}") from None
        # The template already carries BOS and the other special tokens it wants.
        encoded = [self.tokenizer.encode(text, add_special_tokens=False) for text in texts]
        # the qwen3 reasoning parser's, from the variables the template saw
        thinking = chat_format.thinking_enabled(body)
        return self._generate(encoded, texts, sampling_params, use_tqdm, None, thinking)

    @_full_collections_deferred()
    def beam_search(self, prompts: Prompt | Seq[Prompt], params: Any,
                    use_tqdm: bool | Callable[..., Any] = False, concurrency_limit: int | None = None,
                    lora_request: Any = None) -> list[Any]:
        """vLLM's LLM.beam_search (beam_search.py): one BeamSearchOutput per prompt (prompts as
        generate() takes them), its params.beam_width best sequences, best first; each
        sequence's tokens start with the prompt's, and so does its text. Each step runs the
        live beams of every prompt as one batch of one-token requests. A sequence that ended
        on EOS keeps it only with include_stop_str_in_output, as the API's beam search does
        (vLLM's offline one keeps it whatever the flag says). concurrency_limit: vLLM's, the
        most prompts searched at once (None: all); the others wait for them to end.
        lora_request: vLLM's, None only (taxirank has no LoRA)."""
        from beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams

        _check_no_lora(lora_request)
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if concurrency_limit is not None and (not is_int(concurrency_limit) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be None or an integer >= 1, got {concurrency_limit!r}")
        params.check_width(self.engine.config.logprobs_width(self.engine.model_config.vocab_size))
        read = self._read_prompts(prompts)
        step = params.step_params()
        for i, (ids, _, salt) in enumerate(read):  # every step's limits, checked before any runs
            try:
                self.engine.validate(EngineRequest(f"beam-check-{i}", ids, params.search_params(), cache_salt=salt))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e
        searches = [BeamSearch(ids, params, self.engine.model_config.eos_token_ids) for ids, _, _ in read]
        salts = [salt for _, _, salt in read]
        limit = concurrency_limit or max(1, len(searches))
        groups = [range(k, min(k + limit, len(searches))) for k in range(0, len(searches), limit)]
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = (use_tqdm if callable(use_tqdm) else tqdm)(total=params.max_tokens * len(groups), desc="beam search",
                                                             unit="token")
        for group in groups:
            while live := [i for i in group if not searches[i].done]:
                beams = [(i, b) for i in live for b in searches[i].beams]
                outs = self._generate([b.tokens for _, b in beams], [None] * len(beams), step, False, None,
                                      cache_salts=[salts[i] for i, _ in beams])
                for i in live:
                    searches[i].advance([o.outputs[0].logprobs[0] for (j, _), o in zip(beams, outs) if j == i])
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        results = []
        for search in searches:
            best = search.best()
            for seq in best:
                seq.text = self.tokenizer.decode(seq.tokens) if self.tokenizer is not None else ""
            results.append(BeamSearchOutput(best))
        return results

    def _read_prompts(self, prompts: Prompt | Seq[Prompt]) -> list[tuple[list[int], str | None, str | None]]:
        """generate()'s prompts, each as (token ids, text, cache_salt)."""
        # vLLM's: a string, a dict, or a list of token ids, is one prompt (not one prompt per
        # character or per id); any other iterable is read once (a generator read twice would
        # leave the outputs' texts empty)
        if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, (str, dict, Iterable)):
            raise TypeError(f"prompts must be a string, a list of token ids or a list of such prompts (or of "
                            f"prompt dicts), got {type(prompts).__name__}")
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if prompts and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompts):
            prompts = [prompts]
        return [self._read_prompt(prompt) for prompt in prompts]

    def _read_prompt(self, prompt: Prompt) -> tuple[list[int], str | None, str | None]:
        """A prompt's token ids, its text (when given as text) and its cache_salt."""
        if not isinstance(prompt, dict):
            return self._encode(prompt), prompt if isinstance(prompt, str) else None, None
        unsupported = sorted(set(prompt) & _MULTIMODAL_PROMPT_KEYS)
        if unsupported:
            raise ValueError(f"{', '.join(unsupported)} is not supported: taxirank takes text and token ids only (no "
                             "multimodal inputs, no prompt embeddings)")
        if set(prompt) - {"cache_salt"} not in ({"prompt"}, {"prompt_token_ids"}, {"prompt_token_ids", "prompt"}):
            raise ValueError(f"a prompt dict is vLLM's TextPrompt {{'prompt': text}} or TokensPrompt "
                             f"{{'prompt_token_ids': ids}} (with the text they came from as 'prompt', if any), "
                             f"either with a 'cache_salt'; got the keys {sorted(map(str, prompt))}")
        salt, text = prompt.get("cache_salt"), prompt.get("prompt")  # the salt: checked by LLMEngine.validate
        if not isinstance(text, str) and (text is not None or "prompt_token_ids" not in prompt):
            raise TypeError(f"'prompt' is a text; token ids go in 'prompt_token_ids', got {type(text).__name__}")
        if "prompt_token_ids" not in prompt:
            return self._encode(text), text, salt
        if isinstance(prompt["prompt_token_ids"], str):
            raise TypeError("'prompt_token_ids' is a list of token ids; a text goes in 'prompt'")
        return self._encode(prompt["prompt_token_ids"]), text, salt

    def _encode(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, (Seq, np.ndarray)):
            raise TypeError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)

    def _output(self, request_id: str, prompt: str | None, samples: list[Sequence],
                logprobs: dict[str, list[TokenLogprob]],
                prompt_logprobs: dict[str, list[TokenLogprob | None]]) -> RequestOutput:
        first, last = samples[0], max(samples, key=lambda s: s.finished_time)
        if first.params.detokenize:
            self._decode_logprobs(prompt_logprobs.get(first.request_id) or [])
        first_tokens = [s.first_token_time for s in samples if s.first_token_time is not None]
        return RequestOutput(
            request_id=request_id, prompt=prompt, prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=prompt_logprobs.get(first.request_id),
            outputs=[self._completion(i, s, logprobs.get(s.request_id)) for i, s in enumerate(samples)],
            finished=True, metrics=RequestMetrics.of(last), num_cached_tokens=first.num_cached_prompt_tokens,
            arrival_time=min(s.arrival_time for s in samples), first_token_time=min(first_tokens, default=None),
            finished_time=last.finished_time, num_preemptions=sum(s.num_preemptions for s in samples))

    def _decode_logprobs(self, lps: list[TokenLogprob | None]) -> None:
        """vLLM's decoded_token of each entry of each position, named as the server's logprobs
        name them (protocol.token_text: a token completing a character split over tokens is
        that character, after the tokens before it); nothing without a tokenizer."""
        if self.tokenizer is None:
            return
        from protocol import logprob_contexts, token_text

        for lp, context in zip(lps, logprob_contexts(lps)):
            if lp is not None:
                lp.decoded = {t: token_text(self.tokenizer, t, context=context) for t in lp}

    def _completion(self, index: int, seq: Sequence, logprobs: list[TokenLogprob] | None) -> CompletionOutput:
        text = ""  # vLLM's, where nothing detokenizes (a model without a tokenizer, detokenize=False)
        if seq.stop_matcher is not None and seq.stop_matcher.stop_reason is not None:
            text = seq.stop_matcher.text  # up to the stop string, as the server sends it
        elif self.tokenizer is not None and seq.params.detokenize:  # (stop strings need detokenize)
            text = decode_output(self.tokenizer, seq.output_token_ids, seq.params,
                                 self.engine.model_config.eos_token_ids, seq.prompt_token_ids)
        asked = seq.params.logprobs is not None
        if seq.params.detokenize:
            self._decode_logprobs(logprobs or [])
        return CompletionOutput(index, text, list(seq.output_token_ids),
                                sum(t.logprob for t in logprobs or ()) if asked else None, logprobs, seq.finish_reason,
                                stop_reason(seq, self.engine.model_config.eos_token_ids))
