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
from report import md_table, write_json, write_text  # noqa: E402

STAGES = [("smoke", "compile smoke test: both kernels vs the references"),
          ("tests", "kernel tests compiled for real (hypothesis cases excluded)"),
          ("kernels", "decode bandwidth grid + tuning sweep, ragged steps"),
          ("step", "8B-shaped decode step vs its roofline"),
          ("mix", "short/long mix on an 8B-shaped bf16 model: continuous vs static")]


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
    """stages.tsv's rows (name, exit, seconds, limit), with the end of the log of each that failed."""
    out = {}
    for parts in (line.split("\t") for line in _read(os.path.join(work, "stages.tsv")).splitlines()):
        if len(parts) == 4:
            name, (rc, secs, limit) = parts[0], map(int, parts[1:])
            out[name] = {"exit": rc, "seconds": secs, "timeout_s": limit, "timed_out": rc in (124, 137, 130)}
            if rc != 0:
                out[name]["log_tail"] = _read(os.path.join(work, f"{name}.log")).splitlines()[-12:]
    return out


def _tests(log: str) -> dict[str, Any]:
    """pytest's closing line ("[== ]3 passed, 1 failed, 2 deselected in 9.1s[ ==]"), and the failing tests."""
    found = re.findall(r"^=*\s*(\d+ (?:passed|failed|errors?|skipped|deselected)[^\n]*?) in [\d.]+s", log, re.M)
    summary = found[-1] if found else None
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", summary or "")}
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", log, re.M)))
    return {"summary": summary, "counts": counts, "failed": failed[:40]}


def _verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def build(work: str, mode: str) -> dict[str, Any]:
    res: dict[str, Any] = {"mode": mode, "env": _read(os.path.join(work, "env.txt")).strip(), "stages": _stages(work)}
    res["smoke"] = _load(os.path.join(work, "smoke.json"))
    if "tests" in res["stages"] or os.path.exists(os.path.join(work, "tests.log")):
        res["tests"] = _tests(_read(os.path.join(work, "tests.log")))
    for name in ("kernels", "step", "mix"):
        res[name] = _load(os.path.join(work, f"{name}.json"))
    kern, step, mix = (res[k] if isinstance(res[k], dict) else {} for k in ("kernels", "step", "mix"))
    targets: dict[str, Any] = {}
    # judged: the cases reading >= 0.5 GiB; the target: those at context >= 2k and batch >= 16
    cases = [r for r in kern.get("decode", []) if r.get("judged") and "pct_copy" in r.get("pallas", {})
             and r["context"] >= 2048 and r["batch"] >= 16]
    if cases:
        worst = min(r["pallas"]["pct_copy"] for r in cases)
        targets["decode_attention_pct_copy"] = {
            "cases": len(cases), "worst_pct_copy": worst,
            "worst_pct_datasheet": min(r["pallas"]["pct_peak"] for r in cases),
            "target_50": _verdict(worst >= 50), "stretch_75": _verdict(worst >= 75)}
    s256 = [r["pct_roofline"] for r in step.get("step", []) if r.get("batch") == 256 and "pct_roofline" in r]
    if s256:
        targets["step_b256_pct_roofline"] = {"pct": max(s256), "target_70": _verdict(max(s256) >= 70)}
    if "ratios" in mix:
        r = mix["ratios"]["tok_s_continuous_over_static"]
        targets["mix_tok_s_ratio"] = {"ratio": r, "target_1.8": _verdict(r >= 1.8)}
    return res | {"targets": targets, "copy": (kern.get("copy") or [{}])[0]}


def _table(header: list[str], rows: list[dict[str, Any]], head: Any, figures: Any, error: Any) -> str:
    """A markdown table: head(r) + figures(r) per measured row, head(r) + its error otherwise."""
    out = [header]
    for r in rows:
        h, err = head(r), error(r)
        out.append(h + (figures(r) if err is None else
                        [f"ERROR: {str(err)[:120]}"] + [""] * (len(header) - len(h) - 1)))
    return md_table(out)


def markdown(res: dict[str, Any]) -> str:
    L = [f"# gpu_check summary ({res['mode']})", ""]
    if res["mode"] != "gpu":
        L += ["**CPU smoke run: kernels interpreted, tiny shapes. No figure here says anything about a GPU.**", ""]
    stages = [["stage", "what", "exit", "seconds (limit)"]] + [
        [name, what, "not run", ""] if (st := res["stages"].get(name)) is None else
        [name, what, f"{st['exit']}{' TIMEOUT' if st['timed_out'] else ''}", f"{st['seconds']} ({st['timeout_s']})"]
        for name, what in STAGES]
    L += ["```", res["env"] or "(no env.txt)", "```", "", md_table(stages), ""]
    for name, st in res["stages"].items():
        if st.get("log_tail"):
            L += [f"`{name}` ended with exit {st['exit']}; the end of its log:", "```"] + [
                line[:200] for line in st["log_tail"]] + ["```", ""]
    if isinstance(res.get("smoke"), dict):
        L += ["## Smoke (both kernels vs the references)", ""] + [
            "- Hq {num_q_heads} Hkv {num_kv_heads} D {head_dim} BS {block_size} {dtype}: ".format(**r["shape"])
            + f"{'ok' if r['ok'] else 'FAILED: ' + str(r['reason'])} ({r['seconds']}s)"
            for r in res["smoke"].get("smoke", [])]
        L += [f"- `--attention-backend auto` serves: **{r['backend']}**"
              for r in res["smoke"].get("smoke_auto", [])] + [""]
    if res.get("tests"):
        t = res["tests"]
        L += ["## Kernel tests", "", f"- {t['summary'] or 'no pytest summary line (cut off?)'}"]
        L += [f"- FAILED {f}" for f in t["failed"]] + [""]
    kern, c = res.get("kernels"), res.get("copy")
    if isinstance(kern, dict):
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
        L += ["- ragged {}: {}".format(r["case"], ", ".join(
            f"{b} {r[b]['us']:.0f} us ({r[b]['tflops']:.1f} TFLOP/s)" if "us" in r.get(b, {}) else f"{b} ERROR"
            for b in ("pallas", "ref") if b in r)) for r in kern.get("ragged", [])] + [""]
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
        L += [f"## Short/long mix ({mix.get('model')}, {mix.get('dtype')}, attention {mix.get('attention_backend')}, "
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
    if not os.path.isdir(args.work):
        ap.error(f"no work folder {args.work!r}")
    res = build(args.work, args.mode)
    write_json(os.path.join(args.dest, "results.json"), res)
    write_text(os.path.join(args.dest, "summary.md"), markdown(res))


if __name__ == "__main__":
    main()
