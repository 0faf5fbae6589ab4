#!/usr/bin/env python
"""Tensor-parallel scaling from bench.py runs of one model at several tp: tokens/s, speed-up over
tp=1 and efficiency per doubling (throughput at 2t over throughput at t, halved: 100% is linear).

    python3 scripts/tp_scaling.py out/qwen3-8b-tp{1,2,4,8}.json [--markdown out/qwen3-8b-scaling.md]

Rows: decode at each batch size bench.py timed, prefill throughput and TTFT. Issue 15's targets
(decode B=1: tp=4 >= 2.8x tp=1, tp=8 >= 4.5x) are marked where the runs include those sizes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TARGETS = {("decode B=1", 4): 2.8, ("decode B=1", 8): 4.5}


def series(run: dict) -> dict[str, float]:
    """{measurement: value} of one bench.py JSON (higher is better except TTFT)."""
    out = {f"decode B={d['batch']}": d["tokens_per_s"] for d in run.get("decode", []) if d.get("tokens_per_s")}
    prefill = run.get("prefill") or {}
    if prefill.get("tokens_per_s"):
        out["prefill tokens/s"] = prefill["tokens_per_s"]
    if prefill.get("ttft_ms"):
        out["TTFT ms"] = prefill["ttft_ms"]
    return out


def scaling_table(runs: list[dict]) -> tuple[list[str], list[dict]]:
    """Markdown lines, and one record per (measurement, tp) with speed-up and efficiency per doubling."""
    by_tp = {}
    for run in runs:
        tp = run["engine"]["tensor_parallel_size"]
        if tp in by_tp:
            raise SystemExit(f"two runs at tp={tp}: give one per tensor-parallel size")
        by_tp[tp] = series(run)
    tps = sorted(by_tp)
    if tps[0] != 1:
        raise SystemExit(f"scaling is measured against tp=1; the runs have tp={tps}")
    names = [n for n in by_tp[1] if all(n in by_tp[t] for t in tps)]
    lines = ["| measurement | tp | value | speed-up vs tp=1 | per doubling | target |", "|---|---:|---:|---:|---:|---|"]
    records = []
    for name in names:
        lower_better = name.startswith("TTFT")
        for tp in tps:
            value = by_tp[tp][name]
            speedup = by_tp[1][name] / value if lower_better else value / by_tp[1][name]
            half = tp // 2
            per_doubling = None
            if tp > 1 and half in by_tp:
                prev = by_tp[half][name]
                per_doubling = (prev / value if lower_better else value / prev) / 2
            target = TARGETS.get((name, tp))
            records.append(dict(measurement=name, tp=tp, value=value, speedup=speedup, per_doubling=per_doubling,
                                target=target, met=None if target is None else speedup >= target))
            target_txt = "" if target is None else f">= {target}x: {'met' if speedup >= target else '**missed**'}"
            doubling_txt = "" if per_doubling is None else f"{100 * per_doubling:.0f}%"
            lines.append(f"| {name} | {tp} | {value:,.1f} | {speedup:.2f}x | {doubling_txt} | {target_txt} |")
    return lines, records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="bench.py --json files, one per tensor-parallel size")
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    runs = [json.loads(p.read_text()) for p in args.runs]
    lines, records = scaling_table(runs)
    hw = runs[0].get("hardware", {})
    header = [f"# tensor-parallel scaling: {runs[0].get('model_dir', '?')} on {hw.get('device_kind', '?')}", "",
              "Runs: " + ", ".join(f"`{r['command']}`" for r in runs), ""]
    text = "\n".join(header + lines) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
