"""Where a decode (or prompt) step's time goes: the host's phases and the device's kernels, from one run.

    python scripts/profile_step.py --model DIR [--tp 1] [--batch 1] [--context 1024] [--steps 24]
                                   [--num-scheduler-steps K] [--dtype bfloat16] [--out DIR] [--json FILE]
                                   [--prefill [--chunk TOKENS]]

B requests of `--context` random tokens are prefilled, then `--steps` decode steps run through the
engine's real `step()` twice:
1. timed on the host: each step split into scheduling, building the plan, the jitted call
   (`runner.dispatch`: argument handling, transfer of the plan, launch), the wait for the previous
   step's tokens (`jax.device_get`), and the rest (processing tokens, events);
2. under `jax.profiler.trace`: the device's kernels summed by name (launches and busy time per
   step, the largest kernels) and the host's own XLA events (argument parsing, input handling).

The table says which side bounds a step: a device busy for less than the step's wall time waits
for the host. With `--prefill` the steps are those that prefill B prompts of `--context` tokens
(`--chunk` tokens a step), after one such batch has compiled them. With `--num-scheduler-steps K`
each engine step is one dispatch of K decode steps: the host phases are per dispatch, the device's
figures per decode step (kernels and busy time / K).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import hashlib
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


class PhaseTimer:
    """One step's host phases, from the engine's timing hook (`Engine.step_timings`)."""

    PHASES = ("schedule", "prepare", "dispatch", "wait", "step")

    def __init__(self, engine):
        self.totals = collections.defaultdict(list)
        self._last = None
        engine.step_timings = self._record

    def _record(self, timing) -> None:
        self._last = timing

    def step(self, engine):
        events = engine.step()
        t = self._last
        for phase, value in (("schedule", t.schedule), ("prepare", t.prepare), ("dispatch", t.dispatch),
                             ("wait", t.wait), ("step", t.total)):
            self.totals[phase].append(value)
        return events

    def medians_ms(self) -> dict:
        med = {p: 1e3 * statistics.median(v) for p, v in self.totals.items()}
        med["other"] = med["step"] - sum(med[p] for p in self.PHASES if p != "step")
        return med


def trace_events(log_dir: Path) -> tuple[list[dict], dict[int, str]]:
    files = sorted(log_dir.glob("plugins/profile/*/perfetto_trace.json.gz")) or sorted(
        log_dir.glob("plugins/profile/*/*.trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no trace under {log_dir}")
    data = json.load(gzip.open(files[-1]))
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    return [e for e in events if e.get("ph") == "X" and "dur" in e], names


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The union's length of [start, end) intervals (kernels on several streams overlap)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _by_name(events: list[dict]) -> dict[str, list]:
    """{event name: [count, total microseconds]}."""
    totals = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        totals[e["name"]][0] += 1
        totals[e["name"]][1] += e["dur"]
    return totals


def summarize_trace(events: list[dict], names: dict[int, str], steps: int, top: int = 12) -> dict:
    device_pids = {pid for pid, n in names.items() if "/device:" in n and "CPU" not in n}
    kernels = [e for e in events if e["pid"] in device_pids]
    # XLA's own host events; "$file:line fn" ones are the Python tracer's (nested, overlapping).
    host = [e for e in events if e["pid"] not in device_pids and not e["name"].startswith("$")]
    by_kernel, by_host = _by_name(kernels), _by_name(host)
    out = {
        "device_kernels_per_step": len(kernels) / steps,
        "device_busy_ms_per_step": busy_us([(e["ts"], e["ts"] + e["dur"]) for e in kernels]) / 1e3 / steps,
        "device_kernel_ms_per_step": sum(e["dur"] for e in kernels) / 1e3 / steps,
        "top_kernels": [
            {"name": n[:90], "launches_per_step": c / steps, "ms_per_step": d / 1e3 / steps}
            for n, (c, d) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:top]
        ],
        "top_host_events": [
            {"name": n[:90], "calls_per_step": c / steps, "ms_per_step": d / 1e3 / steps}
            for n, (c, d) in sorted(by_host.items(), key=lambda kv: -kv[1][1])[:top]
        ],
    }
    return out


def markdown(res: dict) -> str:
    h = res["host_ms"]
    lines = [
        f"# profile_step: {res['model']} tp={res['tp']} B={res['batch']} "
        f"{'prompts of %d tokens, %d a step' % (res['context'], res['chunk']) if res.get('prefill') else 'context %d' % res['context']}"
        f"{' K=%d' % res['num_scheduler_steps'] if res.get('num_scheduler_steps', 1) > 1 else ''} ({res['device']})",
        "",
        f"`{res['command']}`" + (f" with XLA_FLAGS=`{res['xla_flags']}`" if res.get("xla_flags") else ""),
        "",
        "| host phase (median ms per engine step) | ms |",
        "|---|---:|",
    ]
    for phase in ("schedule", "prepare", "dispatch", "wait", "other", "step"):
        lines.append(f"| {phase} | {h[phase]:.3f} |")
    t = res.get("trace")
    if t:
        lines += [
            "",
            f"device: {t['device_kernels_per_step']:.0f} kernels/step, busy {t['device_busy_ms_per_step']:.3f} ms/step "
            f"(kernel time {t['device_kernel_ms_per_step']:.3f}) of a {h['step']:.3f} ms step",
            "",
            "| kernel | launches/step | ms/step |",
            "|---|---:|---:|",
        ]
        lines += [f"| `{k['name']}` | {k['launches_per_step']:.1f} | {k['ms_per_step']:.3f} |" for k in t["top_kernels"]]
        lines += ["", "| host event (XLA runtime) | calls/step | ms/step |", "|---|---:|---:|"]
        lines += [f"| `{k['name']}` | {k['calls_per_step']:.1f} | {k['ms_per_step']:.3f} |" for k in t["top_host_events"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--num-scheduler-steps", type=int, default=1, help="decode steps per dispatch (the device loop)")
    ap.add_argument("--prefill", action="store_true",
                    help="profile prompt steps instead: B prompts of --context tokens, --chunk tokens a step")
    ap.add_argument("--chunk", type=int, default=None, help="token budget per step (default max(512, 2 B); --prefill: context)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=Path("/tmp/jtp-profile"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--top", type=int, default=12, help="kernels and host events listed")
    ap.add_argument("--sync", action="store_true",
                    help="let the device finish each timed step before the next: the host phases without any "
                         "wait inside the driver for the step still running")
    ap.add_argument("--quantization", default=None, help="as jtp serve's (fp8: quantized at load)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="as jtp serve's (fp8: float8 e4m3 pages)")
    ap.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                    help="dummy: random weights drawn on the devices from config.json alone")
    args = ap.parse_args(argv)
    if args.prefill and args.num_scheduler_steps != 1:
        ap.error("--prefill profiles prompt steps, one a dispatch: leave --num-scheduler-steps at 1")

    import jax
    import numpy as np

    from jtp.config.engine_args import EngineArgs
    from jtp.core.sampling_params import SamplingParams
    from jtp.engine.engine import Engine

    chunk = args.chunk or (args.context if args.prefill else max(512, 2 * args.batch))
    # Decode profiles: every request keeps decoding until the timed steps end. Prompts of the batch
    # are prefilled from what a step's `chunk` tokens leave after the rows already decoding (at most
    # the batch), so each request needs the prefill's steps on top of the warm-up and timed ones (or
    # early finishers leave a smaller batch).
    prefill_steps = -(-args.batch * args.context // max(1, chunk - args.batch))
    decode_tokens = prefill_steps + 3 * args.steps * args.num_scheduler_steps + 32
    longest = args.context + decode_tokens + 64
    engine = Engine.from_args(EngineArgs(
        model=str(args.model), tensor_parallel_size=args.tp, dtype=args.dtype, max_num_seqs=args.batch,
        max_num_batched_tokens=chunk, num_blocks=args.batch * (-(-longest // 16) + 1),
        max_model_len=longest, skip_tokenizer_init=True, enable_prefix_caching=False,
        load_format=args.load_format, quantization=args.quantization, num_scheduler_steps=args.num_scheduler_steps,
        kv_cache_dtype=args.kv_cache_dtype))
    rng = np.random.default_rng(0)
    # --prefill: one token each, so no decode row shares a prompt step's budget
    max_tokens = 1 if args.prefill else decode_tokens
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def submit_all():
        rids = [engine.submit(rng.integers(0, engine.cfg.vocab_size, args.context).tolist(), params)
                for _ in range(args.batch)]
        return rids, [engine.outputs.stream(r) for r in rids]

    def prefilled(outs):
        return all(o.request.output_ids for o in outs)

    rids, outs = submit_all()
    timer = PhaseTimer(engine)
    if args.prefill:  # steps = the prompt steps of one batch; the first batch compiles, the second is timed
        for r in range(2):
            steps = 0
            while not prefilled(outs):
                if r:
                    timer.step(engine)
                else:
                    engine.step()
                steps += 1
            for rid in rids:
                engine.abort(rid)
            rids, outs = submit_all()
        args.steps = steps
    else:
        while not prefilled(outs):
            engine.step()
        for _ in range(4):  # compiled, steady
            engine.step()
        for _ in range(args.steps):
            timer.step(engine)
            if args.sync:
                jax.block_until_ready(engine.runner.sampled)
    res = {
        "command": " ".join(["scripts/profile_step.py", *(argv if argv is not None else sys.argv[1:])]),
        "model": Path(args.model).name, "tp": args.tp, "batch": args.batch, "context": args.context, "sync": args.sync,
        "num_scheduler_steps": args.num_scheduler_steps, "prefill": args.prefill, "chunk": chunk,
        "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}", "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "host_ms": timer.medians_ms(),
    }
    with jax.profiler.trace(str(args.out), create_perfetto_trace=True):
        for _ in range(args.steps):
            engine.step()
            if args.sync:
                jax.block_until_ready(engine.runner.sampled)
        jax.block_until_ready(engine.runner.sampled)
    if args.prefill and not prefilled(outs):
        res["trace_error"] = "the traced steps did not finish the prompts"
    try:
        res["trace"] = summarize_trace(*trace_events(args.out), args.steps * args.num_scheduler_steps, args.top)
    except (FileNotFoundError, KeyError, ValueError) as e:
        res["trace_error"] = "; ".join(filter(None, (res.get("trace_error"), f"{type(e).__name__}: {e}")))
    # Greedy tokens of every request: equal across runs that change only how the step is launched.
    res["tokens_sha256"] = hashlib.sha256(np.asarray([t for o in outs for t in o.request.output_ids], np.int64)).hexdigest()[:16]
    for r in rids:
        engine.abort(r)
    engine.close()
    md = markdown(res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
