"""Tensor parallelism on forced CPU devices: the same greedy tokens at TP 1, 2 and 4, and
each device holding 1/N of the sharded weights and of the KV cache.

JAX fixes its device count when it starts, so the multi-device runs happen in one child
process (this file run as a script) with XLA_FLAGS=--xla_force_host_platform_device_count=8,
as MaxText and tpu-inference test; the parent builds the checkpoints and checks the report.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each workload in one run: 3 prompts over 4 slots, a KV cache too small for all of them
# (preemption), chunked prefill with an 8-token budget (a 21-token prompt takes 3 steps).
PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37], [1, 100, 200, 150, 250], [1] + list(range(40, 60))]
MAX_TOKENS = 10
BASE = dict(max_num_seqs=4, max_model_len=32, block_size=4, num_kv_blocks=14, enable_chunked_prefill=True,
            max_num_batched_tokens=8, warmup=False)


def _worker(spec: dict) -> dict:
    """Child process: run every case in spec, report tokens and per-device bytes."""
    sys.path.insert(0, ROOT)
    import jax
    from conftest import pinned_decode_buckets
    from flax import nnx

    from llm import LLM, SamplingParams
    from parallel import bytes_per_device

    # A case marked one_decode_bucket pads every decode step to max_num_seqs rows: one decode
    # program instead of one per row bucket (1, 2, 4): decode programs are a quarter of a cold
    # child's compiles.
    # The rows a step computes are what the buckets change, not what TP splits (heads, the
    # hidden size); the llama cases at TP 1, 2, 4 and the two-process run keep every bucket.
    one_bucket = [False]
    report = {}
    with pinned_decode_buckets(lambda cfg: (cfg.max_num_seqs,) if one_bucket[0] else None):
        for name, case in spec["cases"].items():
            t0 = time.perf_counter()
            one_bucket[0] = case.get("one_decode_bucket", False)
            llm = LLM(case["model"], log=lambda s: None, compilation_cache_dir=spec["cache"], **{**BASE, **case["kw"]})
            outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
            runner = llm.engine.runner
            params = nnx.state(llm.engine.loaded.model, nnx.Param)
            split = [x for x in jax.tree.leaves(params) if len(x.sharding.device_set) > 1
                     and not x.sharding.is_fully_replicated]
            report[name] = dict(
                tokens=[o.outputs[0].token_ids for o in outs],
                preemptions=llm.stats.num_preemptions,
                backend=runner.backend.name,
                # bytes of the split weights / of the whole cache: on each device, and in all
                weight_split_total=sum(x.nbytes for x in split),
                weight_split_per_device=sorted(set(bytes_per_device(split).values())),
                num_split_weights=len(split),
                kv_total=sum(x.nbytes for x in jax.tree.leaves(runner.kv_caches)),
                kv_per_device=sorted(set(bytes_per_device(runner.kv_caches).values())),
                kv_devices=len(bytes_per_device(runner.kv_caches)),
                seconds=round(time.perf_counter() - t0, 1),
            )
            if case.get("prompt_logprobs"):  # the prompt-logprob program on the sharded weights
                report[name]["prompt_logprobs"] = _prompt_logprobs(llm)
            if case.get("sampled"):  # seeded random sampling: the verifier's rejection rule reads a draft's q
                outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7 + i,
                                                             ignore_eos=True) for i in range(len(PROMPTS))])
                report[name]["sampled_tokens"] = [o.outputs[0].token_ids for o in outs]
                report[name]["spec"] = [llm.stats.spec_decode_num_draft_tokens,
                                        llm.stats.spec_decode_num_accepted_tokens_per_pos]
    if "orbax" in spec:  # restored onto a 2-device mesh, gathered: the same bits as the source
        import numpy as np

        import checkpoint
        from model_loader import load_model
        from parallel import make_mesh

        src = nnx.to_flat_state(nnx.state(load_model(spec["orbax"]["src"]).model, nnx.Param))
        got = dict(nnx.to_flat_state(nnx.state(checkpoint.load(spec["orbax"]["dst"], mesh=make_mesh(2)).model,
                                               nnx.Param)))
        report["orbax_tp2_bit_identical"] = all(
            np.array_equal(np.asarray(v.get_value()), np.asarray(got[p].get_value())) for p, v in src)
    return report


def _prompt_logprobs(llm) -> list[list[tuple[float, int, list[int]]]]:
    """Each prompt token's (logprob, rank, top-2 ids) after the ones before it, per prompt."""
    from engine import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))
    return [[(lp.logprob, lp.rank, [t for t, _ in lp.top]) for lp in o.prompt_logprobs[1:]] for o in outs]


def assert_same_prompt_logprobs(got: list, want: list) -> None:
    assert len(got) == len(want) == len(PROMPTS)
    for g, w, p in zip(got, want, PROMPTS):
        assert len(g) == len(w) == len(p) - 1
        np.testing.assert_allclose([x[0] for x in g], [x[0] for x in w], atol=1e-4)
        assert [x[1:] for x in g] == [x[1:] for x in w]


def host_devices_env(n: int) -> dict[str, str]:
    """The environment of a child with n forced CPU devices: the flag added to this
    process's XLA_FLAGS (conftest's compile setting), not replacing them."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


def run_worker(spec: dict, devices: int = 8, timeout: float = 900) -> dict:
    env = host_devices_env(devices)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), json.dumps(spec)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tp_report(tmp_path_factory):
    import checkpoint
    from conftest import jax_test_cache_dir, make_hf_checkpoint
    from model_loader import load_model

    d = tmp_path_factory.mktemp("tp")
    models = {
        "llama": make_hf_checkpoint(d / "llama", "llama2"),  # GQA: 4 query heads over 2 KV heads
        "qwen2": make_hf_checkpoint(d / "qwen2", "qwen2"),  # q/k/v biases, tied embeddings
        # qk-norm, tied embeddings, one KV head: copied to every device at TP 2 and 4
        "qwen3": make_hf_checkpoint(d / "qwen3", "qwen3", tie_word_embeddings=True),
    }
    # Every family at TP 1, 2, 4 (continuous); static scheduling and the Pallas kernels
    # (interpret mode) at one TP size each, against the same TP 1 tokens: greedy tokens do
    # not depend on the schedule, and the kernels match the jnp reference (test_kernels.py).
    cases = {f"{m}-tp{tp}": dict(model=path, kw=dict(tensor_parallel_size=tp), prompt_logprobs=True)
             for m, path in models.items() for tp in (1, 2, 4)}
    cases["llama-static-tp4"] = dict(model=models["llama"], kw=dict(tensor_parallel_size=4, scheduling="static"))
    # orbax, saved from a single device, loaded onto 4 (KV heads copied after loading)
    orbax_dir = str(d / "llama-orbax")
    checkpoint.save(load_model(models["llama"]), orbax_dir)
    cases["llama-orbax-tp4"] = dict(model=orbax_dir, kw=dict(tensor_parallel_size=4))
    cases["llama-pallas-tp2"] = dict(model=models["llama"], kw=dict(tensor_parallel_size=2, attention_backend="pallas"))
    # an 8-bit KV cache: values and their scales split over KV heads together
    for tp in (1, 4):
        cases[f"llama-kvint8-tp{tp}"] = dict(model=models["llama"], kw=dict(tensor_parallel_size=tp, kv_cache_dtype="int8"))
    # int8 weights (codes and per-channel scales split together) over an int8 KV cache
    for tp in (1, 2, 4):
        cases[f"llama-wint8-tp{tp}"] = dict(model=models["llama"], kw=dict(tensor_parallel_size=tp,
                                                                           kv_cache_dtype="int8", quantization="int8"))
    # fp8 weights: codes split, one scale per tensor replicated (computed from the whole tensor)
    for tp in (1, 4):
        cases[f"llama-wfp8-tp{tp}"] = dict(model=models["llama"], kw=dict(tensor_parallel_size=tp, quantization="fp8"))
    # a draft model (other weights: some drafts rejected) runs whole on one device beside a
    # target sharded over the mesh; also from a converted checkpoint, whose restore places it
    # on the default device explicitly
    draft = make_hf_checkpoint(d / "llama-draft", "llama2", seed=1)
    draft_orbax = str(d / "llama-draft-orbax")
    checkpoint.save(load_model(draft), draft_orbax)
    for name, tp, path in (("draft-tp1", 1, draft), ("draft-tp4", 4, draft), ("draft-orbax-tp4", 4, draft_orbax)):
        cases[f"llama-{name}"] = dict(model=models["llama"], sampled=True, kw=dict(
            tensor_parallel_size=tp, speculative_config={"method": "draft_model", "model": path,
                                                         "num_speculative_tokens": 3}))
    for name, case in cases.items():
        case["one_decode_bucket"] = name not in ("llama-tp1", "llama-tp2", "llama-tp4")
    report = run_worker({"cases": cases, "cache": jax_test_cache_dir(),
                         "orbax": {"src": models["llama"], "dst": orbax_dir}})
    return {**report, "models": models}


@pytest.mark.parametrize("model", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_identical_at_tp_1_2_4(tp_report, model):
    ref = tp_report[f"{model}-tp1"]
    assert ref["preemptions"] > 0, "the workload must preempt"
    for tp in (2, 4):
        got = tp_report[f"{model}-tp{tp}"]
        assert f"tp={tp}" in got["backend"]
        assert got["tokens"] == ref["tokens"], f"{model} tp={tp}"
        assert_same_prompt_logprobs(got["prompt_logprobs"], ref["prompt_logprobs"])


def test_static_scheduling_and_pallas_kernels_identical_under_tp(tp_report):
    assert tp_report["llama-static-tp4"]["tokens"] == tp_report["llama-tp1"]["tokens"]
    pallas = tp_report["llama-pallas-tp2"]
    assert pallas["backend"].startswith("pallas") and pallas["tokens"] == tp_report["llama-tp1"]["tokens"]


def test_orbax_checkpoint_loads_bit_identical_onto_another_tp_size(tp_report):
    assert tp_report["orbax_tp2_bit_identical"]
    assert tp_report["llama-orbax-tp4"]["tokens"] == tp_report["llama-tp1"]["tokens"]


def test_orbax_save_then_load_is_bit_identical(tmp_path):
    import numpy as np
    from flax import nnx

    import checkpoint
    from model_loader import load_model

    src = load_model("tiny", "bfloat16")
    checkpoint.main(["convert", "tiny", str(tmp_path / "ck"), "--dtype", "bfloat16"])
    got = checkpoint.load(str(tmp_path / "ck"))
    assert got.config == src.config and got.dtype == src.dtype
    a = nnx.to_flat_state(nnx.state(src.model, nnx.Param))
    b = dict(nnx.to_flat_state(nnx.state(got.model, nnx.Param)))
    assert len(a) == len(b)
    for p, v in a:
        x, y = np.asarray(v.get_value()), np.asarray(b[p].get_value())
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), p
    with pytest.raises(FileExistsError):
        checkpoint.save(src, str(tmp_path / "ck"))
    meta_path = tmp_path / "ck" / checkpoint.META
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "model_config": {**meta["model_config"], "hidden_size": "wide"}}))
    with pytest.raises(ValueError, match="bad model_config|parameters do not match"):
        checkpoint.load(str(tmp_path / "ck"))
    meta_path.write_text(json.dumps({**meta, "format": 99}))
    with pytest.raises(ValueError, match="format"):
        checkpoint.load(str(tmp_path / "ck"))


def test_parallel_flags_are_checked_where_they_enter():
    from config import EngineConfig
    from parallel import make_mesh

    multi = dict(tensor_parallel_size=2, num_processes=2)
    for bad, says in ((dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
                      (multi, "go together"), (dict(distributed_coordinator="h:1"), "go together"),
                      # without a coordinator, that is what is missing, whatever the TP size
                      (dict(num_processes=2), "go together"),
                      (dict(distributed_coordinator="nohost", **multi), "must be HOST:PORT"),
                      (dict(distributed_coordinator="h:99999", **multi), "must be HOST:PORT"),
                      (dict(distributed_coordinator="h:1", process_id=2, **multi), r"process_id must be in \[0, "),
                      # the mesh spans every process's devices (make_mesh): at least one per process
                      (dict(distributed_coordinator="h:1", num_processes=3, tensor_parallel_size=2),
                       r"tensor_parallel_size \(2\) is smaller than num_processes \(3\)")):
        with pytest.raises(ValueError, match=says):
            EngineConfig(**bad)
    EngineConfig(distributed_coordinator="10.0.0.1:1234", process_id=1, **multi)
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        make_mesh(64)  # this pytest process has one CPU device


def test_a_coordinator_port_in_use_or_nobody_listening_is_a_clear_start_up_error():
    import socket

    import distributed
    from config import EngineConfig

    with socket.socket() as taken:  # (jaxlib's service crashes the process on a taken port)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = EngineConfig(distributed_coordinator=f"127.0.0.1:{port}", tensor_parallel_size=2, num_processes=2)
        with pytest.raises(OSError, match=f"port {port} of --distributed-coordinator is in use"):
            distributed.initialize(config, log=lambda s: None)
        distributed.wait_for_coordinator(f"127.0.0.1:{port}", 5)  # a follower finds it listening
    # and says so when nothing listens there (process 0 not started), not jax's "another task died"
    with pytest.raises(OSError, match=f"no coordination service at --distributed-coordinator 127.0.0.1:{port} "
                                      r"after 0.05 s \(.*\): start process 0"):
        distributed.wait_for_coordinator(f"127.0.0.1:{port}", 0.05)


class _KeyValueStore:
    """jax.distributed's key-value store as check_same_config uses it, shared by threads."""

    def __init__(self) -> None:
        import threading

        self.values: dict[str, bytes] = {}
        self.changed = threading.Condition()

    def key_value_set_bytes(self, key: str, value: bytes) -> None:
        with self.changed:
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get_bytes(self, key: str, timeout_ms: int) -> bytes:
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_ms / 1000):
                raise RuntimeError("DEADLINE_EXCEEDED: not posted yet")
            return self.values[key]


def _check_both(configs: list) -> list:
    """check_same_config on process 0 and 1 at once: what each raised (None: nothing)."""
    from concurrent.futures import ThreadPoolExecutor

    from distributed import check_same_config

    store = _KeyValueStore()
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(check_same_config, c, store, i, 2) for i, c in enumerate(configs)]
        return [f.exception(timeout=10) for f in futures]


def test_processes_started_with_other_engine_flags_are_refused_on_both_sides():
    from config import EngineConfig

    multi = dict(model="tiny", tensor_parallel_size=4, num_processes=2, distributed_coordinator="h:1")
    first = EngineConfig(**multi, max_num_seqs=4, compilation_cache_dir="/a")
    # its rank and its own cache folder may differ
    assert _check_both([first, EngineConfig(**multi, max_num_seqs=4, process_id=1, compilation_cache_dir="/b")]) \
        == [None, None]
    says = ("process 1 was started with other engine flags than process 0: --seed 3 (process 0: 0); "
            "--max-num-seqs 8 (process 0: 4); --block-size 8 (process 0: 16)")
    errors = _check_both([first, EngineConfig(**multi, max_num_seqs=8, seed=3, block_size=8, process_id=1)])
    assert [type(e) for e in errors] == [ValueError, ValueError], errors
    assert all(str(e).startswith(says) for e in errors), errors


def test_a_draft_model_beside_a_sharded_target_gives_the_tokens_and_acceptance_of_tp_1(tp_report):
    ref, plain = tp_report["llama-draft-tp1"], tp_report["llama-tp1"]
    for got in (tp_report["llama-draft-tp4"], tp_report["llama-draft-orbax-tp4"]):
        assert got["tokens"] == ref["tokens"] == plain["tokens"]  # greedy: speculation changes no token
        assert got["sampled_tokens"] == ref["sampled_tokens"]
        assert got["spec"] == ref["spec"]
    drafted, accepted = ref["spec"]
    assert drafted > 0 and 0 < sum(accepted) < drafted, ref["spec"]  # drafts ran, some were rejected


def test_an_int8_kv_cache_gives_the_same_tokens_at_tp_4_as_at_tp_1(tp_report):
    ref, got = tp_report["llama-kvint8-tp1"], tp_report["llama-kvint8-tp4"]
    assert ref["preemptions"] > 0 and got["tokens"] == ref["tokens"]


def test_int8_weights_and_kv_give_the_same_tokens_at_tp_2_and_4_as_at_tp_1(tp_report):
    ref = tp_report["llama-wint8-tp1"]
    assert ref["preemptions"] > 0
    for tp in (2, 4):
        assert tp_report[f"llama-wint8-tp{tp}"]["tokens"] == ref["tokens"], tp


def test_fp8_weights_give_the_same_tokens_at_tp_4_as_at_tp_1(tp_report):
    ref, got = tp_report["llama-wfp8-tp1"], tp_report["llama-wfp8-tp4"]
    assert ref["preemptions"] > 0 and got["tokens"] == ref["tokens"]


@pytest.mark.parametrize("case,tp", [("llama-tp2", 2), ("llama-tp4", 4), ("qwen3-tp4", 4), ("llama-kvint8-tp4", 4),
                                     ("llama-wint8-tp2", 2), ("llama-wint8-tp4", 4), ("llama-wfp8-tp4", 4)])
def test_each_device_holds_one_nth_of_weights_and_kv_cache(tp_report, case, tp):
    r = tp_report[case]
    # every q/k/v/o/gate/up/down kernel (stacked over layers) and the embedding at least
    assert r["num_split_weights"] >= 8
    assert r["weight_split_per_device"] == [r["weight_split_total"] // tp]
    assert r["kv_devices"] == tp and r["kv_per_device"] == [r["kv_total"] // tp]


def test_tp_size_the_heads_do_not_allow_is_refused():
    from model_loader import BUILTIN_MODELS
    from parallel import kv_head_replicas

    cfg = BUILTIN_MODELS["tiny"]  # 4 query heads, 2 KV heads
    assert kv_head_replicas(cfg, 2) == 1 and kv_head_replicas(cfg, 4) == 2
    with pytest.raises(ValueError, match="attention heads"):
        kv_head_replicas(cfg, 3)
    with pytest.raises(ValueError, match="attention heads"):
        kv_head_replicas(cfg, 8)


# Child process (4 CPU devices): one GGUF Q8_0 file at TP 4, served natively (refused) and
# dequantized (loads), and natively at TP 2 (loads); each outcome as a line of JSON.
_GGUF_TP_CHILD = """
import json, sys
from flax import nnx
import jax
from llm import LLM
out = {}
for tp, quant in ((4, "gguf"), (4, None), (2, "gguf")):
    try:
        llm = LLM(sys.argv[1], log=lambda s: None, quantization=quant, tensor_parallel_size=tp, warmup=False,
                  max_num_seqs=2, max_model_len=32, num_kv_blocks=8)
        leaves = jax.tree.leaves(nnx.state(llm.engine.loaded.model, nnx.Param))
        out[f"{quant}-tp{tp}"] = [sorted({len(x.sharding.device_set) for x in leaves}),
                                  sum(not x.sharding.is_fully_replicated for x in leaves)]
    except ValueError as e:
        out[f"{quant}-tp{tp}"] = str(e)
print(json.dumps(out))
"""


def test_tp_that_would_cut_a_gguf_block_is_refused_and_one_that_does_not_loads(hf_checkpoint, tmp_path):
    """A GGUF Q8_0/Q4 weight keeps 32 input features per block (one scale each): a TP split
    of a row-parallel kernel's input features must fall on block edges. The tiny llama's
    o_proj has 4 heads x 16 = 64 input features, 2 blocks: TP 4 would give each device half
    a block, so serving the blocks natively at TP 4 is refused by name; the same file
    dequantized (float weights, no blocks) loads at TP 4, and natively at TP 2 (one block each)."""
    from test_gguf import write_gguf

    path = write_gguf(hf_checkpoint("llama2"), str(tmp_path / "m.q8_0.gguf"), "Q8_0")
    env = {**host_devices_env(4), "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", _GGUF_TP_CHILD, path], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    refused = got["gguf-tp4"]
    assert isinstance(refused, str), got
    assert "tensor_parallel_size 4 cannot split" in refused and "o_proj" in refused and "q8_0" in refused, refused
    # on every device, the kernels (codes and block scales natively) split: >= 7 linears
    assert got["None-tp4"][0] == [4] and got["None-tp4"][1] >= 7, got
    assert got["gguf-tp2"][0] == [2] and got["gguf-tp2"][1] >= 7, got


def _host(pid: int, port: int, model: str, cache: str) -> None:
    """Child process `pid` of a 2-process group (2 CPU devices each, TP 4 across both):
    process 0 prints the tokens, then keeps generating until the group fails."""
    sys.path.insert(0, ROOT)
    from llm import LLM, SamplingParams

    llm = LLM(model, log=lambda s: None, compilation_cache_dir=cache, tensor_parallel_size=4,
              distributed_coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=pid, **BASE)
    if pid > 0:
        llm.engine.follow()
        return
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    # the follower runs the prompt-logprob program too (its targets travel with the step)
    print(json.dumps([[o.outputs[0].token_ids for o in outs], _prompt_logprobs(llm)]), flush=True)
    while True:
        llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_tp4_same_tokens_and_a_dead_process_ends_the_other(tp_report):
    from conftest import jax_test_cache_dir

    model = tp_report["models"]["llama"]
    env = host_devices_env(2)
    port, cache = _free_port(), jax_test_cache_dir()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--host", str(i), str(port), model, cache],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in (0, 1)]
    try:
        line = ""
        while not line.startswith("[["):  # gloo logs its connections on stdout too
            line = procs[0].stdout.readline()
            assert line, procs[0].stderr.read()[-3000:]
        tokens, prompt_logprobs = json.loads(line)
        assert tokens == tp_report["llama-tp1"]["tokens"]
        assert_same_prompt_logprobs(prompt_logprobs, tp_report["llama-tp1"]["prompt_logprobs"])
        # SIGTERM to the follower while process 0 is generating (as Ctrl-C, or any step the
        # follower cannot run): it leaves at once, and process 0 must fail, not wait forever
        procs[1].send_signal(signal.SIGTERM)
        rc = procs[0].wait(timeout=120)
        err = procs[0].stderr.read()
        assert rc != 0 and "another task died" in err, err[-3000:]
    finally:
        for p in procs:
            p.kill()
            p.wait()


if __name__ == "__main__":
    if sys.argv[1] == "--host":
        _host(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
    else:
        print(json.dumps(_worker(json.loads(sys.argv[1]))))
