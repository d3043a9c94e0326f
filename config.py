"""EngineConfig and SamplingParams: the two plain dataclasses every layer shares.

They live here, not in engine.py, so that the pure-Python layers (scheduler.py, the
block allocator) can take the config whole without importing JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import json as _json
import math
import numbers
import os
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

import attention_backend
from policy import BATCHING, KV_ADMISSION, POLICIES, REGISTRIES
from reasoning_parsers import REASONING_PARSERS
from spec_decode import SpeculativeConfig

# --kv-cache-dtype values (vLLM's; int8 as JetStream's); kernels_pallas.KV_CACHE_DTYPES maps them to dtypes
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"]
KV_CACHE_DTYPES: tuple[str, ...] = typing.get_args(KVCacheDtype)
# vLLM's --logprobs-mode: what a sampled token's logprobs are computed from. raw: the
# model's logits (with a structured-output grammar's mask, which vLLM applies before its
# sampler), before the logits processors, penalties, temperature and top-k/top-p/min-p;
# processed: after all of them (what the token was drawn from; a filtered-out token is
# -inf). *_logits: those logits themselves instead of their log_softmax.
LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
LOGPROBS_MODES: tuple[str, ...] = typing.get_args(LogprobsMode)
# A constraint's text (schema JSON, regex, grammar, choices together): larger is refused
# where it enters, so that compiling it stays within llguidance's limits (structured.py).
MAX_STRUCTURED_CHARS = 64 * 1024
MAX_CHOICES = 256
_MIN_TOKEN_BUCKET = 16
_MIN_DECODE_MIDPOINT = 16  # below it a decode program's rows cost less than its compile
MAX_BLOCK_SIZE = 256  # vLLM's largest --block-size
# vLLM's --distributed-executor-backend values. taxirank has one: "uni", the model run in
# this process, one JAX controller over every device of its mesh (more hosts join through
# jax.distributed, each process driving its own host's devices); the others are refused.
DISTRIBUTED_EXECUTOR_BACKENDS: tuple[str, ...] = ("mp", "ray", "uni", "external_launcher")
# The files of a Hugging Face tokenizer: a folder holding one of them has one (tokenizer.py).
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# vLLM's spellings of EngineConfig flags whose own name says it better here (a block count on
# any device, not a GPU's; bytes), and its short ones: cli_args.py's parser takes them beside
# ours, so a vLLM command line runs as it is
VLLM_SPELLINGS: dict[str, tuple[str, ...]] = {
    "tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",), "data_parallel_size": ("-dp",),
    "num_kv_blocks": ("--num-gpu-blocks-override",), "kv_cache_memory": ("--kv-cache-memory-bytes",)}


def flag_name(field: str) -> str:
    """An EngineConfig field's flag, every spelling, as argparse's errors write it
    (--num-kv-blocks/--num-gpu-blocks-override): the value does not say which was typed."""
    return "/".join(["--" + field.replace("_", "-"), *VLLM_SPELLINGS.get(field, ())])


@dataclass(frozen=True)
class EngineConfig:
    """Every engine knob, one field per CLI flag (vLLM's flag names where vLLM has it).

    Frozen and hashable so jitted code may take it as a static argument. Fields left as
    None are filled from the model by `resolved()` (max_model_len) or from the other
    fields (max_num_batched_tokens).
    """

    model: str = "smollm2"  # the built-in real model; "tiny" for tests
    # vLLM's --tokenizer: a folder holding a Hugging Face tokenizer (TOKENIZER_FILES), or a
    # .gguf file's, used instead of the model's own (encoding, decoding, chat template, EOS,
    # structured outputs' vocabulary); None or "" (vLLM's): the model's. Its ids must be the model's rows.
    tokenizer: str | None = None
    dtype: str = "float32"  # float32 | bfloat16 | auto (bfloat16 for a bfloat16 checkpoint, else float32: model.resolve_dtype)
    seed: int = 0
    max_num_seqs: int = 32
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True  # vLLM V1's default; --no-enable-chunked-prefill turns it off
    # vLLM's --long-prefill-token-threshold (chunked prefill): a prompt computes at most this
    # many tokens a step (its first chunk, its later ones, a preempted sequence's recompute),
    # so one long prompt does not take a whole step's budget from the others; a decode's 1 +
    # speculative tokens are capped alike (vLLM's rule for every running request); 0: no cap
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True  # reuse the KV blocks of a cached prompt prefix (vLLM V1's default)
    # The scheduling decisions: each a name in one of policy.py's registries (default: its first).
    scheduling: str = BATCHING.default  # how a step is composed, when a finished sequence's seat frees
    scheduling_policy: str = POLICIES.default  # vLLM's --scheduling-policy: admission order, KV victim
    kv_admission: str = KV_ADMISSION.default  # the KV blocks a sequence holds from admission
    # How a preempted sequence gives up its KV blocks (vLLM V0's names): recompute drops them
    # (its prompt and outputs are computed again on re-admission); swap copies them to a
    # host pool of swap_space GiB and back (recompute when the pool is full).
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    swap_space: float = 4.0  # GiB of host memory for swapped-out KV blocks (vLLM's default)
    # Defaults of a request's SLO (ms) for a policy that reads SLOs (--scheduling-policy slo).
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    attention_backend: str = "auto"  # or a backend registered in attention_backend.py
    # vLLM's --kv-cache-dtype: auto (the model dtype), or 8 bits with a scale per token and KV head
    kv_cache_dtype: KVCacheDtype = "auto"
    max_waiting_requests: int | None = None
    warmup: bool = True  # compile every shape bucket before serving
    # Schedule and prepare step N+1 while the device runs step N (vLLM's --async-scheduling).
    async_scheduling: bool = True  # --no-async-scheduling gives the synchronous loop (same tokens)
    # persistent XLA cache; None: $TAXIRANK_CACHE/jax (~/.cache/taxirank/jax); "" turns it off
    compilation_cache_dir: str | None = None
    # Beyond one device (parallel.py): a mesh of tensor_parallel_size devices, over
    # num_processes hosts when distributed_coordinator is set (jax.distributed).
    tensor_parallel_size: int = 1
    distributed_coordinator: str | None = None  # HOST:PORT of process 0's coordination service
    num_processes: int = 1
    process_id: int = 0
    # vLLM's --pipeline-parallel-size and --data-parallel-size: taken at 1 only (tensor
    # parallelism is the one split here; data parallelism is serve_ray.py's replicas)
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    # vLLM's --distributed-executor-backend (DISTRIBUTED_EXECUTOR_BACKENDS): uni or unset only
    distributed_executor_backend: str | None = None
    # vLLM's --quantization (weight-only, quant.py): int8 (per output channel, any checkpoint)
    # or gguf (a GGUF file's Q8_0 / Q4_0 / Q4_1 blocks served as stored); None: model dtype
    quantization: str | None = None
    # vLLM's --speculative-config: JSON text, a dict or a SpeculativeConfig (spec_decode.py)
    speculative_config: SpeculativeConfig | None = None
    # vLLM's --reasoning-parser (reasoning_parsers.py): the server splits a reasoning model's
    # thinking off its answer, and a structured-output constraint holds once thinking ends
    reasoning_parser: str | None = None
    # vLLM's --generation-config: the sampling defaults of a request that leaves them out:
    # "auto" (the model folder's generation_config.json, if any), "vllm" (none: OpenAI's
    # defaults), or a folder holding a generation_config.json
    generation_config: str = "auto"
    # vLLM's --override-generation-config: JSON over those defaults, e.g. {"temperature": 0.5}
    override_generation_config: str | dict | None = None
    # vLLM's --logprobs-mode (LogprobsMode above); prompt logprobs are raw logprobs in every mode, as vLLM's
    logprobs_mode: LogprobsMode = "raw_logprobs"
    # vLLM's --max-logprobs: the most logprobs or prompt_logprobs a request may ask (-1: the
    # vocabulary). It is also the width of the top-logprob arrays the sampling programs return.
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        _check_field_types(self)
        need(self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS,
             f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}")
        if self.tokenizer == "":  # vLLM's: an empty --tokenizer is unset (the model's own tokenizer)
            object.__setattr__(self, "tokenizer", None)
        if self.tokenizer is not None:
            check_tokenizer_path(self.tokenizer)
        need(self.generation_config in ("auto", "vllm") or os.path.isfile(
            os.path.join(self.generation_config, "generation_config.json")),
             f"generation_config must be auto, vllm or a folder holding a generation_config.json, got "
             f"{self.generation_config!r}")
        if self.override_generation_config is not None:
            override = self.override_generation_config
            if isinstance(override, str):
                try:
                    override = _json.loads(override)
                except RecursionError:  # nested past the decoder's stack
                    raise ValueError("override_generation_config is nested too deeply") from None
                except ValueError as e:
                    raise ValueError(f"override_generation_config is not valid JSON: {e}") from None
            sampling_defaults(override, "override_generation_config")
            object.__setattr__(self, "override_generation_config", _json.dumps(override, sort_keys=True))

        need(self.dtype in ("float32", "bfloat16", "auto"), f"dtype must be float32, bfloat16 or auto, got {self.dtype!r}")
        need(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        need(1 <= self.block_size <= MAX_BLOCK_SIZE and self.block_size & (self.block_size - 1) == 0,
             f"block_size must be a power of two up to {MAX_BLOCK_SIZE}, got {self.block_size}")
        need(self.max_model_len is None or self.max_model_len >= 1, f"max_model_len must be >= 1, got {self.max_model_len}")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 2,
             f"num_kv_blocks must be >= 2 (block 0 is the reserved null block), got {self.num_kv_blocks}")
        need(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory must be > 0 bytes")
        need(0.0 < self.gpu_memory_utilization <= 1.0, f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for registry in REGISTRIES:
            registry.check(getattr(self, registry.field))
        attention_backend.check_name(self.attention_backend)
        need(self.preemption_mode in ("recompute", "swap"),
             f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        need(isinstance(self.swap_space, (int, float)) and math.isfinite(self.swap_space) and self.swap_space >= 0,
             f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}")
        # vLLM's limit: a host pool over 70% of the host's memory leaves too little for the rest
        host_bytes = host_memory_bytes() if self.preemption_mode == "swap" else 0
        need(self.preemption_mode == "recompute" or self.swap_space * 2**30 <= 0.7 * host_bytes,
             f"swap_space {self.swap_space:g} GiB is too large: over 70% of the host's {host_bytes / 2**30:.1f} GiB "
             "of memory")
        need(self.preemption_mode == "recompute" or KV_ADMISSION[self.kv_admission].preempts,
             f"--preemption-mode swap needs a KV admission that preempts; {self.kv_admission} reserves every "
             "block at admission and never preempts")
        need(self.preemption_mode == "recompute" or (self.tensor_parallel_size == 1 and self.num_processes == 1),
             "--preemption-mode swap runs on one device: the host pool is not sharded")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            need(value is None or (isinstance(value, (int, float)) and math.isfinite(value) and value > 0),
                 f"{name} must be a number > 0, got {value!r}")
            need(value is None or POLICIES[self.scheduling_policy].uses_slo,
                 f"{name} is set, but the {self.scheduling_policy} scheduling policy does not read SLOs "
                 "(--scheduling-policy slo)")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        need(self.logprobs_mode in LOGPROBS_MODES,
             f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        need(self.max_logprobs >= -1, f"max_logprobs must be >= 0, or -1 (the vocabulary), got {self.max_logprobs}")
        need(self.max_waiting_requests is None or self.max_waiting_requests >= 1, "max_waiting_requests must be >= 1")
        need(self.tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        need(self.num_processes >= 1, f"num_processes must be >= 1, got {self.num_processes}")
        need(self.pipeline_parallel_size == 1,
             f"pipeline_parallel_size {self.pipeline_parallel_size}: taxirank does not support pipeline "
             "parallelism (only 1); shard the model over devices with --tensor-parallel-size instead")
        need(self.data_parallel_size == 1,
             f"data_parallel_size {self.data_parallel_size}: taxirank does not support data parallelism in one "
             "engine (only 1); run replicas instead: serve_ray.py --num-replicas N (or --min-replicas/--max-replicas)")
        backend = self.distributed_executor_backend
        need(backend in (None, "uni"),
             f"distributed_executor_backend must be one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)} (or unset), "
             f"got {backend!r}" if backend not in DISTRIBUTED_EXECUTOR_BACKENDS else
             f"distributed_executor_backend {backend}: taxirank supports only uni (the model runs in this "
             "process, one JAX controller over all its devices: --tensor-parallel-size); more hosts join with "
             "--distributed-coordinator/--num-processes/--process-id (jax.distributed); for Ray, serve_ray.py "
             "runs engine replicas")
        need((self.distributed_coordinator is None) == (self.num_processes == 1),
             "--distributed-coordinator HOST:PORT and --num-processes > 1 go together")
        # A multi-host mesh spans every process's devices (parallel.make_mesh): each process
        # owns at least one of them, so fewer than num_processes devices cannot be it.
        need(self.tensor_parallel_size >= self.num_processes,
             f"tensor_parallel_size ({self.tensor_parallel_size}) is smaller than num_processes "
             f"({self.num_processes}): a multi-host mesh spans every process's devices, at least one each "
             "(tensor_parallel_size = all the processes' devices together)")
        need(0 <= self.process_id < self.num_processes,
             f"process_id must be in [0, num_processes={self.num_processes}), got {self.process_id}")
        need(self.speculative_config is None or self.num_processes == 1,
             "--speculative-config runs on one host: the step channel does not carry proposals")
        if self.distributed_coordinator is not None:
            host, _, port = self.distributed_coordinator.rpartition(":")
            # ASCII digits only (str.isdigit() takes other scripts' digits too, which int() reads),
            # and few enough for int() (past 4,300 digits it raises, naming no flag)
            need(bool(host) and port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536,
                 f"distributed_coordinator must be HOST:PORT, got {self.distributed_coordinator!r}")
        need(self.quantization in (None, "int8", "gguf"),
             f"quantization must be int8 or gguf (or unset), got {self.quantization!r}")
        need(self.long_prefill_token_threshold >= 0,
             f"long_prefill_token_threshold must be >= 0 (0: no cap), got {self.long_prefill_token_threshold}")
        need(self.long_prefill_token_threshold == 0 or self.enable_chunked_prefill,
             f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) caps a prompt's chunk: it needs "
             "chunked prefill (without it a prompt is computed whole)")
        if self.max_num_batched_tokens is not None:
            need(self.max_num_batched_tokens >= self.max_num_seqs,
                 f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs}): "
                 "every running sequence needs one token of the budget per decode step")
            if not self.enable_chunked_prefill and self.max_model_len is not None:
                need(self.max_num_batched_tokens >= self.max_model_len,
                     f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                     f"({self.max_model_len}): without --enable-chunked-prefill a whole prompt must fit in one step; "
                     "raise max_num_batched_tokens, lower max_model_len, or enable chunked prefill")

    def resolved(self, model_max_len: int) -> "EngineConfig":
        """Fill the fields that depend on the model; validate against it."""
        max_model_len = self.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ValueError(f"max_model_len ({max_model_len}) is larger than the model allows ({model_max_len}: "
                             "its max_position_embeddings, or its sliding window, which taxirank does not implement)")
        mnbt = self.max_num_batched_tokens
        if mnbt is None:
            # Chunking: 512 tokens a step (vLLM V0's default; V1's 2048 and up is sized for
            # GPUs), which keeps a CPU step that carries a prefill chunk short for the
            # decodes beside it. Without chunking, vLLM's: a whole prompt of max_model_len fits.
            mnbt = max(512, self.max_num_seqs) if self.enable_chunked_prefill else max(max_model_len, 2048, self.max_num_seqs)
        return dataclasses.replace(self, max_model_len=max_model_len, max_num_batched_tokens=mnbt)

    # ---- derived (valid once resolved) -------------------------------------------
    def logprobs_width(self, vocab_size: int) -> int:
        """The top logprobs the sampling programs compute per position (a static shape):
        max_logprobs, at most the vocabulary (all of it for -1)."""
        return vocab_size if self.max_logprobs == -1 else min(self.max_logprobs, vocab_size)

    @property
    def max_blocks_per_seq(self) -> int:
        assert self.max_model_len is not None, "call resolved() first"
        return math.ceil(self.max_model_len / self.block_size)

    # The buckets are read by every step (runner, draft model): derived once per config
    # (frozen, so they never go stale).
    @functools.cached_property
    def decode_buckets(self) -> tuple[int, ...]:
        """Row counts a decode step is padded to: powers of two up to max_num_seqs, and from
        16 on the midpoints 1.5x between them (24, 48, 96, ...). A decode step computes the
        occupied slots, not all max_num_seqs of them. The midpoints cap a step's padding at
        1/3 where a batch drains (17 rows: 24, not 32): on the 50 x 16 + 50 x 512 mix at 32 sequences they
        cut the computed rows by 7% for one more program (bench/step_profile.py, docs/PERFORMANCE.md)."""
        out, b = [], 1
        while b < self.max_num_seqs:
            out.append(b)
            if b >= _MIN_DECODE_MIDPOINT and b * 3 // 2 < self.max_num_seqs:
                out.append(b * 3 // 2)
            b *= 2
        out.append(self.max_num_seqs)
        return tuple(out)

    @functools.cached_property
    def token_buckets(self) -> tuple[int, ...]:
        """Flattened token counts a prefill/mixed step is padded to: powers of two up to
        max_num_batched_tokens (which is always the last bucket)."""
        assert self.max_num_batched_tokens is not None, "call resolved() first"
        out, b = [], _MIN_TOKEN_BUCKET
        while b < self.max_num_batched_tokens:
            out.append(b)
            b *= 2
        out.append(self.max_num_batched_tokens)
        return tuple(out)


def check_tokenizer_path(path: str) -> None:
    """--tokenizer's value: a folder holding a Hugging Face tokenizer, or a .gguf file
    (whose metadata may describe one: that is read when it loads). ValueError naming the flag."""
    if os.path.isdir(path):
        if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
            raise ValueError(f"--tokenizer {path!r}: the folder holds no Hugging Face tokenizer (none of "
                             f"{', '.join(TOKENIZER_FILES)})")
    elif os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"--tokenizer {path!r} is a file, not a folder holding a Hugging Face tokenizer "
                             f"({', '.join(TOKENIZER_FILES)}) nor a .gguf file")
    else:
        raise ValueError(f"--tokenizer {path!r}: no such folder or file (taxirank reads a local folder or "
                         ".gguf file; a Hugging Face hub name is not downloaded)")


# A container's memory limit: cgroup v2's memory.max ("max": none), cgroup v1's
# memory.limit_in_bytes (a huge number: none). Each as the container sees its own cgroup.
CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory_bytes() -> int:
    """The memory this process may use: the host's physical RAM, or its container's
    cgroup limit where that is lower (a process past it is killed, whatever RAM is free)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in CGROUP_MEMORY_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) > 0:
            ram = min(ram, int(text))
    return ram


@functools.cache
def _field_kinds() -> dict[str, tuple[object, ...]]:
    """Each EngineConfig field's annotated types (a Literal stands for str: its values are
    checked by name in __post_init__)."""
    out = {}
    for name, hint in typing.get_type_hints(EngineConfig).items():
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        out[name] = tuple(str if typing.get_origin(a) is Literal else a for a in (typing.get_args(hint) if union else (hint,)))
    return out


def _is_kind(value: object, kind: object) -> bool:
    if kind is type(None):
        return value is None
    if kind is bool:  # numpy's too
        return isinstance(value, (bool, np.bool_))
    if kind is int:  # numpy integers too; True is not a count
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if kind is float:
        try:
            return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
        except OverflowError:  # an int past a float's range (LLM(swap_space=10**400)): no finite number either
            return False
    return isinstance(kind, type) and isinstance(value, kind)


def _check_field_types(config: EngineConfig) -> None:
    """Every field holds its annotated type: LLM(...) keyword arguments reach EngineConfig
    without argparse's conversions, and a 2.5 block size or a "no" flag must not run."""
    names = {int: "an integer", float: "a finite number", bool: "a boolean", str: "a string", type(None): "None"}
    for name, kinds in _field_kinds().items():
        value = getattr(config, name)
        if not any(_is_kind(value, k) for k in kinds):
            want = " or ".join(names.get(k, getattr(k, "__name__", str(k))) for k in kinds)  # type: ignore[call-overload]
            raise ValueError(f"{name} must be {want}, got {value!r}")
        # 64 bits, as a seed's PRNG key and the arrays a count sizes hold it: a larger count
        # fits no memory, and its byte total is past what a float (the sizing's GiB) can hold
        if isinstance(value, numbers.Integral) and not isinstance(value, bool) and not -2**63 <= value < 2**63:
            shown = value if abs(value) < 2**128 else f"an integer of {int(value).bit_length()} bits"
            raise ValueError(f"{name} must be a 64-bit integer, got {shown}")
        if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
            object.__setattr__(config, name, int(value))  # a numpy integer: plain int, as the CLI gives
        elif isinstance(value, np.bool_):
            object.__setattr__(config, name, bool(value))


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
    (Scheduler._block_hashes). Hashed once per request, so no cap but the body's."""
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
    canonical text, which is also the key of the compiled-grammar cache (structured.py)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None

    def __post_init__(self) -> None:
        set_ = [k for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                if getattr(self, k) is not None]
        if len(set_) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object or "
                             f"structural_tag, got {', '.join(set_) or 'none'}")
        if self.json_object is not None and self.json_object is not True:  # vLLM's check and message
            raise ValueError("structured_outputs.json_object must be True if set; omit structured_outputs to disable "
                             "structured outputs")
        if self.json is not None:
            schema = _json_value("json", self.json)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
            object.__setattr__(self, "json", _canonical("json", _object_schema("structured_outputs.json", schema)))
        if self.structural_tag is not None:
            tag = _json_value("structural_tag", self.structural_tag)
            _check_structural_tag(tag)
            tag = tag | {"structures": [s | {"schema": _object_schema(f"structured_outputs.structural_tag.structures[{i}]"
                                                                      ".schema", s["schema"])}
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
        if len(self.text) > MAX_STRUCTURED_CHARS:
            raise ValueError(f"the {self.kind} constraint is {len(self.text)} characters, over the limit of "
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


def _object_schema(where: str, schema: dict | bool) -> dict:
    """A JSON schema as an object: JSON Schema's `true` is `{}` (any value; llguidance takes
    objects only), and `false` (no value) is refused."""
    if schema is False:
        raise ValueError(f"{where} is false: no output satisfies it")
    return {} if schema is True else schema


def _canonical(key: str, value: Any) -> str:
    try:
        return _json.dumps(value, sort_keys=True, separators=(",", ":"))
    except RecursionError:
        raise ValueError(f"structured_outputs.{key} is nested too deeply") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"structured_outputs.{key} is not valid JSON: {e}") from None


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
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # 0 or -1: disabled (vLLM); above the vocabulary: clipped by the engine
    min_p: float = 0.0
    seed: int | None = None  # any integer; the engine maps it into the sampler's 32-bit seeds
    stop_token_ids: tuple[int, ...] | None = None
    stop: tuple[str, ...] = ()  # stop strings (a str or a list is taken too, as vLLM)
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
    bad_words: tuple[str, ...] = ()  # words whose last token is masked where the output ends in the rest
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, clamped to [-100, 100]
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from the logit of every output token
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 0: a prompt or output token's logit / it if > 0, else * it

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
            elif isinstance(value, dict):  # logit_bias: token id -> bias
                value = {plain(k): plain(v) for k, v in value.items()}
            object.__setattr__(self, f.name, plain(value))
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, tuple):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
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

        if not is_int(self.n):  # vLLM's messages
            raise ValueError(f"n must be an int, but is of type {type(self.n)}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_finite_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
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
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}"[:200])
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
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_finite_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not is_finite_number(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be a finite number greater than zero, "
                             f"got {self.repetition_penalty!r}")
        if self.allowed_token_ids is not None:
            if not all(is_int(t) for t in self.allowed_token_ids):
                raise ValueError(f"allowed_token_ids must be integers, got {self.allowed_token_ids!r}"[:200])
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids is not None and empty!")
        if not isinstance(self.bad_words, tuple) or not all(isinstance(w, str) for w in self.bad_words):
            raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}"[:200])
        if any(not w for w in self.bad_words):
            raise ValueError(f"bad_words cannot contain an empty string. Got bad_words={list(self.bad_words)}"[:200])
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


SAMPLING_EPS = 1e-5  # as vLLM: a temperature below this samples greedily
