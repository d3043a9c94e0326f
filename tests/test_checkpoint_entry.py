"""Values that enter at start-up, from a checkpoint's files and the host: each is refused
where it enters with a ValueError naming it (what server.py turns into one readable
line and a non-zero exit), never a MemoryError, an AttributeError from a parser, or a
model that loads and computes something else."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import make_hf_tokenizer

import config as config_module
import kvcache
from config import EngineConfig, host_memory_bytes
from model import ModelConfig
from model_loader import load_model
from runner import check_host_buffers
from tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tok"))
    make_hf_tokenizer(path)
    return path


def _edited(src: str, dst: str, name: str, edit) -> str:
    shutil.copytree(src, dst)
    file = os.path.join(dst, name)
    with open(file) as f:
        text = f.read()
    with open(file, "w") as f:
        f.write(edit(text))
    return dst


def _json_edit(**change):
    return lambda text: json.dumps({**json.loads(text), **change})


@pytest.mark.parametrize("name, edit, says", [
    # transformers' own parsers raise AttributeError / TypeError here: the server catches ValueError only
    ("tokenizer_config.json", lambda _: "[1]", "its tokenizer files do not load \\(AttributeError"),
    ("tokenizer_config.json", _json_edit(eos_token=5), "its tokenizer files do not load \\(TypeError"),
    ("tokenizer.json", lambda _: "[]", "its tokenizer files do not load"),
    # loaded, its unk_token_id (and every unknown token's id) was a RecursionError
    ("tokenizer_config.json", _json_edit(unk_token=""), "its tokenizer files do not load \\(RecursionError"),
    # a template of no type Jinja reads: every chat request would fail, the load did not
    ("tokenizer_config.json", _json_edit(chat_template=5), "chat_template must be a string or a list of"),
    ("tokenizer_config.json", _json_edit(chat_template=[{"name": "default", "template": 3}]),
     "chat_template must be a string or a list of"),
])
def test_tokenizer_files_that_do_not_load_are_a_value_error_naming_the_folder(tokenizer_dir, tmp_path, name, edit,
                                                                            says):
    path = _edited(tokenizer_dir, str(tmp_path / "t"), name, edit)
    if "chat_template" in says:
        os.remove(os.path.join(path, "chat_template.jinja"))  # it would win over tokenizer_config.json's
    with pytest.raises(ValueError, match=f"{path}: .*{says}"):
        load_tokenizer(path)


def test_a_named_chat_template_list_loads(tokenizer_dir, tmp_path):
    path = _edited(tokenizer_dir, str(tmp_path / "t"), "tokenizer_config.json",
                   _json_edit(chat_template=[{"name": "default", "template": "{{ messages[0].content }}"}]))
    os.remove(os.path.join(path, "chat_template.jinja"))
    assert load_tokenizer(path).chat_template == {"default": "{{ messages[0].content }}"}


@pytest.mark.parametrize("template", [5, b"{{ messages }}"])
def test_a_gguf_chat_template_of_no_template_type_is_refused(template):
    """smollm2's tokenizer metadata (the built-in model, cached by the suite) with its
    tokenizer.chat_template of another GGUF type: loaded as is, every chat request failed."""
    import gguf_loader
    from tokenizer import gguf_tokenizer

    metadata = gguf_loader.read_tokenizer_metadata(gguf_loader.resolve_builtin("smollm2", log=lambda _: None))
    assert isinstance(gguf_tokenizer(metadata).chat_template, str)
    with pytest.raises(ValueError, match="the GGUF file's tokenizer.chat_template: chat_template must be a string"):
        gguf_tokenizer({**metadata, "tokenizer.chat_template": template})


@pytest.mark.parametrize("dtype, stored", [(np.int32, "I32"), (np.int64, "I64"), (np.uint8, "U8"), (np.bool_, "BOOL")])
def test_a_weight_stored_as_integers_or_bools_is_refused_naming_the_tensor(hf_checkpoint, tmp_path, dtype, stored):
    """transformers' loader and numpy's astype would turn it into a float weight without a word.
    The message names the dtype the file stores (JAX, without 64-bit types, reads I64 as int32)."""
    from safetensors.numpy import load_file, save_file

    path = str(shutil.copytree(hf_checkpoint("llama2"), tmp_path / "c"))
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(dtype)
    save_file(tensors, file)
    with pytest.raises(ValueError, match=f"tensor 'model.norm.weight' in {file} has dtype {stored}, not a "
                                         "floating-point type"):
        load_model(path)


def test_a_weight_of_a_dtype_the_reader_has_no_array_for_is_refused_naming_it(hf_checkpoint, tmp_path):
    """A float8 tensor in a checkpoint without a quantization_config: safetensors' reader
    raises an AttributeError for it (numpy has no float8_e4m3fn), which the server's start-up
    does not catch, so the loader refuses it first."""
    import struct

    path = str(shutil.copytree(hf_checkpoint("llama2"), tmp_path / "c"))
    file = os.path.join(path, "model.safetensors")
    data = open(file, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header["model.norm.weight"] |= {"dtype": "F8_E4M3", "shape": [4 * header["model.norm.weight"]["shape"][0]]}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data[8 + n:])
    with pytest.raises(ValueError, match=f"tensor 'model.norm.weight' in {file} does not read as an array \\(dtype "
                                         "F8_E4M3; AttributeError"):
        load_model(path)


@pytest.mark.parametrize("bad, dtype", [(np.nan, np.float32), (np.inf, np.float32), (np.nan, np.float64),
                                        (-np.inf, np.float64)])
def test_a_weight_holding_nan_or_inf_is_refused_naming_the_tensor(hf_checkpoint, tmp_path, bad, dtype):
    """Loaded, every logit would be NaN and greedy decoding would repeat one token id: a
    damaged file, refused as a GGUF file's is (test_gguf.py)."""
    from safetensors.numpy import load_file, save_file

    path = str(shutil.copytree(hf_checkpoint("llama2"), tmp_path / "c"))
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"].astype(dtype)
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = bad
    save_file(tensors, file)
    with pytest.raises(ValueError, match=f"tensor 'model.layers.1.mlp.up_proj.weight' in {file} holds NaN or "
                                         "infinite values: the file is damaged"):
        load_model(path)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> str:
    from conftest import make_hf_checkpoint

    return make_hf_checkpoint(tmp_path_factory.mktemp("sharded"), "llama2", max_shard_size="100KB")


@pytest.mark.parametrize("index, says", [
    # a TypeError, AttributeError or KeyError naming nothing
    ("[1]", "model.safetensors.index.json must hold a JSON object, got list"),
    ('{"metadata": {}}', "weight_map must map tensor names to shard file names, got None"),
    ('{"weight_map": [1]}', "weight_map must map tensor names to shard file names, got \\[1\\]"),
    ('{"weight_map": {"model.norm.weight": 5}}', "weight_map must map tensor names to shard file names"),
    # a RecursionError from json's decoder, with a traceback
    ("[" * 100_000 + "]" * 100_000, "model.safetensors.index.json nests arrays or objects deeper than"),
])
def test_a_shard_index_that_is_not_one_is_refused_naming_it(sharded, tmp_path, index, says):
    path = _edited(sharded, str(tmp_path / "c"), "model.safetensors.index.json", lambda _: index)
    with pytest.raises(ValueError, match=says):
        load_model(path)


def test_a_tensor_in_two_shards_is_refused_not_taken_from_the_last(sharded, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = str(shutil.copytree(sharded, tmp_path / "c"))
    first, second = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[:2]
    a, b = load_file(os.path.join(path, first)), load_file(os.path.join(path, second))
    name = next(iter(a))
    save_file({**b, name: a[name] * 2}, os.path.join(path, second))
    with pytest.raises(ValueError, match=f"tensor '{name}' appears twice in checkpoint {path}"):
        load_model(path)


def _with_config(src: str, dst: str, **change) -> str:
    return _edited(src, dst, "config.json", _json_edit(**change))


def test_sizes_the_tensors_do_not_have_are_refused_before_their_buffers_are_allocated(hf_checkpoint, tmp_path):
    src = hf_checkpoint("llama2")
    # 466 TiB of embeddings (10^12 x 64 x f32, twice: untied): numpy's MemoryError, which names no
    # field, before the shapes are compared
    huge = _with_config(src, str(tmp_path / "vocab"), vocab_size=10**12)
    with pytest.raises(ValueError, match=f"checkpoint {huge} describes 476,837.2 GiB of parameters, more than the "
                                         "host's .* check its vocab_size"):
        load_model(huge)
    # 4,998 layers the tensors lack: named, but not all 44,982 of their tensors (a 2 MB message)
    deep = _with_config(src, str(tmp_path / "layers"), num_hidden_layers=5000)
    with pytest.raises(ValueError, match="lacks tensors: model.layers.2.input_layernorm.weight, .* and 44974 more$") \
            as e:
        load_model(deep)
    assert len(str(e.value)) < 600


def test_a_max_position_embeddings_no_host_could_index_names_max_model_len():
    """A config.json's max_position_embeddings becomes max_model_len; its block tables, not
    max_num_seqs, are what cannot fit: the error names the flag that lowers it."""
    model = ModelConfig("llama", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2**62)
    config = EngineConfig(model="tiny").resolved(model.max_model_len)
    with pytest.raises(ValueError, match=f"--max-model-len {2**62} is too large: the runner's host buffers"):
        check_host_buffers(config, model, np.float32)


# ---- the host's memory: a container's cgroup limit ------------------------------------

@pytest.mark.parametrize("files, limit", [
    ({"v2": "max\n"}, None),  # cgroup v2 without a limit
    ({"v2": "1073741824\n"}, 2**30),
    ({"v1": "9223372036854771712\n"}, None),  # cgroup v1 without a limit: a page-rounded 2^63
    ({"v1": "536870912\n"}, 2**29),
    ({"v2": "1073741824\n", "v1": "536870912\n"}, 2**29),  # the lower
    ({}, None),  # no cgroup files (not in a container, or not Linux)
    ({"v2": "garbage"}, None),
])
def test_host_memory_is_the_cgroup_limit_where_it_is_below_the_ram(monkeypatch, tmp_path, files, limit):
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    paths = {k: str(tmp_path / k) for k in ("v2", "v1")}
    for k, text in files.items():
        (tmp_path / k).write_text(text)
    monkeypatch.setattr(config_module, "CGROUP_MEMORY_LIMITS", (paths["v2"], paths["v1"]))
    assert host_memory_bytes() == (ram if limit is None else limit)


def _limit_host(monkeypatch, tmp_path, nbytes: int) -> None:
    (tmp_path / "memory.max").write_text(f"{nbytes}\n")
    monkeypatch.setattr(config_module, "CGROUP_MEMORY_LIMITS", (str(tmp_path / "memory.max"),))


def test_an_explicit_kv_budget_past_a_containers_limit_is_refused(monkeypatch, tmp_path):
    """On CPU the device is the host: the fit check of --kv-cache-memory is against the
    container's limit, not the RAM the machine has."""
    model = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=4, head_dim=8)
    config = EngineConfig(max_model_len=256, kv_cache_memory=3 * 2**30).resolved(4096)
    assert kvcache.num_kv_blocks_for(config, model, np.float32, weight_bytes=0) > 1
    _limit_host(monkeypatch, tmp_path, 2 * 2**30)
    with pytest.raises(ValueError, match="--kv-cache-memory/--kv-cache-memory-bytes 3221225472 bytes: .* does not "
                                         "fit in the device's 2.00 GiB"):
        kvcache.num_kv_blocks_for(config, model, np.float32, weight_bytes=0)


def test_the_cpu_default_kv_budget_is_capped_by_what_the_host_leaves(monkeypatch, tmp_path):
    """vLLM's 4 GiB CPU default, unless the host (a container's limit) leaves less beside
    the weights, the activations and a swap pool: gpu_memory_utilization of it, as an
    accelerator's budget. Too little for one max_model_len sequence is a clear error."""
    model = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=4, head_dim=8)
    per_block = kvcache.kv_cache_bytes_per_block(model, 16, np.float32)  # 8 KiB
    config = EngineConfig(max_model_len=2**18, max_num_seqs=64).resolved(2**18)
    assert kvcache.num_kv_blocks_for(config, model, np.float32, 0) == kvcache.CPU_DEFAULT_KV_BYTES // per_block + 1
    _limit_host(monkeypatch, tmp_path, 2 * 2**30)
    weights = 2**29
    assert kvcache.num_kv_blocks_for(config, model, np.float32, weights) == \
        (int(0.9 * 2 * 2**30) - weights) // per_block + 1
    swap = EngineConfig(max_model_len=2**18, max_num_seqs=64, preemption_mode="swap", swap_space=1).resolved(2**18)
    assert kvcache.num_kv_blocks_for(swap, model, np.float32, weights) == \
        (int(0.9 * 2 * 2**30) - weights - 2**30) // per_block + 1
    with pytest.raises(ValueError, match="the CPU default of 4 GiB .*, capped at what --gpu-memory-utilization 0.9 "
                                         "of the host's 2.00 GiB leaves beside 1.75 GiB of weights.* gives 6553 usable "
                                         "blocks .* max_model_len 262144 needs 16384"):
        kvcache.num_kv_blocks_for(config, model, np.float32, 7 * 2**28)


# ---- an orbax checkpoint's taxirank_checkpoint.json ----------------------------------

def test_an_f64_weight_beyond_float32s_range_is_refused_as_overflowing_not_damaged(hf_checkpoint, tmp_path):
    """Finite in the file (F64), the value overflows float32, the dtype JAX reads it as without
    64-bit types: it would load as inf, and the file is not damaged."""
    from safetensors.numpy import load_file, save_file

    path = str(shutil.copytree(hf_checkpoint("llama2"), tmp_path / "c"))
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.float64)
    tensors["model.norm.weight"][1] = -1e300
    assert np.isfinite(tensors["model.norm.weight"]).all() and np.float64(-1e300) < np.finfo(np.float32).min
    save_file(tensors, file)
    with pytest.raises(ValueError, match=f"tensor 'model.norm.weight' in {file} holds F64 values beyond float32's "
                                         "range") as e:
        load_model(path)
    assert "damaged" not in str(e.value)


@pytest.fixture(scope="module")
def orbax_dir(tmp_path_factory) -> str:
    import checkpoint

    path = str(tmp_path_factory.mktemp("orbax") / "ck")
    checkpoint.save(load_model("tiny"), path)
    return path


_LLAMA3_SCALING = [["factor", 8.0], ["high_freq_factor", 4.0], ["low_freq_factor", 1.0],
                   ["original_max_position_embeddings", 64.0]]


@pytest.mark.parametrize("change, says", [
    # each loaded: a model computing NaN, stopping on no token, or failing deep in tracing
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number > 0, got nan"),
    (dict(rope_theta=0.0), "rope_theta must be a finite number > 0"),
    (dict(eos_token_ids=[10**6]), "eos_token_id \\[1000000\\] is outside the vocabulary"),
    # int() of each item would read the string "257" as the stop ids 2, 5, 7, and 256.9 as 256
    (dict(eos_token_ids="257"), "eos_token_ids must be a token id >= 0, a list of them, or null; got '257'"),
    (dict(eos_token_ids=[256.9]), "eos_token_ids must be a token id >= 0"),
    (dict(bos_token_id=10**6), "bos_token_id 1000000 is outside the vocabulary"),
    (dict(sliding_window=0), "sliding_window must be an integer >= 1 or null"),
    (dict(architecture="gpt2"), "architecture 'gpt2' is none of llama"),
    (dict(rope_scaling=[["factor", 8.0]]), "rope_scaling must give factor, low_freq_factor"),
    (dict(rope_scaling=[*_LLAMA3_SCALING[:3], ["original_max_position_embeddings", 64.5]]),
     "original_max_position_embeddings must be an integer, got 64.5"),
    # refused already, now with config.json's words
    (dict(num_key_value_heads=3), "num_key_value_heads \\(3\\) must divide num_attention_heads \\(4\\)"),
    (dict(max_position_embeddings=0), "max_position_embeddings must be an integer >= 1, got 0"),
])
def test_an_orbax_checkpoints_model_config_gets_the_checks_of_a_config_json(orbax_dir, tmp_path, change, says):
    import checkpoint

    path = _edited(orbax_dir, str(tmp_path / "ck"), checkpoint.META,
                   lambda text: json.dumps({**json.loads(text), "model_config": {
                       **json.loads(text)["model_config"], **change}}))
    with pytest.raises(ValueError, match=f"{checkpoint.META}: bad model_config \\(.*{says}"):
        checkpoint.load(path)


@pytest.mark.parametrize("text, says", [
    # json's own error (no file named), an AttributeError and a TypeError before
    ("{", "taxirank_checkpoint.json is not valid JSON"),
    ("[1]", "taxirank_checkpoint.json must hold a JSON object, got list"),
    ('{"format": 1, "model_config": 5}', "taxirank_checkpoint.json: model_config must be an object, got 5"),
])
def test_an_orbax_checkpoints_meta_file_that_is_no_json_object_is_an_error_naming_it(orbax_dir, tmp_path, text,
                                                                                     says):
    import checkpoint

    path = _edited(orbax_dir, str(tmp_path / "ck"), checkpoint.META, lambda _: text)
    with pytest.raises(ValueError, match=f"{path}/{says}"):
        checkpoint.load(path)


def test_an_orbax_checkpoints_damaged_array_data_is_a_value_error_naming_it(orbax_dir, tmp_path):
    """tensorstore reports a failed read as a bare Exception, and the server's start-up
    catches ValueError and OSError: the loader turns it into a ValueError naming the folder."""
    import checkpoint

    path = str(shutil.copytree(orbax_dir, tmp_path / "ck"))
    data = os.path.join(path, "params", "ocdbt.process_0", "d")
    for name in os.listdir(data):
        os.truncate(os.path.join(data, name), 5)
    with pytest.raises(ValueError, match=f"{path}: its parameters do not read, the checkpoint is damaged "
                                         r"\(OUT_OF_RANGE: Error reading"):
        checkpoint.load(path)


def test_an_orbax_checkpoint_with_llama3_scaling_loads(orbax_dir, tmp_path):
    import checkpoint

    path = _edited(orbax_dir, str(tmp_path / "ck"), checkpoint.META,
                   lambda text: json.dumps({**json.loads(text), "model_config": {
                       **json.loads(text)["model_config"], "rope_scaling": _LLAMA3_SCALING}}))
    assert dict(checkpoint.load(path).config.rope_scaling)["factor"] == 8.0


def test_the_server_exits_with_one_line_naming_a_checkpoint_file_that_does_not_load(tokenizer_dir, hf_checkpoint,
                                                                                   tmp_path):
    """`python server.py --model DIR` with a checkpoint whose files do not load: exit 2 and
    one line on stderr (no traceback, no 60 lines of usage above it)."""
    import subprocess
    import sys

    path = str(shutil.copytree(hf_checkpoint("llama2"), tmp_path / "c"))
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        f.write("[1]")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "server.py"), "--model", path, "--no-warmup"],
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if "Warning" not in line and line.strip()]
    assert proc.returncode == 2 and lines == [f"server.py: error: {path}: its tokenizer files do not load "
                                              "(AttributeError: 'list' object has no attribute 'get')"], proc.stderr


def test_a_port_another_process_holds_is_one_error_line_before_the_model_loads():
    """server.py binds --host and --port before it loads and compiles the model (minutes), as
    vLLM's setup_server: a taken port is one error line at once, not a traceback after the warm-up."""
    import socket
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        proc = subprocess.run([sys.executable, os.path.join(root, "server.py"), "--model", "tiny", "--port", str(port)],
                              capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if "Warning" not in line and line.strip()]
    # one line, and no other: the model's load (and the warm-up) logs as it goes
    assert proc.returncode == 2 and lines == [f"server.py: error: --host 127.0.0.1 --port {port}: cannot listen there: "
                                              "Address already in use (is another server running there?)"], proc.stderr


def test_an_orbax_checkpoints_tokenizer_with_ids_past_its_embedding_is_refused(tokenizer_dir, tmp_path):
    """Its tokenizer files are read from the folder at each load, as a config.json folder's
    are: ids 200..290 would have no embedding row there too (load_model refuses them)."""
    import checkpoint
    from conftest import make_hf_checkpoint

    path = str(tmp_path / "ck")
    checkpoint.save(load_model(make_hf_checkpoint(tmp_path / "hf", "llama2", vocab_size=200)), path)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    with pytest.raises(ValueError, match=f"the tokenizer of '{path}': its vocabulary has 291 token ids, more than "
                                         "the model's 200 embedding rows"):
        checkpoint.load(path)


@pytest.mark.parametrize("src, says", [
    ("/nonexistent", "model '/nonexistent' is neither a built-in model"),  # (not a FileNotFoundError's traceback)
    ("tiny", "exists and is not empty"),  # (not a FileExistsError's traceback)
])
def test_the_convert_command_exits_with_one_line_naming_what_is_wrong(tmp_path, capsys, src, says):
    import checkpoint

    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "x").write_text("")
    with pytest.raises(SystemExit) as e:
        checkpoint.main(["convert", src, str(tmp_path / "dst")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and err.count("\n") == 1, err


def test_the_convert_commands_seed_past_64_bits_exits_naming_it(tmp_path, capsys):
    import checkpoint

    with pytest.raises(SystemExit) as e:  # (not an OverflowError's traceback from the PRNG key)
        checkpoint.main(["convert", "tiny", str(tmp_path / "dst"), "--seed", str(2**64)])
    assert e.value.code == 2 and "argument --seed: must be a 64-bit integer, got 18446744073709551616" in \
        capsys.readouterr().err


def test_the_convert_command_refuses_a_destination_it_cannot_create_in_one_line(tmp_path, capsys):
    import checkpoint

    (tmp_path / "file").write_text("")
    for dst, says in [("", "the destination folder's path is empty"),  # not the working folder
                      (str(tmp_path / "file" / "dst"), "Not a directory")]:
        with pytest.raises(SystemExit) as e:
            checkpoint.main(["convert", "tiny", dst])
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err and err.count("\n") == 1, err


def test_a_converted_checkpoint_keeps_its_sources_sampling_defaults(hf_checkpoint, tmp_path):
    """--generation-config auto reads the model folder's generation_config.json: the orbax
    copy carries it, so it serves the default sampling its source does."""
    import checkpoint
    from hf_config import generation_sampling_defaults

    src = str(shutil.copytree(hf_checkpoint("llama2"), tmp_path / "src"))
    with open(os.path.join(src, "generation_config.json"), "w") as f:
        json.dump({"temperature": 0.6, "top_p": 0.9, "eos_token_id": 2}, f)
    checkpoint.main(["convert", src, str(tmp_path / "ck")])
    want = generation_sampling_defaults(EngineConfig(model=src))
    assert want == {"temperature": 0.6, "top_p": 0.9}
    assert generation_sampling_defaults(EngineConfig(model=str(tmp_path / "ck"))) == want
