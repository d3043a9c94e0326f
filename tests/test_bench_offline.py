"""bench/offline.py at its --tiny size: every section runs, and the JSON it writes says
what the full run reports (ratios next to their step-count ideals and targets)."""

from __future__ import annotations

import json

import pytest
from conftest import load_bench as _load


def test_seed_mix_is_the_seeds_exercise():
    common = _load("common")
    reqs = common.seed_mix(100, 32000)
    assert sorted({r.max_tokens for r in reqs}) == [16, 512]
    assert sum(r.max_tokens == 16 for r in reqs) == 50
    assert all(32 <= len(r.prompt_token_ids) <= 256 for r in reqs)
    assert reqs == common.seed_mix(100, 32000), "the workload is fixed by its seed"
    exp = common.exponential_mix(300, 32000)
    assert all(1 <= r.max_tokens <= 1536 for r in exp)
    assert common.percentile([1, 2, 3, 4], 50) == 2.5 and common.percentile([5], 99) == 5


@pytest.mark.timeout(120)
def test_tiny_run_writes_every_section(tmp_path):
    offline = _load("offline")
    out = tmp_path / "offline.json"
    offline.main(["--tiny", "--out", str(out)])
    res = json.loads(out.read_text())
    assert {"cpu", "cores", "jax", "transformers", "torch"} <= set(res["machine"])
    assert set(res["sections"]) == set(offline.SECTIONS)
    for name, sec in res["sections"].items():
        assert "error" not in sec, (name, sec.get("error"))
        assert sec["ratios"], name
        for r in sec["ratios"]:
            assert r["measured"] > 0, (name, r)
            assert r["ideal"] is None or r["ideal"] > 0, (name, r)
            assert r["pass"] is None or r["pass"] == (r["measured"] >= r["target"]), (name, r)
    mix = res["sections"]["mix32"]["runs"]
    assert set(mix) == {"continuous", "static"}
    for run in mix.values():
        assert run["output_tokens"] == run["stats"]["generation_tokens"]
        assert run["stats"]["num_preemptions"] == 0, "KV is sized so that it never limits"
        assert run["short_completion_s"]["p99"] > 0
    # The schedules differ as the seed says: static pads finished slots, continuous refills them.
    assert mix["static"]["stats"]["num_steps"] > mix["continuous"]["stats"]["num_steps"]
    assert mix["static"]["slot_utilization"] < mix["continuous"]["slot_utilization"]
    peers = res["sections"]["peers"]
    assert {"hf_generate", "hf_continuous"} <= set(peers["runs"])
    assert all(v == 1.0 for v in peers["greedy_agreement"].values()), "taxirank and transformers run one model"
