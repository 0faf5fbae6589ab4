#!/usr/bin/env python
"""Host work per decode step on the CPU: the engine's own step path with a device that costs nothing.

    python scripts/host_bench.py --preset qwen3-8b --batch-sizes 1,64,256

The real `Engine` runs (scheduler, step inputs, the jitted call's argument handling, output
processing) with a stand-in runner: its jitted step takes the very arguments the real one takes
(as many weight and KV leaves as the preset's model has, tiny ones, and the step's host arrays)
and returns tokens at once. So what is timed is the host's share of a step, phase by phase:

  schedule  Scheduler.schedule (which rows run, blocks, state slots)
  prepare   turning the scheduled rows into the step's host arrays
  dispatch  the jitted call (argument flattening, host-to-device copies, launch)
  process   fetching the tokens and the per-request bookkeeping (stop checks, events)

Every request decodes until the timed steps are over (ignore_eos, long max_tokens), prompts of
`--context` tokens, greedy sampling unless `--sampled`. The config comes from
scripts/make_random_checkpoint.py's presets (config.json only: no weights are made).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

PHASES = ("schedule", "prepare", "dispatch", "process")


class FakeRunner:
    """Stands in for ModelRunner in the engine: the real step-argument handling, no model."""

    def __init__(self, config, devices=None):
        from jtp.models import family_of
        from jtp.models.attention import choose_attention
        from jtp.parallel.sharding import make_mesh, replicated

        self.config = config
        self.cfg = config.model_config
        self.mesh = make_mesh(1, None)
        self.attention = choose_attention(self.mesh)
        # The shape set and step limits of the model this stands in for (ModelRunner's properties).
        self.uses_row_len_bound = self.attention.impl == "kernel" or family_of(self.cfg).uses_row_len_bound
        self.limit_long_rows = family_of(self.cfg).lays_out_long_rows_apart
        self.dtype = "bfloat16"
        self.tp = 1
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.num_state_slots = config.num_state_slots
        self.compilations = 0
        self.compile_seconds = 0.0
        self.compiles_ahead = False  # a warm-up would run its padding steps in order
        self.samples_late = False  # (no structured outputs here: steps with token masks would run in lockstep)
        self.load_format = "dummy"
        self.mtp_drafts = 0
        self.images = None  # (no vision tower)
        self.pipeline_depth = 1  # (one stage)
        # As many device leaves as the real model passes (per layer: 11 weights, K and V; plus the
        # embedding, final norm and an untied head).
        L = self.cfg.num_layers
        self.params = [jax.device_put(np.zeros(1, np.float32)) for _ in range(11 * L + 2 + (not self.cfg.tie_word_embeddings))]
        self.cache = [jax.device_put(np.zeros(1, np.float32)) for _ in range(2 * L)]
        self.sampled = jax.device_put(np.zeros(self.max_num_seqs, np.int32), replicated(self.mesh))
        self._fn = jax.jit(_fake_step, donate_argnums=(1, 2), static_argnames=("flags",))

    def bytes_per_block(self) -> int:
        return 1 << 16

    def samples_separately(self, step) -> bool:
        return False

    def bytes_per_state_slot(self) -> int:
        return 0

    def memory_stats(self):
        return None

    def allocate_cache(self, num_blocks: int, deferred: bool = False) -> None:
        self.num_blocks = num_blocks  # (its cache was made with it)

    def dispatch(self, step):
        from jtp.worker.runner import host_buffers

        ints, floats, layout, _ = host_buffers(step)
        result, self.cache, self.sampled = self._fn(self.params, self.cache, self.sampled, ints, floats, flags=layout)
        return result

    def close(self) -> None:
        pass


def _fake_step(params, cache, sampled, *host, flags):
    """Tokens at once: a function of the row's slot and the sampled-token buffer (so each step
    depends on the last), shaped like the real step's results ([1, B])."""
    from jtp.worker.sampler import SampleResult

    seq_slots = _rows(host, flags)
    tokens = (sampled[jnp.maximum(seq_slots, 0)] * 31 + seq_slots + 7) % 1000 + 2
    sampled = sampled.at[jnp.where(seq_slots >= 0, seq_slots, sampled.shape[0])].set(tokens, mode="drop")
    zero = jnp.zeros(tokens.shape, jnp.float32)
    return SampleResult(tokens[None], zero[None], None, None), cache, sampled


def _rows(host, static):
    """The step's seq_slots array (i32[B]), however the host arrays are passed: two packed buffers
    with a static layout, or (before them) the plan's arrays one by one."""
    if hasattr(static, "views"):
        return static.views(*host)["seq_slots"]
    return host[3]


def run(engine, batch: int, context: int, steps: int, warmup: int, sampled: bool, rng) -> dict:
    from jtp.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=10**6 // 2, temperature=0.7 if sampled else 0.0, top_p=0.9 if sampled else 1.0,
                            ignore_eos=True)
    params.max_tokens = min(params.max_tokens, engine.max_model_len - context - 1)
    rids = [engine.submit(rng.integers(0, engine.cfg.vocab_size, context).tolist(), params) for _ in range(batch)]
    while engine.stats().num_waiting or any(not engine.request(r).output_ids for r in rids):
        engine.step()
    for _ in range(warmup):
        engine.step()
    timer = PhaseTimer(engine)
    for _ in range(steps):
        timer.step()
    for r in rids:
        engine.abort(r)
        engine.release(r)
    timer.close()
    return timer.summary(batch)


class PhaseTimer:
    """Per-step phase times: the engine's timing hook where it has one, else wrapped methods."""

    def __init__(self, engine):
        self.engine = engine
        self.rows: list[dict] = []
        self.current: dict = {}
        self.hooked = hasattr(engine, "step_timings")
        if self.hooked:
            engine.step_timings = self.record
        else:  # the step path before the timing hook: time the methods it calls
            self.saved = []
            self._wrap(engine.scheduler, "schedule", "schedule")
            self._wrap(engine.runner, "dispatch", "dispatch")
            self._wrap(engine, "_dispatch", "_dispatch")
            self._wrap(engine, "_process", "process")

    def _wrap(self, obj, name, phase):
        inner = getattr(obj, name)
        self.saved.append((obj, name))

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.current[phase] = self.current.get(phase, 0.0) + time.perf_counter() - t

        setattr(obj, name, timed)

    def record(self, timing) -> None:
        self.current = {p: getattr(timing, p) for p in PHASES}

    def step(self) -> None:
        self.current = {}
        t = time.perf_counter()
        self.engine.step()
        total = time.perf_counter() - t
        c = dict(self.current)
        if not self.hooked:
            c["prepare"] = c.pop("_dispatch", 0.0) - c.get("dispatch", 0.0)
        c["total"] = total
        self.rows.append(c)

    def close(self) -> None:
        if self.hooked:
            self.engine.step_timings = None
        else:
            for obj, name in self.saved:
                delattr(obj, name)

    def summary(self, batch: int) -> dict:
        out = {"batch": batch}
        for p in (*PHASES, "total"):
            out[p] = 1e6 * statistics.median(r.get(p, 0.0) for r in self.rows)
        return out


def make_engine(model_dir: Path, max_num_seqs: int, max_model_len: int, chunk: int):
    import jtp.engine.engine as engine_module

    from jtp.config.engine_args import EngineArgs
    from jtp.config.engine_config import EngineConfig

    args = EngineArgs(model=str(model_dir), max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk,
                      max_model_len=max_model_len, skip_tokenizer_init=True, enable_prefix_caching=True,
                      num_blocks=max_num_seqs * (-(-max_model_len // 16)) + 16)
    real, engine_module.runner_class = engine_module.runner_class, lambda config: FakeRunner
    try:
        return engine_module.Engine(EngineConfig.from_args(args))
    finally:
        engine_module.runner_class = real


def table(results: list[dict], title: str) -> str:
    lines = [f"{title}", "", "| B | " + " | ".join(PHASES) + " | step total |", "|---:|" + "---:|" * (len(PHASES) + 1)]
    for r in results:
        lines.append(f"| {r['batch']} | " + " | ".join(f"{r[p]:.0f}" for p in (*PHASES, "total")) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from make_random_checkpoint import write_checkpoint

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=None, help="max_num_batched_tokens (default: 2 x max batch, >= 512)")
    ap.add_argument("--steps", type=int, default=200, help="timed decode steps per batch size")
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--sampled", action="store_true", help="temperature 0.7, top-p 0.9 instead of greedy")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    max_seqs = max(batches)
    chunk = args.chunk or max(512, 2 * max_seqs)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / args.preset
        write_checkpoint(args.preset, model_dir, "bfloat16", 4.0, 0, 1, config_only=True)
        results = []
        for batch in batches:
            engine = make_engine(model_dir, max(8, batch), args.max_model_len, chunk)
            results.append(run(engine, batch, args.context, args.steps, args.warmup_steps, args.sampled, rng))
            engine.close()
            print(json.dumps(results[-1]), flush=True)
    print(table(results, f"{args.preset}: host us per decode step (median of {args.steps})"))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
