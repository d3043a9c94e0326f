"""The benches' flags: a nonsense value is an argparse error naming the flag, before any engine
is built or server started (each case below once crashed mid-run, or ran on silently with the
value ignored or misread), and a size given beside --tiny is the one used."""

from __future__ import annotations

import ast
import glob
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, load_bench

TRACES = os.path.join(ROOT, "tests", "fixtures", "scheduler_traces.json")  # JSON of another shape
REFUSED = [  # (bench, argv, what the error says)  # unchecked: what the flag did without its check
    ("mixed", ["--rate", "0"], "argument --rate: wants a number > 0"),  # unchecked: all at once
    ("mixed", ["--block-size", "0"], "argument --block-size: wants an integer >= 1"),  # unchecked: ZeroDivisionError
    ("mixed", ["--report", "/nonexistent"], "--report: no /nonexistent/results.json"),  # unchecked: FileNotFoundError
    ("mixed", ["--quick", "--peer"], "--quick and --peer are two presets"),  # unchecked: --quick's sizes
    ("mixed", ["--variants", ","], "--variants wants a comma-separated list of variant names"),  # unchecked: every one
    ("mixed", ["--variants", "continuous,nope"], "--variants: unknown ['nope']; choose from continuous, static"),
    ("mixed", ["--model", "/nonexistent"], "--model '/nonexistent': not one of tiny"),  # unchecked: every server failed
    ("mixed", ["--num-requests", "1"], "argument --num-requests: wants an integer >= 2"),  # unchecked: a TypeError
    # in analyze() (no short request) after every server had run
    ("mixed", ["--server-args", "'--foo"], "argument --server-args: wants flags a shell can split"),  # unchecked and
    ("mixed", ["--compare", "x=serve '{port}"], "--compare wants NAME=COMMAND, a command a shell can split"),  # next:
    # shlex's "No closing quotation" traceback once the run had begun
    ("simulate", ["--num-requests", "0"], "argument --num-requests: wants an integer >= 1"),  # unchecked: the default
    ("simulate", ["--priority-fraction", "-0.5"], "argument --priority-fraction: wants a fraction"),  # unchecked: all
    ("simulate", ["--workload", "/nonexistent.json"], "--workload takes short-long, exp, slo-mix, two-clients or a JSON"),
    ("simulate", ["--report", "--report-seqs", "8,x"], "argument --report-seqs: wants comma-separated integers"),
    ("simulate", ["--validate", "--report"], "--validate, --calibrate and --report are three runs"),
    ("simulate", ["--validate", "--workload", "exp", "--max-num-seqs", "4"],  # unchecked: ignored
     "--workload --max-num-seqs: not read by --validate"),
    ("simulate", ["--calibrate", "--tiny", "--block-size", "32"], "--block-size: not read by --calibrate"),
    ("simulate", ["--report", "--tiny"], "--tiny: not read by --report"),
    ("simulate", ["--tiny", "--report-seqs", "8"], "--report-seqs: not read by a simulation run (only by --report)"),
    ("simulate", ["--tiny", "--cost-model", "gpu-like", "--num-kv-blocks", "3"],  # unchecked: a scheduler deadlock
     "--num-kv-blocks 3 (one the null block) cannot hold the longest request"),
    ("simulate", ["--tiny", "--cost-model", "gpu-like", "--workload", "exp", "--max-model-len", "64"],
     "--max-model-len 64 cannot hold the workload's longest request"),  # unchecked: the scheduler's AssertionError
    ("simulate", ["--tiny", "--cost-model", "gpu-like", "--kv-admission", "x"], "kv_admission must be"),  # traceback
    ("offline", ["--tiny", "--max-model-len", "16"], "--max-model-len 16 cannot hold the mix's longest request"),
    ("stutter", ["--tiny", "--plot-only", "/nonexistent.json"], "--plot-only: no /nonexistent.json"),
    ("policies", ["--simulate", "gpu-like", "--repeats", "2"], "--repeats repeats the engine's runs"),  # unchecked: ignored
    ("spec", ["--workloads", "A,C"], "--workloads takes a comma-separated subset of A, B"),  # unchecked: C ran as B
    ("spec", ["--ngram-config", "{bad"], "argument --ngram-config: wants a JSON object"),
    ("step_profile", ["--settings", "default,nope"], "--settings takes a comma-separated subset"),  # unchecked: failed late, after runs
    ("step_profile", ["--sections", "roofline", "--baseline", "/nonexistent"], "--baseline wants a checkout"),
    ("attention_kernels", ["--backends", "pallas,foo"], "--backends takes a comma-separated subset of pallas, ref"),
    ("gpu_mix", ["--tiny", "--attention-backend", "flash"], "argument --attention-backend: invalid choice"),
    ("gpu_mix", ["--tiny", "--max-model-len", "16"], "--max-model-len >= 48 (its longest request), got 8 and 16"),
    ("gpu_mix", ["--tiny", "--num-requests", "1"], "--num-requests >= 2 (a short and a long half)"),  # unchecked,
    # these two: llm.generate's ValueError, and an IndexError (no short request: no p99 ratio), after the engine's build
    ("gpu_check_report", ["/nonexistent", "/nonexistent-dest"], "no work folder '/nonexistent'"),
    # unchecked: load_model's FileNotFoundError traceback (ray_routing: the server's, as a RuntimeError)
    *[(name, ["--model", "/nonexistent"], "argument --model: wants one of tiny, bench, smollm2, a checkpoint "
                                          "directory or a .gguf file, got '/nonexistent'")
      for name in ("stutter", "prefix", "structured_outputs", "spec", "ray_routing", "policies")],
    ("stutter", ["--tiny", "--dtype", "float16"], "argument --dtype: invalid choice"),  # unchecked: a traceback
    # unchecked: json's, a KeyError's or a StopIteration's traceback
    ("simulate", ["--tiny", "--cost-model", "gpu-like", "--workload", os.path.join(ROOT, "README.md")],
     f"--workload {os.path.join(ROOT, 'README.md')}: not a JSON list of requests nor bench/mixed.py's results.json "
     "(JSONDecodeError"),
    ("simulate", ["--tiny", "--cost-model", "gpu-like", "--workload", TRACES],
     f"--workload {TRACES}: not a JSON list of requests"),
    ("simulate", ["--tiny", "--cost-model", TRACES], "scheduler_traces.json: not a cost model"),
    ("simulate", ["--tiny", "--cost-model", os.path.join(ROOT, "README.md")],
     "README.md: not a cost model (simulate.py --calibrate writes one) (JSONDecodeError"),
    ("policies", ["--simulate", os.path.join(ROOT, "README.md")], "README.md: not a cost model"),
]


@pytest.mark.parametrize("name,argv,message", REFUSED, ids=[f"{n}:{' '.join(a)}" for n, a, _ in REFUSED])
def test_a_nonsense_flag_value_is_an_argparse_error_naming_it(name, argv, message, monkeypatch, capsys, tmp_path):
    bench = load_bench(name)
    argv = argv + ["--out", str(tmp_path / "out")] * (name == "simulate" and "--calibrate" not in argv)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])  # the benches whose main() reads sys.argv
    with pytest.raises(SystemExit) as e:
        bench.main(argv) if "argv" in bench.main.__code__.co_varnames else bench.main()
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # a refused run leaves no empty output folder


BROKEN = [  # (bench, flag, file name, contents, what the error says)  # unchecked: each one's traceback
    ("mixed", "--report", "results.json", "{", "JSONDecodeError"),
    ("mixed", "--report", "results.json", "[]", "TypeError"),
    ("mixed", "--report", "results.json", "{}", "KeyError: 'variants'"),
    ("mixed", "--report", "results.json", '{"variants": {"a": {}}, "settings": {}}', "KeyError: 'short'"),
    ("stutter", "--plot-only", "stutter.json", "not json", "JSONDecodeError"),
    ("stutter", "--plot-only", "stutter.json", '{"args": {}}', "KeyError: 'results'"),
    ("stutter", "--plot-only", "stutter.json", '{"results": {"off": {}}, "args": {}}', "KeyError: 'arrivals'"),
    ("stutter", "--plot-only", "stutter.json", '{"results": [], "args": []}', "TypeError"),
]


@pytest.mark.parametrize("name,flag,file,text,message", BROKEN, ids=[f"{n}:{t}" for n, _, _, t, _ in BROKEN])
def test_a_broken_json_file_to_redraw_is_one_argparse_error_line_naming_it(name, flag, file, text, message,
                                                                           monkeypatch, capsys, tmp_path):
    (tmp_path / file).write_text(text)
    argv = [flag, str(tmp_path / (file if name == "stutter" else ""))]
    monkeypatch.setattr(sys, "argv", [f"bench/{name}.py", *argv])
    with pytest.raises(SystemExit) as e:
        load_bench(name).main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith(f"{name}.py: error: {flag} {tmp_path / file}: not "), err
    assert message in err and "\n" not in err  # one line: argparse's usage (many lines of flags) would bury it


def test_prefix_sizes_given_beside_tiny_are_kept():
    prefix = load_bench("prefix")
    a = prefix.parse_args(["--tiny", "--question-len", "20", "--mix-short", "6"])
    assert (a.question_len, a.mix_short, a.system_len) == (20, 6, 96)  # given, given, --tiny's
    assert (prefix.parse_args(["--tiny"]).question_len, prefix.parse_args([]).question_len) == (8, 32)


def test_simulate_exp_workload_runs_at_a_max_model_len_that_holds_it(tmp_path):
    """--workload exp's lengths (mean 128, cap 1536) outgrow the sizes' max_model_len: unless
    --max-model-len is given, the run takes the workload's longest request."""
    simulate, workload = load_bench("simulate"), load_bench("workload")
    assert simulate.main(["--tiny", "--workload", "exp", "--cost-model", "gpu-like", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "simulate.json").read_text())
    tiny = simulate.TINY
    reqs = workload.exponential_mix(tiny.num_requests, tiny.vocab_size, prompt_len=tiny.prompt_len)
    assert out["config"]["max_model_len"] == max(len(r.prompt_token_ids) + r.max_tokens for r in reqs) > 64
    assert out["output_tokens"] == sum(r.max_tokens for r in reqs)  # every request ran to its end


def test_attention_kernels_quick_step_model_is_a_valid_config():
    """--quick's toy step model: Llama-3-8B's config.json scaled down, its special tokens inside
    the toy vocabulary (Llama-3's 128001 once made every --quick step stage fail at load)."""
    from model import ModelConfig

    toy = load_bench("attention_kernels").TOY_HF
    cfg = ModelConfig.from_hf(toy)
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.hidden_size) == (1024, 2, 256)
    assert max(toy["bos_token_id"], toy["eos_token_id"]) < cfg.vocab_size


SCRIPTS = sorted(os.path.relpath(p, ROOT) for p in [*glob.glob(f"{ROOT}/bench/*.py"), f"{ROOT}/serve_ray.py",
                                                    f"{ROOT}/server.py"]
                 if 'if __name__ == "__main__":' in open(p).read())
HELP_RUN = """import os, runpy, sys
path = sys.argv[1]
sys.path.insert(0, os.path.dirname(path))  # as `python path` does
sys.argv = [path, "--help"]
try:
    runpy.run_path(path, run_name="__main__")
except SystemExit as e:
    assert e.code == 0, e.code
print(sorted(m for m in ("jax", "ray", "engine") if m in sys.modules))
"""


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_answers_before_jax_or_ray_loads(script):
    """Every script's --help answers before it imports JAX, Ray or the engine (seconds)."""
    out = subprocess.run([sys.executable, "-c", HELP_RUN, os.path.join(ROOT, script)], capture_output=True,
                         text=True, check=True, cwd=ROOT)
    assert "usage:" in out.stdout and out.stdout.splitlines()[-1] == "[]", out.stdout[-300:]


def _top_level_names(path: str) -> set[str]:
    """The names a module binds at its top level (also under a top-level if/try/with)."""
    names: set[str] = set()
    body = list(ast.parse(open(path).read()).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            body += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            body += [s for h in getattr(node, "handlers", []) for s in h.body]
    return names


def test_every_name_a_bench_imports_from_this_repository_exists():
    """A bench imports names from bench/'s library, from other benches and from the engine's
    modules, some inside functions; a name moved or removed there breaks only a run, and some
    runs no test starts (tp.py's runs on a GPU check's machine with more than one GPU)."""
    local = {os.path.splitext(os.path.basename(p))[0]: p for d in (ROOT, os.path.join(ROOT, "bench"))
             for p in glob.glob(os.path.join(d, "*.py"))}
    missing = []
    for path in sorted(glob.glob(os.path.join(ROOT, "bench", "*.py"))):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in local:
                defined = _top_level_names(local[node.module])
                missing += [f"{os.path.basename(path)}:{node.lineno}: {node.module}.{a.name}"
                            for a in node.names if a.name != "*" and a.name not in defined]
    assert not missing
