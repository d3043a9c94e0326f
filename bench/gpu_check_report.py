"""Did the GPU check meet its targets? bench/gpu_check.sh's stage outputs -> results.json and
summary.md, rerun after every stage (a missing or half-written file is reported, never fatal).

    python bench/gpu_check_report.py WORK_DIR DEST_DIR [--mode gpu|cpu-smoke]

Targets: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import md_table, write_json  # noqa: E402

STAGES = [("smoke", "compile smoke test: both kernels vs the references"),
          ("tests", "kernel tests compiled for real (hypothesis cases excluded)"),
          ("kernels", "decode bandwidth grid + tuning sweep, ragged steps"),
          ("step", "8B-shaped decode step vs its roofline"),
          ("mix", "seed's mix on an 8B-shaped bf16 model: continuous vs static")]


def _load(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return {"unreadable": f"{type(e).__name__}: {e}"}


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _stages(work: str) -> dict[str, dict[str, Any]]:
    out = {}
    for line in _read(os.path.join(work, "stages.tsv")).splitlines():
        parts = line.split("\t")
        if len(parts) == 4:
            name, rc, secs, limit = parts
            out[name] = {"exit": int(rc), "seconds": int(secs), "timeout_s": int(limit),
                         "timed_out": int(rc) in (124, 137) or int(rc) == 130}
            if int(rc) != 0:  # the end of its log says why
                out[name]["log_tail"] = _read(os.path.join(work, f"{name}.log")).splitlines()[-12:]
    return out


def _tests(log: str) -> dict[str, Any]:
    """pytest's closing line, and the ids of failing tests."""
    m = None  # the last line like "[== ]3 passed, 1 failed, 2 deselected in 9.1s[ (0:00:09)][ ==]"
    for m in re.finditer(r"^=*\s*(\d+ (?:passed|failed|errors?|skipped|deselected)[^\n]*?) in ([\d.]+)s", log, re.M):
        pass
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", m.group(1))} if m else {}
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", log, re.M)))
    return {"summary": m.group(1) if m else None, "counts": counts, "failed": failed[:40]}


def _verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def build(work: str, mode: str) -> dict[str, Any]:
    res: dict[str, Any] = {"mode": mode, "env": _read(os.path.join(work, "env.txt")).strip(),
                           "stages": _stages(work)}
    res["smoke"] = _load(os.path.join(work, "smoke.json"))
    if "tests" in res["stages"] or os.path.exists(os.path.join(work, "tests.log")):
        res["tests"] = _tests(_read(os.path.join(work, "tests.log")))
    res["kernels"] = _load(os.path.join(work, "kernels.json"))
    res["step"] = _load(os.path.join(work, "step.json"))
    res["mix"] = _load(os.path.join(work, "mix.json"))
    targets: dict[str, Any] = {}

    kern = res["kernels"] if isinstance(res["kernels"], dict) else {}
    copy = (kern.get("copy") or [{}])[0]
    judged = [r for r in kern.get("decode", []) if r.get("judged") and "us" in r.get("pallas", {})]
    target_cases = [r for r in judged if r["context"] >= 2048 and r["batch"] >= 16]
    if target_cases and "pct_copy" in target_cases[0]["pallas"]:
        worst = min(r["pallas"]["pct_copy"] for r in target_cases)
        targets["decode_attention_pct_copy"] = {
            "cases": len(target_cases), "worst_pct_copy": worst,
            "worst_pct_datasheet": min(r["pallas"]["pct_peak"] for r in target_cases),
            "target_50": _verdict(worst >= 50), "stretch_75": _verdict(worst >= 75)}
    step = res["step"] if isinstance(res["step"], dict) else {}
    s256 = [r for r in step.get("step", []) if r.get("batch") == 256 and "pct_roofline" in r]
    if s256:
        pct = max(r["pct_roofline"] for r in s256)
        targets["step_b256_pct_roofline"] = {"pct": pct, "target_70": _verdict(pct >= 70)}
    mix = res["mix"] if isinstance(res["mix"], dict) else {}
    if "ratios" in mix:
        r = mix["ratios"]["tok_s_continuous_over_static"]
        targets["mix_tok_s_ratio"] = {"ratio": r, "target_1.8": _verdict(r >= 1.8)}
    res["targets"] = targets
    res["copy"] = copy
    return res


def _table(header: list[str], rows: list[dict[str, Any]], head: Any, figures: Any, error: Any) -> str:
    """A markdown table: head(r) + figures(r) per measured row, head(r) + its error otherwise."""
    out = [header]
    for r in rows:
        h, err = head(r), error(r)
        out.append(h + (figures(r) if err is None else [f"ERROR: {str(err)[:120]}"] + [""] * (len(header) - len(h) - 1)))
    return md_table(out)


def markdown(res: dict[str, Any]) -> str:
    L = [f"# gpu_check summary ({res['mode']})", ""]
    if res["mode"] != "gpu":
        L += ["**CPU smoke run: kernels interpreted, tiny shapes. No figure here says anything about a GPU.**", ""]
    stages = [["stage", "what", "exit", "seconds (limit)"]]
    for name, what in STAGES:
        st = res["stages"].get(name)
        stages.append([name, what, "not run", ""] if st is None else [
            name, what, f"{st['exit']}{' TIMEOUT' if st['timed_out'] else ''}", f"{st['seconds']} ({st['timeout_s']})"])
    L += ["```", res["env"] or "(no env.txt)", "```", "", md_table(stages), ""]
    for name, st in res["stages"].items():
        if st.get("log_tail"):
            L += [f"`{name}` ended with exit {st['exit']}; the end of its log:", "```"] + [
                line[:200] for line in st["log_tail"]] + ["```", ""]
    smoke = res.get("smoke")
    if isinstance(smoke, dict):
        L += ["## Smoke (both kernels vs the references)", ""]
        for r in smoke.get("smoke", []):
            s = r["shape"]
            L.append(f"- Hq {s['num_q_heads']} Hkv {s['num_kv_heads']} D {s['head_dim']} BS {s['block_size']} "
                     f"{s['dtype']}: {'ok' if r['ok'] else 'FAILED: ' + str(r['reason'])} ({r['seconds']}s)")
        L += [f"- `--attention-backend auto` serves: **{r['backend']}**" for r in smoke.get("smoke_auto", [])] + [""]
    if res.get("tests"):
        t = res["tests"]
        L += ["## Kernel tests", "", f"- {t['summary'] or 'no pytest summary line (cut off?)'}"]
        L += [f"- FAILED {f}" for f in t["failed"]] + [""]
    kern = res.get("kernels")
    if isinstance(kern, dict):
        c = res.get("copy") or {}
        L += ["## Decode attention bandwidth (Llama-3-8B attention: 32 q / 8 kv heads, D 128, bf16, BS 16)", ""]
        if c:
            L += [f"Copy bandwidth measured in this run: {c['copy_gbps']:.0f} GB/s (read + written; "
                  f"{c['copy_pct_peak']:.0f}% of the 4.8 TB/s datasheet); read-only {c['read_gbps']:.0f} GB/s.", ""]

        L.append(_table(
            ["batch", "context", "KV MiB", "judged", "best config", "us", "GB/s", "% datasheet", "% copy"],
            kern.get("decode", []),
            lambda r: [str(r["batch"]), str(r["context"]), f"{r['kv_bytes'] / 2**20:.0f}",
                       "yes" if r.get("judged") else "no"],
            lambda r: [r["pallas"].get("config", "default"), f"{r['pallas']['us']:.1f}", f"{r['pallas']['gbps']:.0f}",
                       f"{r['pallas']['pct_peak']:.0f}", f"{r['pallas'].get('pct_copy', float('nan')):.0f}"],
            lambda r: None if "us" in r.get("pallas", {}) else r.get("pallas", {}).get("error")))
        for w in kern.get("best_config_wins", []):
            L += ["", "Best configuration wins (warps/stages/keys per step): "
                  + ", ".join(f"{k} x{v}" for k, v in sorted(w.items(), key=lambda kv: -kv[1]))]
        for r in kern.get("ragged", []):
            cells = ", ".join(f"{b} {r[b]['us']:.0f} us ({r[b]['tflops']:.1f} TFLOP/s)" if "us" in r.get(b, {})
                              else f"{b} ERROR" for b in ("pallas", "ref") if b in r)
            L.append(f"- ragged {r['case']}: {cells}")
        L.append("")
    step = res.get("step")
    if isinstance(step, dict) and step.get("step"):
        L += ["## 8B-shaped decode step", "", _table(
            ["backend", "batch", "context", "ms/step", "tok/s", "roofline ms", "% roofline"], step["step"],
            lambda r: [r["backend"], str(r["batch"]), str(r["context"])],
            lambda r: [f"{r['step_ms']:.2f}", f"{r['tokens_per_s']:.0f}", f"{r['roofline_ms']:.2f}",
                       f"{r['pct_roofline']:.1f}"],
            lambda r: None if "step_ms" in r else r.get("error")), ""]
    mix = res.get("mix")
    if isinstance(mix, dict) and mix.get("runs"):
        L += [f"## Seed's mix ({mix.get('model')}, {mix.get('dtype')}, attention {mix.get('attention_backend')}, "
              f"{mix['workload']['num_requests']} requests)", ""]
        L += [f"- {m}: {r['output_tok_s']:.0f} output tok/s, {r['stats']['num_steps']} steps, {r['ms_per_step']:.1f} "
              f"ms/step, short p99 {r['short_completion_s']['p99']:.2f}s (engine built in {mix['build_s'].get(m)}s)"
              for m, r in mix["runs"].items()]
        if "ratios" in mix:
            q = mix["ratios"]
            L.append(f"- continuous / static tok/s **{q['tok_s_continuous_over_static']:.2f}x** (ideal from steps "
                     f"{q['tok_s_ideal_from_steps']:.2f}x); short p99 static / continuous "
                     f"{q['short_p99_static_over_continuous']:.2f}x (ideal {q['short_p99_ideal_from_steps']:.2f}x)")
        L.append("")
    L += ["## Targets", ""] + (["- none measured"] if not res["targets"] else [])
    L += [f"- {k}: " + ", ".join(f"{a} {b:.1f}" if isinstance(b, float) else f"{a} {b}" for a, b in v.items())
          for k, v in res["targets"].items()]
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", help="the stages' outputs (bench/gpu_check.sh's work folder)")
    ap.add_argument("dest", help="where results.json and summary.md go")
    ap.add_argument("--mode", choices=("gpu", "cpu-smoke"), default="gpu")
    args = ap.parse_args(argv)
    work, dest = args.work, args.dest
    res = build(work, args.mode)
    os.makedirs(dest, exist_ok=True)
    write_json(os.path.join(dest, "results.json"), res)
    with open(os.path.join(dest, "summary.md"), "w") as f:
        f.write(markdown(res))


if __name__ == "__main__":
    main()
