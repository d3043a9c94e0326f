"""The decoder-only transformer every supported family runs on, the family table, and loading.

The families (FAMILIES: Llama 2/3, Mistral, Qwen2, Qwen3) are one network, `Decoder`, with
a few switches their config adapters set: GQA, q/k/v biases (Qwen2), per-head q/k RMSNorm
(Qwen3), Llama 3.1's RoPE frequency scaling, tied embeddings. Each layer declares its
weights (`WEIGHTS`): their Hugging Face and GGUF names and their logical axes, which
parallel.py maps onto a device mesh. Each forward step takes a flat batch of T tokens
from any number of sequences; the layers write the step's K/V into the paged cache and
call the attention backend (see docs/ARCHITECTURE.md for the cache layout and
attention_backend.py for the backends).

Numerics: matmuls run in the parameter dtype (float32 or bfloat16); RMSNorm, RoPE,
softmax (inside the backend) and the logits are float32. Quantized linears (quant.py)
convert their codes to that dtype inside the step.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace
from collections.abc import Iterable, Iterator
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attention_backend import AttentionBackend
from hf_config import check_hf_config, check_llama3_rope, generation_eos_ids, read_json, token_ids
from kernels_pallas import Bits, QuantizedKV, as_bits, from_bits, quantize_kv
from quant import GGUFBlocks, QuantLinear, WeightQuant, encode, weight_quant_for
from tokenizer import ByteTokenizer, gguf_tokenizer, load_named_tokenizer, load_tokenizer, num_token_ids

LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture, hashable so jitted code can take it as a static argument."""

    architecture: str  # the family's model_type (a key of FAMILIES)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, float], ...] | None = None  # llama3 parameters, as sorted items
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    # The per-family options (set by the family's config adapter):
    attention_bias: bool = False  # biases on q/k/v_proj
    o_proj_bias: bool = False  # and on o_proj
    qk_norm: bool = False  # RMSNorm of each q and k head before RoPE
    sliding_window: int | None = None  # attention is exact only while a sequence fits in it
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def max_model_len(self) -> int:
        """The longest sequence this engine runs exactly: a sliding window caps it, since
        the kernels attend to the whole context."""
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    @classmethod
    def from_hf(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """From a Hugging Face config.json dict; raises ValueError on what we do not run."""
        # The family first: an unsupported one (Gemma3's text_config, Mllama) lacks the fields checked next
        model_type = d.get("model_type") if isinstance(d, dict) else None
        if isinstance(d, dict) and not (isinstance(model_type, str) and model_type in FAMILIES):
            raise ValueError(f"unsupported model_type {model_type!r} (architectures={d.get('architectures')}); "
                             f"supported: {', '.join(FAMILIES)}")
        check_hf_config(d, source)
        family = FAMILIES[d["model_type"]]
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r} (only silu)")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        heads = d["num_attention_heads"]
        theta, scaling = _rope_from_hf(d)
        return cls(
            architecture=family.model_type, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            # null is the default, as an absent key (check_hf_config has refused 0)
            rms_norm_eps=float(d.get("rms_norm_eps") or 1e-6), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=d["max_position_embeddings"],
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=token_ids(d.get("eos_token_id"), f"{source}: eos_token_id"),
            **family.options(d),
        )


# ---- model families ------------------------------------------------------------------

@dataclass(frozen=True)
class Family:
    """A supported model family, as its checkpoints describe it. Every family runs on the
    one `Decoder` below, whose layers declare the tensor names (HF and GGUF) and the
    sharding of each weight; a family's `options` maps its config.json onto the decoder's
    switches (the ModelConfig fields attention_bias, o_proj_bias, qk_norm, sliding_window)."""

    model_type: str  # config.json's model_type
    options: Callable[[dict[str, Any]], dict[str, Any]]  # config.json -> the decoder's switches
    gguf_arch: str | None = None  # its GGUF files' general.architecture; None: not read from GGUF
    gguf_qk_permuted: bool = False  # llama.cpp's converter permuted its q/k rows (gguf_loader.unpermute_qk)


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add a family: config.json files with its model_type (and GGUF files with its
    gguf_arch) then load."""
    if family.model_type in FAMILIES:
        raise ValueError(f"model family {family.model_type!r} is already registered")
    FAMILIES[family.model_type] = family
    return family


def llama_options(d: dict[str, Any]) -> dict[str, Any]:
    """Llama and Mistral: `attention_bias` puts biases on q/k/v and o; a sliding window
    is on whenever the config gives one."""
    bias = bool(d.get("attention_bias", False))
    return dict(attention_bias=bias, o_proj_bias=bias, sliding_window=d.get("sliding_window"))


# transformers' default sliding_window (MistralConfig, and Qwen2/Qwen3Config's with
# use_sliding_window) where a config.json leaves the key out
DEFAULT_WINDOW = 4096


def mistral_options(d: dict[str, Any]) -> dict[str, Any]:
    """Mistral: as Llama, with transformers' default window where the config.json leaves
    the key out; null turns it off, as in Mistral v0.2 and later."""
    return {**llama_options(d), "sliding_window": d.get("sliding_window", DEFAULT_WINDOW)}


def _qwen_window(d: dict[str, Any]) -> int | None:
    # Qwen configs carry a window size that is off unless use_sliding_window
    return d.get("sliding_window", DEFAULT_WINDOW) if d.get("use_sliding_window", False) else None


def qwen2_options(d: dict[str, Any]) -> dict[str, Any]:
    """Qwen2: q/k/v biases always, none on o_proj."""
    return dict(attention_bias=True, o_proj_bias=False, sliding_window=_qwen_window(d))


def qwen3_options(d: dict[str, Any]) -> dict[str, Any]:
    """Qwen3: RMSNorm on each q and k head; biases as Llama's."""
    bias = bool(d.get("attention_bias", False))
    return dict(attention_bias=bias, o_proj_bias=bias, qk_norm=True, sliding_window=_qwen_window(d))


register_family(Family("llama", llama_options, gguf_arch="llama", gguf_qk_permuted=True))
register_family(Family("mistral", mistral_options))  # Mistral's GGUF files say "llama"
register_family(Family("qwen2", qwen2_options, gguf_arch="qwen2"))
register_family(Family("qwen3", qwen3_options, gguf_arch="qwen3"))


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, tuple[tuple[str, float], ...] | None]:
    # transformers 5.x writes `rope_parameters` (rope_type, rope_theta, ...); older configs
    # have a top-level rope_theta and `rope_scaling` (with "type" or "rope_type").
    p = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
    if any(isinstance(v, dict) for v in p.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    if p.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    theta = float(p.get("rope_theta") or d.get("rope_theta") or 10000.0)  # null: absent (0 is refused)
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported RoPE type {rope_type!r} (the rope_type of rope_parameters or rope_scaling; "
                         "supported: default, llama3)")
    missing = [k for k in LLAMA3_ROPE_KEYS if k not in p]
    if missing:
        raise ValueError(f"llama3 RoPE scaling lacks {missing}")
    check_llama3_rope(p)
    return theta, tuple(sorted((k, float(p[k])) for k in LLAMA3_ROPE_KEYS))


@jax.tree_util.register_dataclass
@dataclass
class AttentionInputs:
    """Where this step's K/V go and what each query attends to (see docs/ARCHITECTURE.md, "KV cache")."""

    slot_mapping: jax.Array  # [T] i32: flat cache index of token t's K/V
    block_tables: jax.Array  # [S, W] i32
    kv_lens: jax.Array  # [S] i32, including this step's tokens
    cu_q_lens: jax.Array | None = None  # [S+1] i32; None => decode, one token per slot (T == S)


# ---- weights: declared by the layer that owns them -------------------------------

@dataclass(frozen=True)
class Weight:
    """One parameter as checkpoints name it and as tensor parallelism splits it."""

    hf: str  # its Hugging Face name; "{}" stands for the layer index
    gguf: str  # its name in llama.cpp's GGUF files
    axes: tuple[str, ...]  # the logical axis of each dim; parallel.RULES maps them onto the mesh
    transposed: bool = False  # checkpoints store it [out, in] (torch Linear); here it is [in, out]
    # A quantized kernel's scales (quant.py): computed from, or stored inside the blocks of,
    # the kernel's checkpoint tensor; never a tensor of their own.
    derived: bool = False

    @property
    def stacked(self) -> bool:
        """A decoder layer's parameter: one array for all layers, layer first."""
        return self.axes[:1] == ("layers",)


def _linear_weights(name: str, gguf: str, axes: tuple[str, str], bias: bool = True) -> dict[str, Weight]:
    """A linear's kernel [in, out] and, where a config may give it one, its bias [out];
    quantized (quant.QuantLinear), the kernel holds codes and beside it go a per-channel
    scale [out] or per-block scales (and minima) [in/32, out], split over the mesh with it."""
    kernel = {f"{name}.kernel": Weight(f"{name}.weight", f"{gguf}.weight", axes, transposed=True)}
    scales = {f"{name}.scale": Weight(f"{name}.weight_scale", "", axes[1:], derived=True),
              f"{name}.block_scale": Weight(f"{name}.weight_block_scale", "", axes, derived=True),
              f"{name}.block_min": Weight(f"{name}.weight_block_min", "", axes, derived=True)}
    return kernel | scales | ({f"{name}.bias": Weight(f"{name}.bias", f"{gguf}.bias", axes[1:])} if bias else {})


def _sublayer(attr: str, weights: dict[str, Weight], hf: str, gguf: str,
              stacked: bool = False) -> dict[str, Weight]:
    """A sublayer's declarations under its attribute path and name prefixes; `stacked`
    layers carry a leading "layers" axis."""
    lead = ("layers",) if stacked else ()
    return {f"{attr}.{path}": replace(w, hf=hf + w.hf, gguf=gguf + w.gguf, axes=lead + w.axes)
            for path, w in weights.items()}


# ---- layers ----------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """[head_dim/2] float32 inverse frequencies, a trace-time constant (not a param)."""
    d = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    if cfg.rope_scaling is not None:
        # Llama 3.1: wavelengths longer than the original context are stretched by
        # `factor`, short ones are kept, and the band between is interpolated.
        s = dict(cfg.rope_scaling)
        old, factor = s["original_max_position_embeddings"], s["factor"]
        lo, hi = s["low_freq_factor"], s["high_freq_factor"]
        wavelen = 2 * np.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * inv / factor + smooth * inv
        inv = np.where(wavelen > old / lo, inv / factor, np.where(wavelen < old / hi, inv, blended))
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """x [T, H, D] rotated by position, in HF's "rotate half" layout (pairs are (i, i+D/2))."""
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return y.astype(x.dtype) * self.weight[...]  # as HF: normalise in f32, scale in dtype


def _linear(n_in: int, n_out: int, bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs,
            scheme: str | None = None) -> nnx.Linear | QuantLinear:
    if scheme is not None:  # filled by loading (model_from_hf_tensors)
        return QuantLinear(n_in, n_out, bias, dtype, scheme)
    # std 1/sqrt(fan_in) keeps every sublayer's output O(1), so a random model's context
    # visibly moves its logits (real weights are loaded over this anyway).
    return nnx.Linear(n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=dtype,
                      kernel_init=nnx.initializers.normal(n_in ** -0.5), rngs=rngs)


def _write_cache(cache: jax.Array | Bits | QuantizedKV, x: jax.Array,
                 slots: jax.Array) -> jax.Array | Bits | QuantizedKV:
    """Scatter x [T, Hkv, D] into cache rows `slots`; a pure update XLA does in place when
    the cache buffer is donated. A quantized cache gets x's 8-bit values and their scales."""
    if isinstance(cache, QuantizedKV):
        values, scales = quantize_kv(x, cache.dtype)
        return QuantizedKV(_write_cache(cache.values, values, slots), _write_cache(cache.scales, scales, slots))
    if isinstance(cache, Bits):  # held as its bits (as_bits): x's bits in the cache's type
        return Bits(_write_cache(cache.bits, jax.lax.bitcast_convert_type(x.astype(cache.dtype), cache.bits.dtype),
                                 slots), cache.dtype)
    nb, bs, *rest = cache.shape
    return cache.reshape(nb * bs, *rest).at[slots].set(x.astype(cache.dtype)).reshape(cache.shape)


class Attention(nnx.Module):
    # Q heads and KV heads are split over devices, whole; o_proj by its input (the heads),
    # so its bias is added once, after the sum.
    WEIGHTS = {**_linear_weights("q_proj", "attn_q", ("embed", "heads")),
               **_linear_weights("k_proj", "attn_k", ("embed", "kv_heads")),
               **_linear_weights("v_proj", "attn_v", ("embed", "kv_heads")),
               **_linear_weights("o_proj", "attn_output", ("heads", "embed")),
               "q_norm.weight": Weight("q_norm.weight", "attn_q_norm.weight", ("head_dim",)),
               "k_norm.weight": Weight("k_norm.weight", "attn_k_norm.weight", ("head_dim",))}

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, quant: WeightQuant | None = None):
        self.cfg = cfg
        h, d, nq, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        s = (lambda name: quant.scheme(f"layers.self_attn.{name}")) if quant else (lambda name: None)
        self.q_proj = _linear(h, nq * d, cfg.attention_bias, dtype, rngs, s("q_proj"))
        self.k_proj = _linear(h, nkv * d, cfg.attention_bias, dtype, rngs, s("k_proj"))
        self.v_proj = _linear(h, nkv * d, cfg.attention_bias, dtype, rngs, s("v_proj"))
        self.o_proj = _linear(nq * d, h, cfg.o_proj_bias, dtype, rngs, s("o_proj"))
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def __call__(self, x: jax.Array, positions: jax.Array, kv_cache: tuple[jax.Array, jax.Array],
                 attn: AttentionInputs, backend: AttentionBackend,
                 block_offset: jax.Array | int = 0) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """kv_cache: every layer's blocks in one [L * num_blocks, block_size, Hkv, D]
        array per K and V; this layer's block b is block_offset + b (see Decoder.__call__)."""
        cfg, t = self.cfg, x.shape[0]
        q = self.q_proj(x).reshape(t, cfg.num_attention_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(t, cfg.num_key_value_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(t, cfg.num_key_value_heads, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: per head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_inv_freq(cfg)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        # The step's K/V go into the cache first; attention then reads everything from it.
        slots = attn.slot_mapping + block_offset * kv_cache[0].shape[1]
        block_tables = attn.block_tables + block_offset
        k_cache = _write_cache(kv_cache[0], k, slots)
        v_cache = _write_cache(kv_cache[1], v, slots)
        scale = cfg.head_dim ** -0.5
        if attn.cu_q_lens is None:
            o = backend.decode(q, k_cache, v_cache, block_tables, attn.kv_lens, scale=scale)
        else:
            o = backend.ragged(q, k_cache, v_cache, block_tables, attn.cu_q_lens, attn.kv_lens, scale=scale)
        return self.o_proj(o.reshape(t, -1)), (k_cache, v_cache)


class MLP(nnx.Module):
    WEIGHTS = {**_linear_weights("gate_proj", "ffn_gate", ("embed", "mlp"), bias=False),
               **_linear_weights("up_proj", "ffn_up", ("embed", "mlp"), bias=False),
               **_linear_weights("down_proj", "ffn_down", ("mlp", "embed"), bias=False)}

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, quant: WeightQuant | None = None):
        h, i = cfg.hidden_size, cfg.intermediate_size
        s = (lambda name: quant.scheme(f"layers.mlp.{name}")) if quant else (lambda name: None)
        self.gate_proj = _linear(h, i, False, dtype, rngs, s("gate_proj"))
        self.up_proj = _linear(h, i, False, dtype, rngs, s("up_proj"))
        self.down_proj = _linear(i, h, False, dtype, rngs, s("down_proj"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    WEIGHTS = {"input_layernorm.weight": Weight("input_layernorm.weight", "attn_norm.weight", ("embed",)),
               "post_attention_layernorm.weight": Weight("post_attention_layernorm.weight", "ffn_norm.weight",
                                                         ("embed",)),
               **_sublayer("self_attn", Attention.WEIGHTS, "self_attn.", ""),
               **_sublayer("mlp", MLP.WEIGHTS, "mlp.", "")}

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, quant: WeightQuant | None = None):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs, quant)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs, quant)

    def __call__(self, x: jax.Array, positions: jax.Array, kv_cache: tuple[jax.Array, jax.Array],
                 attn: AttentionInputs, backend: AttentionBackend,
                 block_offset: jax.Array | int = 0) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, attn, backend, block_offset)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


# K and V, each [num_layers, num_blocks, block_size, Hkv, head_dim] (or a QuantizedKV of that shape)
KVCache = tuple[jax.Array | QuantizedKV, jax.Array | QuantizedKV]


class Decoder(nnx.Module):
    """The decoder-only transformer of every family in FAMILIES. Attribute names mirror
    HF's parameter names; WEIGHTS declares every parameter (by its attribute path) with
    its checkpoint names and logical axes.

    Parameter layout (nnx.state(model, nnx.Param), every leaf one array):
      embed_tokens.embedding  [V, H]
      layers.<HF sublayer path>  the decoder layers STACKED: every leaf has a leading
          [num_layers] axis, e.g. layers.self_attn.q_proj.kernel [L, H, Hq*D],
          layers.mlp.down_proj.kernel [L, I, H], layers.input_layernorm.weight [L, H].
          Kernels are [in, out] (x @ W, HF's torch weight transposed).
      norm.weight [H];  lm_head.kernel [H, V] (absent with tied embeddings)
    The forward is one lax.scan over the stacked layers, so a step program's compile
    time does not grow with depth."""

    WEIGHTS = {"embed_tokens.embedding": Weight("model.embed_tokens.weight", "token_embd.weight", ("vocab", "embed")),
               **_sublayer("layers", DecoderLayer.WEIGHTS, "model.layers.{}.", "blk.{}.", stacked=True),
               "norm.weight": Weight("model.norm.weight", "output_norm.weight", ("embed",)),
               "lm_head.kernel": Weight("lm_head.weight", "output.weight", ("embed", "vocab"), transposed=True)}

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype | str = jnp.float32, quant: WeightQuant | None = None, *,
                 rngs: nnx.Rngs):
        """quant: the linears stored quantized (quant.py); their arrays are placeholders
        until model_from_hf_tensors fills them."""
        dtype = jnp.dtype(dtype)
        self.config = cfg
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
                                      embedding_init=nnx.initializers.normal(1.0), rngs=rngs)

        @nnx.split_rngs(splits=cfg.num_hidden_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stacked_layers(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(cfg, dtype, rngs, quant)

        self.layers = stacked_layers(rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, False, dtype, rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array, kv_caches: KVCache,
                 attn: AttentionInputs, backend: AttentionBackend) -> tuple[jax.Array, KVCache]:
        """tokens, positions [T] -> (final-normed hidden [T, H], updated kv_caches)."""
        x = self.embed_tokens(tokens)
        k_all, v_all = kv_caches
        L, NB = k_all.shape[:2]
        assert L == self.config.num_hidden_layers, (k_all.shape, L)
        # The scan carries the whole cache, its layer axis folded into the block axis (a
        # free reshape): layer l's block b is row l * NB + b. Each layer scatters into the
        # carry in place and hands the attention backend block tables offset by l * NB,
        # so the kernels see an ordinary paged cache and no per-layer slice is copied.
        flat = lambda cache: jax.tree.map(lambda c: c.reshape(L * NB, *c.shape[2:]), cache)
        # On CPU a bf16/f16/fp8 cache is written and read as its bits (see as_bits); the
        # engine's is held so, one handed over in its float type goes back in it.
        given = jax.tree.structure((k_all, v_all))
        k_all, v_all = as_bits(k_all), as_bits(v_all)
        back = from_bits if jax.tree.structure((k_all, v_all)) != given else (lambda cache: cache)
        layer_def, layer_state = nnx.split(self.layers)

        def body(carry, xs):
            x, k, v = carry
            state, l = xs
            x, (k, v) = nnx.merge(layer_def, state)(x, positions, (k, v), attn, backend, l * NB)
            return (x, k, v), None

        (x, k, v), _ = jax.lax.scan(body, (x, flat(k_all), flat(v_all)), (layer_state, jnp.arange(L)))
        unflat = lambda cache, like: jax.tree.map(lambda c, a: c.reshape(a.shape), cache, like)
        return self.norm(x), (back(unflat(k, k_all)), back(unflat(v, v_all)))

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [N, H] (rows of __call__'s output) -> [N, vocab] float32."""
        if self.lm_head is None:
            w = self.embed_tokens.embedding[...]  # [V, H]
            return jnp.einsum("nh,vh->nv", hidden, w, preferred_element_type=jnp.float32)
        return jnp.dot(hidden, self.lm_head.kernel[...], preferred_element_type=jnp.float32)


def init_model(cfg: ModelConfig, dtype: jnp.dtype | str = jnp.float32, seed: int = 0) -> Decoder:
    """Random weights (the built-in models, tests)."""
    return Decoder(cfg, dtype, rngs=nnx.Rngs(seed))


def param_bytes(model: Decoder) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def device_bytes(tree: Any) -> int:
    """Bytes the live arrays of `tree` occupy on this process's devices, read from their
    addressable shards (so replicated arrays count once per device holding them)."""
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards)


# ---- built-in models and loading -------------------------------------------------

_BYTE = ByteTokenizer()
BUILTIN_MODELS: dict[str, ModelConfig] = {
    "tiny": ModelConfig("llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                        bos_token_id=_BYTE.bos_token_id, eos_token_ids=(_BYTE.eos_token_id,)),
    # 57,942,528 params: embed + lm_head 2 * 32000*512 = 32,768,000; per layer q,o 2 * 512*512 +
    # k,v 2 * 512*256 + mlp 3 * 512*1536 + 2 norms * 512 = 3,146,752, * 8 = 25,174,016; final norm 512.
    "bench": ModelConfig("llama", vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-5,
                         max_position_embeddings=16384,
                         bos_token_id=_BYTE.bos_token_id, eos_token_ids=(_BYTE.eos_token_id,)),
}
_DTYPES = {"float32": jnp.dtype(jnp.float32), "bfloat16": jnp.dtype(jnp.bfloat16)}


@dataclass
class LoadedModel:
    model: Decoder
    config: ModelConfig  # the model's, with the stop ids of the tokenizer served (--tokenizer: named_tokenizer)
    tokenizer: Any | None  # ByteTokenizer, a transformers tokenizer, or None (token ids only)
    name: str
    dtype: jnp.dtype
    quant: WeightQuant | None = None  # the linears stored quantized (quant.py)


def resolve_dtype(dtype: str, checkpoint_dtype: str | None) -> jnp.dtype:
    """The parameter dtype for `--dtype` (float32, bfloat16, or auto: the checkpoint's)."""
    if dtype == "auto":
        # float16 checkpoints run in float32: exact, and without fp16's overflow risk.
        dtype = "bfloat16" if checkpoint_dtype == "bfloat16" else "float32"
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or auto, got {dtype!r}")
    return _DTYPES[dtype]


def load_model(model: str = "tiny", dtype: str = "float32", seed: int = 0,
               log: Callable[[str], None] = print, quantization: str | None = None,
               tokenizer: str | None = None) -> LoadedModel:
    """A built-in random model ("tiny", "bench"), the built-in real model ("smollm2", a
    GGUF fetched on first use), a .gguf file, or an HF checkpoint directory; its decoder
    layers' linears quantized as --quantization says (quant.py). `tokenizer` (--tokenizer):
    a tokenizer folder or .gguf file used instead of the model's own, which is then not
    loaded (named_tokenizer: loaded and checked before the weights)."""
    if model in BUILTIN_MODELS:
        cfg, dt = BUILTIN_MODELS[model], resolve_dtype(dtype, None)
        tok, tok_cfg = named_tokenizer(tokenizer, cfg, log, builtin=True) if tokenizer else (ByteTokenizer(), cfg)
        loaded = LoadedModel(init_model(cfg, dt, seed), tok_cfg, tok, model, dt)
        return quantize_loaded(loaded, weight_quant_for(quantization, None))
    # A GGUF file comes as the same HF config dict and HF-named tensors as a checkpoint directory.
    import gguf_loader

    if model in gguf_loader.BUILTIN_GGUF or model.endswith(".gguf"):
        path = gguf_loader.resolve_builtin(model, log) if model in gguf_loader.BUILTIN_GGUF else model
        ckpt = gguf_loader.read_gguf(path)
        cfg = ModelConfig.from_hf(ckpt.hf_config, f"{path} (GGUF metadata)")
        dt = resolve_dtype(dtype, "bfloat16" if ckpt.file_type == "BF16" else None)
        if tokenizer:  # instead of the metadata's, which is not converted (vLLM's advice for GGUF files)
            tok, tok_cfg = named_tokenizer(tokenizer, cfg, log)
        else:
            tok, tok_cfg = gguf_tokenizer(ckpt.tokenizer_metadata) if ckpt.tokenizer_metadata else None, cfg
            check_token_ids(tok, cfg, f"the tokenizer of {path!r}")
        quant = weight_quant_for(quantization, ckpt.linear_types())
        native = quant is not None and quant.method == "gguf"
        served = (f"{quant.describe()}, the rest dequantized to {np.dtype(dt).name}" if native
                  else f"dequantized to {np.dtype(dt).name}" + (f", then {quant.describe()}" if quant else ""))
        log(f"model: {path} ({ckpt.file_type} GGUF, {served})")
        return LoadedModel(model_from_hf_tensors(cfg, dt, ckpt.tensors(native=native), f"checkpoint {path}", quant),
                           tok_cfg, tok, model, dt, quant)
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise FileNotFoundError(f"model {model!r} is neither a built-in model "
                                f"({', '.join([*BUILTIN_MODELS, *gguf_loader.BUILTIN_GGUF])}), a .gguf file, "
                                "nor a directory with a config.json")
    config_path = os.path.join(model, "config.json")
    hf = read_json(config_path)
    cfg = ModelConfig.from_hf(hf, config_path)
    # chat models often list extra stop ids (e.g. <|eot_id|>) only in generation_config.json
    extra = generation_eos_ids(os.path.join(model, "generation_config.json"), cfg.vocab_size)
    cfg = replace(cfg, eos_token_ids=tuple(dict.fromkeys(cfg.eos_token_ids + extra)))
    if tokenizer:
        tok, tok_cfg = named_tokenizer(tokenizer, cfg, log)
    else:
        tok = load_tokenizer(model)
        check_token_ids(tok, cfg, f"the tokenizer of {model!r}")
        tok_cfg = with_tokenizer_eos(cfg, tok)
    dt = resolve_dtype(dtype, hf.get("dtype") or hf.get("torch_dtype"))
    quant = weight_quant_for(quantization, None)
    return LoadedModel(model_from_hf_tensors(cfg, dt, _safetensors_tensors(model), f"checkpoint {model}", quant),
                       tok_cfg, tok, model, dt, quant)


def check_token_ids(tokenizer: Any | None, cfg: ModelConfig, source: str) -> int:
    """The tokenizer's number of token ids (0: none). Its ids must have embedding rows: a
    vocabulary larger than the model's is refused; a smaller one is fine (the rows past it,
    often padding to a round vocab_size, are never produced by encoding)."""
    n = num_token_ids(tokenizer) if tokenizer is not None else 0
    if n > cfg.vocab_size:
        raise ValueError(f"{source}: its vocabulary has {n} token ids, more than the model's "
                         f"{cfg.vocab_size} embedding rows (vocab_size): ids {cfg.vocab_size}..{n - 1} would have "
                         "no embedding")
    return n


def with_tokenizer_eos(cfg: ModelConfig, tokenizer: Any | None) -> ModelConfig:
    """cfg with the tokenizer's eos_token_id as its first stop id (vLLM's primary EOS), the
    model's own (config.json's, generation_config.json's, a GGUF file's) beside it."""
    eos = getattr(tokenizer, "eos_token_id", None)
    own = (eos,) if isinstance(eos, int) and 0 <= eos < cfg.vocab_size else ()
    return replace(cfg, eos_token_ids=tuple(dict.fromkeys(own + cfg.eos_token_ids)))


def named_tokenizer(path: str, cfg: ModelConfig, log: Callable[[str], None] = print,
                    builtin: bool = False) -> tuple[Any, ModelConfig]:
    """--tokenizer's tokenizer for a model of `cfg`, and `cfg` with the stop ids that follow
    from it. Its ids must have embedding rows (check_token_ids). As vLLM, the tokenizer's
    eos_token_id is the primary EOS and the model's own stop ids (config.json's,
    generation_config.json's, a GGUF file's eos/eot/eom) stay beside it; a built-in random
    model's are its byte tokenizer's, which the named one replaces. The
    decoder keeps the model's own ModelConfig (the ids are not in its computation), so its
    step programs are those of the same model served without the flag."""
    tok = load_named_tokenizer(path)
    n = check_token_ids(tok, cfg, f"--tokenizer {path!r}")
    if builtin:
        cfg = replace(cfg, eos_token_ids=(), bos_token_id=tok.bos_token_id)
    cfg = with_tokenizer_eos(cfg, tok)
    log(f"tokenizer: {path} (--tokenizer; {n} token ids of the model's {cfg.vocab_size}, EOS ids "
        f"{list(cfg.eos_token_ids)})")
    return tok, cfg


def with_named_tokenizer(loaded: LoadedModel, path: str, log: Callable[[str], None] = print) -> LoadedModel:
    """A model already loaded (an orbax checkpoint, its own tokenizer with it) serving
    --tokenizer's instead."""
    builtin = isinstance(loaded.tokenizer, ByteTokenizer)  # a built-in random model, converted
    tok, cfg = named_tokenizer(path, loaded.config, log, builtin=builtin)
    return replace(loaded, tokenizer=tok, config=cfg)


def quantize_loaded(loaded: LoadedModel, quant: WeightQuant | None) -> LoadedModel:
    """A float model already in memory (a built-in model, an orbax checkpoint) with its
    linears quantized as `quant` says, through the same loading path as a checkpoint."""
    if quant is None:
        return loaded
    assert loaded.quant is None, "the model is quantized already"
    model = model_from_hf_tensors(loaded.config, loaded.dtype, hf_state_dict(loaded.model).items(),
                                  loaded.name, quant)
    return replace(loaded, model=model, quant=quant)


def declared_weight(path: tuple[Any, ...]) -> Weight:
    """The declaration (Decoder.WEIGHTS) of the parameter at an nnx state path."""
    return Decoder.WEIGHTS[".".join(str(p) for p in path)]


def hf_tensor_names(path: tuple[Any, ...], num_layers: int) -> list[str]:
    """The HF tensor names the parameter at `path` holds: one per layer, in order, for
    a stacked layer parameter (none for a quantized kernel's scales: they come with it)."""
    w = declared_weight(path)
    if w.derived:
        return []
    return [w.hf.format(i) for i in range(num_layers)] if w.stacked else [w.hf]


def hf_state_dict(model: Decoder) -> dict[str, np.ndarray]:
    """The model's weights under HF names and layouts (unstacked, torch [out, in])."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        w, x = declared_weight(path), np.asarray(var.get_value())
        if w.derived or x.dtype in (np.int8, np.uint8):
            raise ValueError("a model with quantized weights has no HF state dict (its float weights are gone)")
        for i, name in enumerate(hf_tensor_names(path, model.config.num_hidden_layers)):
            t = x[i] if w.stacked else x
            out[name] = np.ascontiguousarray(t.T if w.transposed else t)
    return out


def model_from_hf_tensors(cfg: ModelConfig, dtype: jnp.dtype, tensors: Iterable[tuple[str, Any]],
                          source: str = "the checkpoint", quant: WeightQuant | None = None) -> Decoder:
    """Build the model from (HF tensor name, array) pairs, the one loading path for every
    checkpoint format: per-layer tensors are copied into their layer of the stacked
    params; a quantized linear's tensor (float, or GGUF blocks: quant.GGUFBlocks) is
    encoded into its codes and scales one layer at a time, so no float copy of a
    quantized parameter is ever whole. Raises ValueError on an unexpected, misshapen or
    missing tensor."""
    # Build the module abstractly (no random init), then fill each param from the tensors.
    try:
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, dtype, quant, rngs=nnx.Rngs(0))))
    except ValueError as e:  # a size the quantization cannot hold (quant.QuantLinear's blocks of 32)
        raise ValueError(f"{source}: {e}") from None
    L = cfg.num_hidden_layers
    wanted: dict[str, tuple[tuple[Any, ...], int | None, bool]] = {}
    buffers: dict[tuple[Any, ...], np.ndarray] = {}
    variables = dict(nnx.to_flat_state(abstract))
    check_fits_in_host_memory(variables.values(), source)
    for p, var in variables.items():
        w = declared_weight(p)
        for i, name in enumerate(hf_tensor_names(p, L)):
            wanted[name] = (p, i if w.stacked else None, w.transposed)
        buffers[p] = np.empty(var.get_value().shape, var.get_value().dtype)
    # A quantized linear: its kernel's path -> its scheme
    schemes = {p: quant.scheme(".".join(map(str, p[:-1]))) for p in variables if quant and p[-1] == "kernel"}
    seen: set[str] = set()
    for name, x in tensors:
        if name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue  # derived from the config / a copy of the embedding
        if name not in wanted:
            raise ValueError(f"unexpected tensor {name!r} in {source}")
        if name in seen:  # in two shards: the one read last would win without a word
            raise ValueError(f"tensor {name!r} appears twice in {source}")
        p, layer, transpose = wanted[name]
        if not isinstance(x, GGUFBlocks) and not jnp.issubdtype(x.dtype, jnp.floating):
            # an integer or bool tensor would be cast to the weights' dtype without a word
            raise ValueError(f"tensor {name!r} in {source} has dtype {x.dtype}, not a floating-point type")
        at = (lambda q: buffers[q]) if layer is None else (lambda q: buffers[q][layer])
        scheme = schemes.get(p)
        if scheme is not None:
            lin = variables[p[:-1] + ("kernel",)].get_value().shape  # [(L,) in or in/2, out]
            want = (lin[-1], lin[-2] * (2 if scheme in ("q4_0", "q4_1") else 1))
            if tuple(x.shape) != want:
                raise ValueError(f"tensor {name!r} in {source} has shape {tuple(x.shape)}, expected {want}")
            for part, arr in encode(x, scheme).items():
                at(p[:-1] + (part,))[...] = arr
            seen.add(name)
            continue
        x = x.dequantize() if isinstance(x, GGUFBlocks) else np.asarray(x)
        dest = at(p)
        want = dest.shape[::-1] if transpose else dest.shape
        if x.shape != want:
            raise ValueError(f"tensor {name!r} in {source} has shape {x.shape}, expected {want}")
        dest[...] = (x.T if transpose else x).astype(dtype)
        seen.add(name)
    missing = [n for n in wanted if n not in seen]
    if missing:  # (a config with many more layers than the tensors have would list thousands)
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"{source} lacks tensors: {', '.join(missing[:8])}{more}")
    filled = [(p, var.replace(jnp.asarray(buffers[p]))) for p, var in variables.items()]
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


def check_fits_in_host_memory(params: Iterable[Any], source: str) -> None:
    """The parameters a config describes are built on the host before they reach the
    device: a ValueError when they alone exceed its memory (a config.json with a vocab_size
    or num_hidden_layers the tensors do not have), not a MemoryError while allocating."""
    from config import host_memory_bytes

    need = sum(math.prod(v.get_value().shape) * np.dtype(v.get_value().dtype).itemsize for v in params)
    have = host_memory_bytes()
    if need > have:
        raise ValueError(f"{source} describes {need / 2**30:,.1f} GiB of parameters, more than the "
                         f"host's {have / 2**30:.1f} GiB of memory: check its vocab_size, hidden_size, "
                         "intermediate_size and num_hidden_layers")


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(v, str) and v for v in weight_map.values()):
            raise ValueError(f"{index}: weight_map must map tensor names to shard file names, got {weight_map!r}"[:300])
        return [os.path.join(path, n) for n in sorted(set(weight_map.values()))]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path} "
                            "(only safetensors checkpoints are supported)")


def _safetensors_tensors(path: str) -> Iterator[tuple[str, Any]]:
    """(HF name, array) for every tensor of a checkpoint directory, one at a time."""
    from safetensors import safe_open

    for file in _safetensors_files(path):
        try:
            st = safe_open(file, framework="flax")  # the flax reader handles bfloat16
        except Exception as e:  # SafetensorError (not a ValueError): truncated, or not safetensors
            raise ValueError(f"{file} is not a readable safetensors file: {e}") from None
        with st:
            for name in st.keys():
                yield name, st.get_tensor(name)
