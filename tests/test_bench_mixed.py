"""bench/mixed.py at a tiny size: every variant starts a real server (the tiny model), streams
a handful of requests, and results.json, report.md and the plots say what the full run does."""

from __future__ import annotations

import json
import os

import pytest
from conftest import load_bench


def _load():
    return load_bench("mixed")


def test_parse_metrics_reads_taxirank_and_vllm_names():
    mixed = _load()
    taxirank = mixed.pick(mixed.parse_metrics(
        "# HELP taxirank:num_requests_running Requests in the running batch.\n"
        "taxirank:num_requests_running 3.0\ntaxirank:num_requests_waiting 5.0\n"
        "taxirank:kv_cache_usage_perc 0.5\ntaxirank:num_preemptions_total 2.0\ntaxirank:num_kv_blocks 1024.0\n"
        'taxirank:num_requests_waiting_by_reason{reason="kv_blocks"} 4.0\n'
        'taxirank:num_requests_waiting_by_reason{reason="max_num_seqs"} 1.0\n'))
    assert taxirank == {"running": 3.0, "waiting": 5.0, "kv_usage": 0.5, "preemptions": 2.0, "num_kv_blocks": 1024.0,
                        "waiting_by_reason": {"kv_blocks": 4.0, "max_num_seqs": 1.0}}
    vllm = mixed.pick(mixed.parse_metrics(
        'vllm:num_requests_running{model_name="m"} 7.0\nvllm:num_requests_waiting{model_name="m"} 1.0\n'
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.25\nvllm:num_preemptions_total{model_name="m"} 0.0\n'))
    assert vllm == {"running": 7.0, "waiting": 1.0, "kv_usage": 0.25, "preemptions": 0.0, "num_kv_blocks": None,
                    "waiting_by_reason": {}}


@pytest.mark.timeout(300)
def test_tiny_run_writes_every_variant_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    mixed = _load()
    import mixed_report  # bench/mixed.py put bench/ on sys.path for it

    res = mixed.main(["--model", "tiny", "--num-requests", "6", "--short", "2", "--long", "8", "--prompt-len", "4,8",
                      "--max-model-len", "32", "--max-num-seqs", "4", "--kv-budget-seqs", "2",
                      "--server-args", "--max-num-batched-tokens 32", "--out", str(tmp_path),
                      "--jax-cache", os.environ["JAX_COMPILATION_CACHE_DIR"]])  # the tests' (conftest)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["analysis"] == json.loads(json.dumps(res["analysis"]))
    names = ["continuous", "static"] + [f"{m}/{n}" for m in mixed.ADMISSION_MODES for n in ("full", "half")]
    assert list(on_disk["variants"]) == names
    assert {"cpu", "cores", "jax"} <= set(on_disk["machine"])
    for name, v in on_disk["variants"].items():
        assert "error" not in v, (name, v.get("error"))
        assert v["errors"] == 0 and v["exact_lengths"], (name, v["first_errors"])
        assert v["token_timing"] == "logprobs", "random tiny tokens mostly decode to no text"
        assert v["output_tokens"] == 3 * 2 + 3 * 8 and v["output_tokens_per_s"] > 0
        for cls in ("short", "long"):
            c = v[cls]
            assert c["n"] == c["n_ok"] == 3, (name, cls)
            assert {"mean", "p50", "p99"} <= set(c["itl"]) and {"p50", "p90", "p99"} <= set(c["e2e"])
            assert 0 < c["ttft"]["p50"] <= c["e2e"]["p50"], (name, cls)
        m = v["metrics"]
        assert m["samples"] >= 2 and set(m["series"]) == {"running", "waiting", "kv_usage", "preemptions",
                                                           "waiting_by_reason"}
        assert m["preemptions"] is not None and set(m["waiting_by_reason_s"]) >= {"kv_blocks", "max_num_seqs"}
        assert len(v["timeline"]["t"]) == m["samples"] == len(v["timeline"]["kv_usage"])
        assert len(v["per_request"]) == 6
        # the server's CPU time was read (from /proc), not skipped; a tiny run may take < 1 clock tick
        assert isinstance(v["load"]["server_cpu_s"], float) and v["startup_s"] > 0
        assert v["load"]["cores"] == os.cpu_count()
    budget = on_disk["settings"]["kv_budget_blocks"]
    assert budget == 2 * 2 + 1
    for mode in mixed.ADMISSION_MODES:  # the same tight budget at both lengths
        full, half = on_disk["variants"][f"{mode}/full"], on_disk["variants"][f"{mode}/half"]
        assert full["flags"]["num_kv_blocks"] == half["flags"]["num_kv_blocks"] == budget
        assert (full["flags"]["max_model_len"], half["flags"]["max_model_len"]) == (32, 16)
        assert full["metrics"]["num_kv_blocks"] == budget - 1
    an = on_disk["analysis"]
    assert set(an["halving"]) == set(mixed.ADMISSION_MODES) and "continuous_vs_static" in an
    for h in an["halving"].values():
        assert h["short_p99_e2e_full"] > 0 and h["short_p99_e2e_half"] > 0
        # the verdict is the one its figures give (the report states both)
        assert h["fell_sharply"] == (h["fall"] >= mixed_report.SHARP)
        assert h["seed_rule_holds"] == (h["fell_sharply"] == (h["dominant_wait_reason_full"] == "kv_blocks"))
    assert on_disk["plots"] == ["cdf_short_e2e.png"] + [f"timeline-{n.replace('/', '-')}.png" for n in names]
    for p in on_disk["plots"]:
        assert (tmp_path / p).stat().st_size > 1000, p
    report = (tmp_path / "report.md").read_text()
    assert "## Answer" in report and "reserve-max-len" in report and "## Machine" in report
    (tmp_path / "report.md").unlink()
    again = mixed.main(["--report", str(tmp_path)])  # re-rendered from results.json alone
    assert json.loads(json.dumps(again["analysis"])) == on_disk["analysis"]
    assert (tmp_path / "report.md").read_text() == report
