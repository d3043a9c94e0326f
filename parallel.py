"""Tensor parallelism over a jax.sharding mesh (one axis, "tp"), as the JAX engines do it.

Megatron-style, as each layer declares its weights' logical axes (model.py, `WEIGHTS`)
and param_spec maps them: q/k/v and gate/up are split by output features (whole heads per
device), o and down by input features, so each decoder layer needs exactly one all-reduce
after attention and one after the MLP; XLA inserts them for the sharded matmuls. The
embedding and the LM head are split by vocabulary (replicated when the vocabulary does
not divide), norms are replicated. The KV cache is split over KV heads, and the attention backend (the
jnp reference or a Pallas kernel, unchanged) runs per shard under shard_map, so each
device reads only its own heads' blocks.

KV heads that do not divide the mesh: when N is a multiple of the KV head count, each KV
head is replicated to N / num_kv_heads devices (the weights with a `kv_heads` axis are
copied along it, as tpu-inference and vLLM do), so every device holds one head; any other combination is
refused. The scheduler and the block allocator never see any of this: one block table
indexes every device's slice of the cache.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kernels_pallas import QuantizedKV

from attention_backend import AttentionBackend
from model import Decoder, ModelConfig, declared_weight
from model_loader import LoadedModel

AXIS = "tp"
# Logical axes (declared beside each weight in model.py) split over the mesh; every other
# axis (embed, head_dim, layers) is replicated. The vocabulary is split when it divides.
_SPLIT = frozenset({"heads", "kv_heads", "mlp"})


def make_mesh(tp: int) -> Mesh:
    """A one-axis mesh over the first `tp` devices (all processes' devices, multi-host)."""
    devices = jax.devices()
    if tp > len(devices):
        hint = (" (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts)"
                if devices[0].platform == "cpu" else "")
        raise ValueError(f"tensor_parallel_size {tp} needs {tp} devices, {len(devices)} "
                         f"{devices[0].platform} device(s) are visible{hint}")
    if jax.process_count() > 1 and tp != len(devices):
        raise ValueError(f"multi-host: tensor_parallel_size ({tp}) must span every process's devices "
                         f"({len(devices)} in all)")
    return Mesh(np.array(devices[:tp]), (AXIS,))


def kv_head_replicas(cfg: ModelConfig, tp: int) -> int:
    """How many devices hold each KV head: 1 when the KV heads split evenly over tp,
    tp / num_kv_heads when tp is a multiple of them. Raises ValueError otherwise."""
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    if hq % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the {hq} attention heads")
    if cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide intermediate_size {cfg.intermediate_size}")
    if hkv % tp == 0:
        return 1
    if tp % hkv == 0:
        return tp // hkv
    raise ValueError(f"tensor_parallel_size {tp} and the {hkv} KV heads: one must divide the other "
                     "(KV heads are split over devices, or each copied to tp / num_kv_heads devices)")


def param_spec(path: tuple[Any, ...], cfg: ModelConfig, tp: int) -> P:
    """Where one parameter is split: its declared logical axes mapped onto the mesh."""
    split = _SPLIT | ({"vocab"} if cfg.vocab_size % tp == 0 else set())
    return P(*(AXIS if a in split else None for a in declared_weight(path).axes))


def load_spec(path: tuple[Any, ...], cfg: ModelConfig, tp: int) -> P:
    """Where a parameter goes as it is read, before shard_model: KV heads that the mesh
    needs copied load whole on each device (shard_model copies and splits them)."""
    if kv_head_replicas(cfg, tp) > 1 and "kv_heads" in declared_weight(path).axes:
        return P()
    return param_spec(path, cfg, tp)


def _repeat_heads(x: jax.Array, axis: int, num_heads: int, r: int) -> jax.Array:
    """x's `axis` of heads * D -> heads * r * D, each head copied r times in place (head h
    becomes heads h*r .. h*r+r-1), so query head i still reads KV head i // group."""
    shape = x.shape
    x = x.reshape(*shape[:axis], num_heads, shape[axis] // num_heads, *shape[axis + 1:])
    return jnp.repeat(x, r, axis=axis).reshape(*shape[:axis], shape[axis] * r, *shape[axis + 1:])


def _put(x: Any, sharding: NamedSharding) -> jax.Array:
    """Place x with `sharding`. From host memory each device receives only its own slice
    (make_array_from_callback), which also works when the mesh spans processes."""
    if isinstance(x, jax.Array) and x.is_fully_addressable and not sharding.is_fully_addressable:
        x = np.asarray(x)  # a process-local copy (every process holds the same values)
    if isinstance(x, np.ndarray):
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])
    return jax.device_put(x, sharding)


def shard_model(loaded: LoadedModel, mesh: Mesh) -> LoadedModel:
    """The loaded model with every parameter placed on the mesh (KV heads replicated
    first when the mesh needs it); its config then counts the replicated KV heads, which
    is what the cache is sized and shaped by."""
    cfg, tp = loaded.config, mesh.size
    r = kv_head_replicas(cfg, tp)
    run_cfg = replace(cfg, num_key_value_heads=cfg.num_key_value_heads * r)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(run_cfg, loaded.dtype, loaded.quant, rngs=nnx.Rngs(0))))
    placed = []
    for path, var in nnx.to_flat_state(nnx.state(loaded.model, nnx.Param)):
        x, axes = var.get_value(), declared_weight(path).axes
        if r > 1 and "kv_heads" in axes:
            x = _repeat_heads(jnp.asarray(x), axes.index("kv_heads"), cfg.num_key_value_heads, r)
        spec = param_spec(path, run_cfg, tp)
        for dim, name in zip(x.shape, spec):
            # a quantized kernel's codes, scales and blocks go with their features: a split
            # that would cut a GGUF block of 32 input features is refused here
            if name == AXIS and dim % tp:
                raise ValueError(f"tensor_parallel_size {tp} cannot split {'.'.join(map(str, path))} "
                                 f"{tuple(x.shape)} evenly (quantized in blocks: {loaded.quant.describe()})"
                                 if loaded.quant else f"tensor_parallel_size {tp} cannot split "
                                 f"{'.'.join(map(str, path))} {tuple(x.shape)} evenly")
        placed.append((path, var.replace(_put(x, NamedSharding(mesh, spec)))))
    model = nnx.merge(graphdef, nnx.from_flat_state(placed))
    return replace(loaded, model=model, config=run_cfg)


def kv_cache_specs(caches: Any) -> Any:
    """PartitionSpecs for K or V caches (any pytree of them): [..., num_kv_heads, head_dim]
    split over KV heads; a quantized cache's scales [..., num_kv_heads] with their values."""
    def heads_at(ndim: int, axis: int) -> P:
        return P(*(AXIS if i == ndim + axis else None for i in range(ndim)))

    def one(c: Any) -> Any:
        if isinstance(c, QuantizedKV):
            return QuantizedKV(kv_cache_specs(c.values), heads_at(c.scales.ndim, -1))
        return heads_at(c.ndim, -2)
    return jax.tree.map(one, caches, is_leaf=lambda c: isinstance(c, QuantizedKV))


def create_sharded_kv_caches(create: Any, mesh: Mesh) -> Any:
    """Run `create()` (kvcache.create_kv_caches bound to its arguments) so that each
    device allocates only its slice: the whole cache never exists on one device."""
    specs = kv_cache_specs(jax.eval_shape(create))
    return jax.jit(create, out_shardings=jax.tree.map(lambda s: NamedSharding(mesh, s), specs))()


def constrain_step_outputs(kv_caches: Any, rest: tuple, mesh: Mesh) -> tuple:
    """Inside the step: the updated cache keeps the input's sharding (it is donated), and
    the rest (sampled tokens, last_tokens) is replicated, so any process can read it."""
    kv = jax.tree.map(lambda c, s: jax.lax.with_sharding_constraint(c, NamedSharding(mesh, s)), kv_caches,
                      kv_cache_specs(kv_caches))
    return kv, *jax.lax.with_sharding_constraint(rest, NamedSharding(mesh, P()))


def replicate(x: np.ndarray | jax.Array, mesh: Mesh) -> jax.Array:
    """An array (on the host, or on a device outside the mesh), whole on every device of the mesh."""
    return _put(x, NamedSharding(mesh, P()))


@functools.lru_cache(maxsize=16)  # one object per pair: engines on it share their step programs
def shard_attention(backend: AttentionBackend, mesh: Mesh) -> AttentionBackend:
    """The same backend, run per KV-head shard: q [T, Hq, D] split over query heads, the
    caches [N, BS, Hkv, D] over KV heads (group g = Hq / Hkv is the same on every shard),
    block tables and lengths replicated. No collective inside: heads are independent."""
    heads, rep = P(None, AXIS, None), P()

    def decode(q, k_cache, v_cache, block_tables, kv_lens, **kw):
        f = functools.partial(backend.decode, **kw)
        cache = kv_cache_specs(k_cache)
        return jax.shard_map(f, mesh=mesh, in_specs=(heads, cache, cache, rep, rep), out_specs=heads,
                             check_vma=False)(q, k_cache, v_cache, block_tables, kv_lens)

    def ragged(q, k_cache, v_cache, block_tables, cu_q_lens, kv_lens, **kw):
        f = functools.partial(backend.ragged, **kw)
        cache = kv_cache_specs(k_cache)
        return jax.shard_map(f, mesh=mesh, in_specs=(heads, cache, cache, rep, rep, rep), out_specs=heads,
                             check_vma=False)(q, k_cache, v_cache, block_tables, cu_q_lens, kv_lens)

    return AttentionBackend(f"{backend.name} (tp={mesh.size}, shard_map)", decode, ragged)


def bytes_per_device(tree: Any) -> dict[Any, int]:
    """Bytes each device holds of the arrays in `tree`, from their shardings."""
    out: dict[Any, int] = {}
    for x in jax.tree.leaves(tree):
        shard = math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for d in x.sharding.device_set:
            out[d] = out.get(d, 0) + shard
    return out


def max_bytes_per_device(tree: Any) -> int:
    return max(bytes_per_device(tree).values(), default=0)
