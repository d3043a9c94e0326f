"""bench/gpu_check_report.py judges what the GPU check measured: only decode cases that
read >= 0.5 GiB at context >= 2k and batch >= 16 count against the copy bandwidth, and a
stage that timed out or never ran is reported as such, not silently dropped."""

from __future__ import annotations

import json

from conftest import load_bench

# Loaded by path (bench/ is scripts, not a package).
report = load_bench("gpu_check_report")


def _decode(batch, ctx, judged, pct_copy):
    return {"batch": batch, "context": ctx, "kv_bytes": batch * ctx * 4096, "judged": judged,
            "pallas": {"us": 100.0, "gbps": 3000.0, "pct_peak": pct_copy * 0.9, "pct_copy": pct_copy,
                       "config": "w4/s2/k64"}}


def test_targets_and_stages(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "stages.tsv").write_text("smoke\t0\t20\t35\ntests\t0\t40\t45\nkernels\t124\t75\t75\n")
    (work / "kernels.log").write_text("decode ...\nKeyboardInterrupt\n")
    (work / "tests.log").write_text("....\n===== 30 passed, 2 deselected in 39.0s =====\n")
    (work / "kernels.json").write_text(json.dumps({"meta": {}, "copy": [
        {"bytes": 1, "copy_gbps": 4300.0, "read_gbps": 4000.0, "copy_pct_peak": 89.6}], "decode": [
        _decode(1, 512, False, 5.0),       # small: not judged, its 5% must not count
        _decode(16, 2048, False, 10.0),    # 0.125 GiB: not judged either
        _decode(64, 2048, True, 62.0),
        _decode(256, 8192, True, 80.0),
        _decode(256, 512, True, 30.0)]}))  # judged, but context < 2k: not a target case
    (work / "step.json").write_text(json.dumps({"step": [
        {"backend": "pallas", "batch": 256, "context": 1024, "step_ms": 10.0, "tokens_per_s": 25600.0,
         "roofline_ms": 6.5, "pct_roofline": 65.0}]}))
    res = report.build(str(work), "gpu")
    t = res["targets"]
    assert t["decode_attention_pct_copy"]["cases"] == 2
    assert t["decode_attention_pct_copy"]["worst_pct_copy"] == 62.0
    assert t["decode_attention_pct_copy"]["target_50"] == "MET"
    assert t["decode_attention_pct_copy"]["stretch_75"] == "MISSED"
    assert t["step_b256_pct_roofline"]["target_70"] == "MISSED"
    assert "mix_tok_s_ratio" not in t  # the mix never ran: no verdict, not a pass
    assert res["tests"]["counts"] == {"passed": 30, "deselected": 2}
    assert res["stages"]["kernels"]["timed_out"] and res["stages"]["kernels"]["log_tail"][-1] == "KeyboardInterrupt"
    md = report.markdown(res)
    assert "| kernels | decode bandwidth grid + tuning sweep, ragged steps | 124 TIMEOUT | 75 (75) |" in md
    assert "| mix | short/long mix on an 8B-shaped bf16 model: continuous vs static | not run |" in md


def test_missing_and_half_written_files_are_reported_not_fatal(tmp_path):
    (tmp_path / "kernels.json").write_text('{"meta": {}, "decode": [')  # cut off mid-write
    res = report.build(str(tmp_path), "cpu-smoke")
    assert "unreadable" in res["kernels"] and res["step"] is None and res["targets"] == {}
    assert "CPU smoke run" in report.markdown(res)


def test_the_mix_verdict_is_its_ratio_against_1_8(tmp_path):
    for ratio, verdict in ((1.79, "MISSED"), (1.8, "MET"), (2.5, "MET")):
        (tmp_path / "mix.json").write_text(json.dumps({"ratios": {"tok_s_continuous_over_static": ratio}}))
        assert report.build(str(tmp_path), "gpu")["targets"]["mix_tok_s_ratio"] == {"ratio": ratio,
                                                                                     "target_1.8": verdict}
