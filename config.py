"""EngineConfig: every engine knob, in the one plain dataclass every layer shares.

It lives here, not in engine.py, so that the pure-Python layers (scheduler.py, the
block allocator) can take the config whole without importing JAX. A request's own
parameters are sampling_params.py's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import os
import types
import typing
from dataclasses import dataclass
from typing import Literal

import numpy as np

import attention_backend
import policy
from config_file import json_value
from policy import BATCHING, KV_ADMISSION, POLICIES
from quant_methods import QUANTIZATION_METHODS
from reasoning_parsers import REASONING_PARSERS
from sampling_params import sampling_defaults
from spec_decode import SpeculativeConfig

# Every EngineConfig field whose values are a registry's names (policy.Registry): __post_init__
# checks each against its registry, cli_args.py offers each registry's names as the flag's choices.
REGISTRIES: tuple[policy.Registry, ...] = (*policy.REGISTRIES, attention_backend.BACKENDS, QUANTIZATION_METHODS,
                                           REASONING_PARSERS)

# --kv-cache-dtype (vLLM's names; int8 as JetStream's) -> the dtype the cache stores, by name
# (kernels_pallas.kv_storage_dtype makes it a jnp dtype); None: the model dtype, unquantized.
# Every other one is 8 bits with an f32 scale per token and KV head; fp8 is e4m3, as vLLM's.
# That scheme is what vLLM names int8_per_token_head and fp8_per_token_head, so those names
# are taken too.
KV_CACHE_DTYPES: dict[str, str | None] = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                                          "fp8_e5m2": "float8_e5m2", "int8": "int8",
                                          "int8_per_token_head": "int8", "fp8_per_token_head": "float8_e4m3fn"}
KVCacheDtype = Literal[tuple(KV_CACHE_DTYPES)]  # the field's type: cli_args.py gives a Literal's values as choices
# vLLM V0's --preemption-mode: how a preempted sequence gives up its KV blocks (EngineConfig.swaps_kv)
PreemptionMode = Literal["recompute", "swap"]
PREEMPTION_MODES: tuple[str, ...] = typing.get_args(PreemptionMode)


@dataclass(frozen=True)
class LogprobsKind:
    """A --logprobs-mode, parsed once (LOGPROBS_MODES): what the sampling programs compute
    logprobs from, static in them (compilation.ProgramKey)."""

    raw: bool  # the model's logits (a grammar's mask applied), not the processed ones
    as_logits: bool  # the logits themselves, not their log_softmax


# vLLM's --logprobs-mode: what a sampled token's logprobs are computed from. raw: the
# model's logits (with a structured-output grammar's mask, which vLLM applies before its
# sampler), before the logits processors, penalties, temperature and top-k/top-p/min-p;
# processed: after all of them (what the token was drawn from; a filtered-out token is
# -inf). *_logits: those logits themselves instead of their log_softmax.
LOGPROBS_MODES: dict[str, LogprobsKind] = {
    "raw_logprobs": LogprobsKind(raw=True, as_logits=False), "raw_logits": LogprobsKind(raw=True, as_logits=True),
    "processed_logprobs": LogprobsKind(raw=False, as_logits=False),
    "processed_logits": LogprobsKind(raw=False, as_logits=True)}
LogprobsMode = Literal[tuple(LOGPROBS_MODES)]  # the field's type: cli_args.py gives a Literal's values as choices

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
    "quantization": ("-q",),
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
    # float32 | bfloat16 | auto (bfloat16 for a bfloat16 checkpoint, else float32: model_loader.resolve_dtype)
    dtype: str = "float32"
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
    preemption_mode: PreemptionMode = "recompute"
    swap_space: float = 4.0  # GiB of host memory for swapped-out KV blocks (vLLM's default)
    # Defaults of a request's SLO (ms) for a policy that reads SLOs (one that declares uses_slo).
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    attention_backend: str = attention_backend.AUTO  # or a backend registered in attention_backend.py
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
    # vLLM's --quantization (weight-only): a method of quant_methods.QUANTIZATION_METHODS; None: model dtype
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
    # vLLM's --stream-interval: tokens per streamed chunk, unless a request's stream_interval
    # is larger (a request's first token and its end go out at once)
    stream_interval: int = 1

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        _check_field_types(self)
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
                override = json_value(override, "override_generation_config")
            sampling_defaults(override, "override_generation_config")
            object.__setattr__(self, "override_generation_config", json.dumps(override, sort_keys=True))

        if self.dtype == "float":  # vLLM's shorthand for float32 (its ModelDType)
            object.__setattr__(self, "dtype", "float32")
        fp16 = "; float16 is not run here (it overflows where bfloat16 and float32 do not): use bfloat16"
        need(self.dtype in ("float32", "bfloat16", "auto"), f"dtype must be float32, bfloat16 or auto, got "
             f"{self.dtype!r}{fp16 if self.dtype in ('half', 'float16') else ''}")
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
        need(self.preemption_mode in PREEMPTION_MODES,
             f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got {self.preemption_mode!r}")
        need(isinstance(self.swap_space, (int, float)) and math.isfinite(self.swap_space) and self.swap_space >= 0,
             f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}")
        # vLLM's limit: a host pool over 70% of the host's memory leaves too little for the rest
        host_bytes = host_memory_bytes() if self.swaps_kv else 0
        need(not self.swaps_kv or self.swap_space * 2**30 <= 0.7 * host_bytes,
             f"swap_space {self.swap_space:g} GiB is too large: over 70% of the host's {host_bytes / 2**30:.1f} GiB "
             "of memory")
        need(not self.swaps_kv or KV_ADMISSION[self.kv_admission].preempts,
             f"--preemption-mode swap needs a KV admission that preempts; {self.kv_admission} reserves every "
             "block at admission and never preempts")
        need(not self.swaps_kv or (self.tensor_parallel_size == 1 and self.num_processes == 1),
             "--preemption-mode swap runs on one device: the host pool is not sharded")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            need(value is None or (isinstance(value, (int, float)) and math.isfinite(value) and value > 0),
                 f"{name} must be a number > 0, got {value!r}")
            need(value is None or POLICIES[self.scheduling_policy].uses_slo,
                 f"{name} is set, but the {self.scheduling_policy} scheduling policy does not read SLOs "
                 f"(--scheduling-policy {POLICIES.names_where(lambda p: p.uses_slo)})")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        need(self.logprobs_mode in LOGPROBS_MODES,
             f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        need(self.stream_interval >= 1, f"stream_interval must be at least 1, got {self.stream_interval}")
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

    # ---- what a named choice means: callers read these, not the names ----------------
    @property
    def kv_cache_quantized(self) -> bool:
        """The KV cache is stored in 8 bits with scales (kv_cache_dtype), not in the model dtype."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] is not None

    @property
    def logprobs_kind(self) -> LogprobsKind:
        """What logprobs are computed from (logprobs_mode)."""
        return LOGPROBS_MODES[self.logprobs_mode]

    @property
    def swaps_kv(self) -> bool:
        """A preempted sequence's KV blocks go to the host pool (swap_space GiB) and back,
        rather than being dropped and computed again (preemption_mode)."""
        return self.preemption_mode == "swap"

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
