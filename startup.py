"""Start-up: from an EngineConfig to the parts LLMEngine runs. Load the model (onto a
mesh for tensor parallelism), size the KV cache, build the scheduler and the runner,
and compile every step program.

On an accelerator sized by --gpu-memory-utilization the KV cache gets what the weights
and the largest step's activations leave, so that step is measured first, on a runner
with a one-sequence cache; the runner then takes the real cache.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from typing import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import checkpoint
import distributed
from quant import weight_quant_for
import gguf_loader
from config import EngineConfig
from kvcache import describe, kv_cache_bytes_per_block, measure_activation_bytes, num_kv_blocks_for
from metrics import EngineStats
from model import device_bytes, param_bytes
from model_loader import LoadedModel, load_model, quantize_loaded, with_named_tokenizer
from parallel import make_mesh, max_bytes_per_device, shard_model
from runner import ModelRunner, check_host_buffers, logprobs_bytes
from scheduler import Scheduler
from spec_decode import Proposer, create_proposer


@dataclass
class EngineParts:
    config: EngineConfig  # resolved against the model
    loaded: LoadedModel
    scheduler: Scheduler
    runner: ModelRunner
    stats: EngineStats
    num_kv_blocks: int  # the null block included
    proposer: Proposer | None  # speculative decoding's (config.speculative_config)


def build_engine(config: EngineConfig, log: Callable[[str], None] = print) -> EngineParts:
    use_compilation_cache(config.compilation_cache_dir)
    distributed.initialize(config, log)  # multi-host: before JAX picks its devices
    if config.num_processes > 1:
        distributed.check_same_config(config)
    # Tensor parallelism: the weights go onto the mesh here, the cache in the runner.
    mesh = make_mesh(config.tensor_parallel_size) if config.tensor_parallel_size > 1 else None
    if checkpoint.is_checkpoint(config.model):  # orbax: restored straight onto the mesh
        loaded: LoadedModel = checkpoint.load(config.model, config.dtype, mesh)
        loaded = quantize_loaded(loaded, weight_quant_for(config.quantization, None))
        if config.tokenizer is not None:
            loaded = with_named_tokenizer(loaded, config.tokenizer, log)
    else:
        loaded = load_model(config.model, config.dtype, config.seed, log=log, quantization=config.quantization,
                            tokenizer=config.tokenizer)
    if mesh is not None:
        loaded = shard_model(loaded, mesh)
    config = config.resolved(loaded.config.max_model_len)
    # before KV sizing, whose reserve for the logprob arrays these flags size too: the error names the flag
    check_host_buffers(config, loaded.config, loaded.dtype)
    stats = EngineStats(max_model_len=config.max_model_len)
    # A draft model's weights and its cache (indexed by the same blocks) share the KV budget.
    proposer = create_proposer(config, loaded, stats) if config.speculative_config is not None else None
    draft_probs = proposer is not None and proposer.draft_probs
    runner, activation_bytes = None, 0
    if _needs_activation_profile(config):
        runner, activation_bytes = _profile_activations(config, loaded, stats, log, mesh, draft_probs)
    # Each device's share: KV sizing is per device, as the budget is.
    weight_bytes = param_bytes(loaded.model) if mesh is None else max_bytes_per_device(
        nnx.state(loaded.model, nnx.Param))
    num_blocks = num_kv_blocks_for(config, loaded.config, loaded.dtype,
                                   weight_bytes + (proposer.weight_bytes() if proposer else 0), activation_bytes,
                                   proposer.kv_bytes_per_block() if proposer else 0,
                                   sum(logprobs_bytes(config, loaded.config).values()))  # on every device, whole
    if config.num_processes > 1:  # every process's cache has process 0's shape
        num_blocks = distributed.StepChannel().share_int("num_kv_blocks", num_blocks)
    stats.num_kv_blocks = num_blocks - 1
    log(f"model: {loaded.name} ({loaded.config.architecture}, {param_bytes(loaded.model) / 2**20:.1f} MiB "
        f"of weights), dtype {np.dtype(loaded.dtype).name}, "
        f"max_model_len {config.max_model_len}, max_num_seqs {config.max_num_seqs}, "
        f"scheduling {config.scheduling} ({config.scheduling_policy}), "
        f"chunked prefill {'on' if config.enable_chunked_prefill else 'off'}, "
        f"prefix caching {'on' if config.enable_prefix_caching else 'off'}")
    if mesh is not None:
        log(f"tensor parallel: {mesh.size} devices, {weight_bytes / 2**20:.1f} MiB of weights per device, "
            f"{loaded.config.num_attention_heads // mesh.size} query and "
            f"{loaded.config.num_key_value_heads // mesh.size} KV head(s) per device")
    log(describe(config, loaded.config, num_blocks, loaded.dtype))
    num_swap_blocks = 0
    if config.swaps_kv:
        per_block = kv_cache_bytes_per_block(loaded.config, config.block_size, loaded.dtype, config.kv_cache_dtype)
        num_swap_blocks = int(config.swap_space * 2**30) // per_block
        log(f"swap preemption: a host pool of {num_swap_blocks} KV blocks ({config.swap_space:g} GiB)")
    stats.cache_config = cache_config_info(config, num_blocks, num_swap_blocks)
    scheduler = Scheduler(config, num_blocks, loaded.config.eos_token_ids, loaded.config.vocab_size, num_swap_blocks)
    if runner is None:
        runner = ModelRunner(config, loaded, num_blocks, stats, mesh, num_swap_blocks, draft_probs)
    else:  # the profiling runner: its small cache is gone, the real one takes its place
        runner.kv_caches = runner.allocate_kv_caches(num_blocks)
        runner.num_swap_blocks = num_swap_blocks
    if proposer is not None:
        proposer.allocate(num_blocks)
        spec = config.speculative_config
        stats.spec_decode_num_accepted_tokens_per_pos = [0] * spec.k
        log(f"speculative decoding: {spec.method}, {spec.k} tokens per step"
            + (f", off at {spec.disable_by_batch_size}+ running sequences" if spec.disable_by_batch_size else ""))
    # What the devices hold, a draft model's included: sizing counted it too.
    draft_weight_bytes, draft_kv_bytes = proposer.device_bytes() if proposer else (0, 0)
    stats.weight_bytes = device_bytes(nnx.state(loaded.model, nnx.Param)) + draft_weight_bytes
    stats.kv_cache_bytes = device_bytes(runner.kv_caches) + draft_kv_bytes
    log(f"memory (measured on the devices): weights {stats.weight_bytes / 2**20:.1f} MiB"
        f"{f' ({loaded.quant.describe()})' if loaded.quant else ''}, KV cache {stats.kv_cache_bytes / 2**20:.1f} MiB"
        + (f", the draft model's {draft_weight_bytes / 2**20:.1f} MiB and {draft_kv_bytes / 2**20:.1f} MiB of them"
           if draft_weight_bytes or draft_kv_bytes else ""))
    if config.warmup:
        runner.warmup(log)
        if proposer is not None:
            proposer.warmup(log)
    if config.num_processes > 1 and config.process_id == 0:
        # the other processes wait for steps until process 0 says it is done
        atexit.register(runner.stop_followers)
    return EngineParts(config, loaded, scheduler, runner, stats, num_blocks, proposer)


def cache_config_info(config: EngineConfig, num_blocks: int, num_swap_blocks: int) -> dict[str, str]:
    """vLLM's cache_config_info labels: its CacheConfig's fields that this engine has, str()
    as vLLM writes them. num_gpu_blocks counts the null block, as vLLM's; num_cpu_blocks is
    the swap pool (--preemption-mode swap), 0 without one."""
    return {"block_size": str(config.block_size), "cache_dtype": config.kv_cache_dtype,
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "gpu_memory_utilization": str(config.gpu_memory_utilization), "swap_space": str(config.swap_space),
            "num_gpu_blocks_override": str(config.num_kv_blocks),
            "kv_cache_memory_bytes": str(config.kv_cache_memory),
            "num_gpu_blocks": str(num_blocks), "num_cpu_blocks": str(num_swap_blocks)}


def use_compilation_cache(path: str | None) -> None:
    """Persist compiled step programs across restarts (warm-up then takes seconds, not
    minutes). None: under $TAXIRANK_CACHE (~/.cache/taxirank), beside the built-in models.
    Leaves a cache directory the process already chose (tests set one). A local path that
    cannot be a directory (it, or a folder above it, is a file) is a ValueError: JAX would
    warn once and cache nothing, and every start would compile every program."""
    if path is None:
        path = os.path.join(gguf_loader.cache_dir(), "jax")
    path = os.path.expanduser(path)
    if path and "://" not in path:  # JAX also takes remote paths (gs://...)
        there = os.path.abspath(path)
        while not os.path.exists(there):  # the nearest part that exists: JAX creates the rest
            there = os.path.dirname(there)
        if not os.path.isdir(there):
            raise ValueError(f"compilation cache directory {path!r} (--compilation-cache-dir, else "
                             f"$TAXIRANK_CACHE/jax): {there} is not a directory")
    if path and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        # JAX also puts XLA's GPU autotuning cache inside the directory, and that path is in
        # the compile options every entry's key hashes: a cache moved, copied or mounted at
        # another path would never be read. The executables alone are kept, keyed by what
        # they compute; JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES still chooses otherwise.
        if "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES" not in os.environ:
            jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    _drop_unreadable_cache_entries()


def _drop_unreadable_cache_entries() -> None:
    """Make an unreadable entry of the persistent compilation cache (one truncated by a
    process killed while writing it, or a full disk) a miss that replaces it. JAX warns,
    compiles the program again, and then skips writing it because an entry with its key
    exists: every later start would compile it again. The entry is removed as its read
    fails, so the compile that follows writes it anew. The hook is JAX's private API: a JAX
    without it keeps its own behaviour."""
    from jax._src import compilation_cache as cc

    read = getattr(cc, "get_executable_and_time", None)
    if read is None or getattr(read, "drops_unreadable", False):
        return

    def read_or_drop(cache_key: str, *args: object, **kw: object) -> object:
        try:
            return read(cache_key, *args, **kw)
        except Exception:
            folder = getattr(getattr(cc, "_cache", None), "path", None)
            if folder is not None:
                try:
                    (folder / f"{cache_key}-cache").unlink()
                except OSError:  # gone already (another process dropped it), or read-only
                    pass
            raise

    read_or_drop.drops_unreadable = True  # type: ignore[attr-defined]
    cc.get_executable_and_time = read_or_drop


def _needs_activation_profile(config: EngineConfig) -> bool:
    """KV blocks come from --gpu-memory-utilization (no --num-kv-blocks, no
    --kv-cache-memory, not CPU): the same test num_kv_blocks_for makes."""
    return (config.num_kv_blocks is None and config.kv_cache_memory is None
            and jax.devices()[0].platform != "cpu")


def _profile_activations(config: EngineConfig, loaded: LoadedModel, stats: EngineStats,
                         log: Callable[[str], None], mesh: Mesh | None,
                         draft_probs: bool = False) -> tuple[ModelRunner, int]:
    """The activation peak of the largest step, measured on the device.

    Builds the runner with a minimal KV cache (one max_model_len sequence plus the null
    block), runs the ragged program once at max_num_batched_tokens on idle inputs (as
    warmup does: every write lands in the null block) and reads the allocator's peak
    above what was in use before (weights + the small cache). Returns the runner, its
    small cache already freed, and the activation bytes (0 if the device keeps no
    counters). The arithmetic is unit-tested on CPU, where no counters exist; no GPU run has
    checked the measurement."""
    runner = ModelRunner(config, loaded, config.max_blocks_per_seq + 1, stats, mesh, 0, draft_probs)
    T = config.max_num_batched_tokens
    compiled = stats.num_compilations
    profile = measure_activation_bytes(lambda: runner.idle_step(tokens=T), jax.devices()[0].memory_stats)
    # Its forward was compiled for the small cache's shape and is never used again (its
    # sample program, which reads no cache, is served with): num_compilations counts the
    # programs the engine serves with.
    stats.num_compilations -= min(1, stats.num_compilations - compiled)
    runner.kv_caches = []  # free the small cache before the real one is allocated
    if profile is None:
        log("KV sizing: the device reports no memory counters; only the logprob arrays are reserved for activations")
        return runner, 0
    log(f"KV sizing: {profile.describe(T)}")
    return runner, profile.activation_bytes
