#!/usr/bin/env python
"""Benchmark jtp's engine against rooflines measured in the same run (and optionally HF).

    python scripts/bench.py [--model DIR] [--tensor-parallel-size N] [--batch-sizes 1,8,64,256]
        [--context 1024] [--prefill-len 2048] [--dtype bfloat16] [--json OUT.json]
        [--markdown OUT.md] [--hf]

What it measures, in order (every figure next to its floor):

1. Ceilings of this device: a large device copy (bytes read + written per second) and a large
   matrix product in the model dtype (FLOP/s).
2. Decode: for each batch size B, B requests with `--context` random prompt tokens (greedy,
   ignore_eos) are prefilled through the engine; then `--decode-steps` pure-decode
   `engine.step()` calls are timed and the sampled tokens counted. Floor: (weight bytes +
   KV bytes read) / copy bandwidth per step.
3. Prefill: time to first token of one `--prefill-len` prompt (median of runs), and the
   throughput of several such prompts back to back. Floor: 2 * matmul params * tokens (+
   causal attention, + one lm_head row per prompt) / matmul rate.
4. Peak device memory and the KV pool chosen.
5. With --hf: Hugging Face transformers (torch, eager) on the same weights, in a subprocess,
   decode tokens/s at the same batch sizes and context, and its prefill time.

Prints a markdown table; --json / --markdown write the results (the JSON is rewritten after
each section, so a run cut short still leaves what it measured). Runs on CPU too (small
presets, small batch sizes); the ceilings then are the CPU's.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a plain checkout, without `pip install -e .`
from jtp.config.engine_args import KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATIONS  # noqa: E402

# GPU memory grows on demand, so the peak we report is what jtp used, and a torch subprocess
# (--hf) can share the device. Must be set before jax is imported.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

GiB = 2**30


def parse_sizes(text: str) -> list[int]:
    sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers, got {text!r}")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="HF model directory (config.json + safetensors) or repo id (default: the embedded demo)")
    ap.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    ap.add_argument("--num-processes", type=int, default=1,
                    help="run through the multi-process launcher: this many local JAX processes share the tp mesh")
    ap.add_argument("--batch-sizes", type=parse_sizes, default=parse_sizes("1,8,64,256"))
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens already in cache when decode is timed")
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per batch size")
    ap.add_argument("--warmup-steps", type=int, default=3, help="untimed decode steps first (compiles)")
    ap.add_argument("--prefill-runs", type=int, default=3, help="TTFT runs (median reported)")
    ap.add_argument("--prefill-requests", type=int, default=4, help="prompts in the prefill-throughput run")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="engine token budget per step (default: max(prefill-len, 2 x largest batch))")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-scheduler-steps", type=int, default=1,
                    help="decode steps per dispatch (the engine's multi-step decode; 1: one per dispatch)")
    ap.add_argument("--speculative-config", default=None,
                    help="speculative decoding, as on `jtp serve` (the decode rows report acceptance)")
    ap.add_argument("--enable-expert-parallel", action="store_true",
                    help="MoE: whole experts per device instead of a slice of each (the engine's flag)")
    ap.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                    help="dummy: random weights from config.json alone, drawn on the devices (no checkpoint on disk)")
    ap.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                    help="fp8: the linear weights in FP8 blocks, quantized at load (the engine's flag)")
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                    help="fp8: K/V stored in FP8 in the paged cache (the engine's flag)")
    ap.add_argument("--copy-gib", type=float, default=None, help="copy-bandwidth buffer (default 2 GiB GPU, 1/16 CPU)")
    ap.add_argument("--matmul-n", type=int, default=None, help="matmul size n (default 8192 GPU, 512 CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--hf", action="store_true", help="also run HF transformers (torch, eager) on the same weights")
    ap.add_argument("--hf-timeout", type=float, default=600.0)
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="skip the sections not yet started once this much time has passed (results so far are kept)")
    ap.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)  # internal: the HF subprocess
    ap.add_argument("--hf-out", type=Path, default=None, help=argparse.SUPPRESS)
    return ap


# ----------------------------------------------------------------------------- helpers


class Clock:
    def __init__(self, budget: float | None):
        self.t0 = time.perf_counter()
        self.budget = budget

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over(self) -> bool:
        return self.budget is not None and self.elapsed() > self.budget


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def host_peak_rss() -> int | None:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    except Exception:  # noqa: BLE001
        return None


def fmt(x, digits=1, unit=""):
    if x is None:
        return "—"
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return "—"
    if abs(x) >= 100:
        return f"{x:,.0f}{unit}"
    return f"{x:.{digits}f}{unit}"


def rate(x, unit):
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.2f} {unit}"


def pct(x):
    return "—" if x is None else f"{100 * x:.0f}%"


# ----------------------------------------------------------------------------- ceilings


def _copy_rates(step, x, copy_bytes: int, repeats: int, iters: int = 10, sync=None) -> list[float]:
    """Read + write bytes per second of `y = step(y)` over `iters` calls, `repeats` times."""
    import jax

    sync = sync or jax.block_until_ready
    y = step(step(x))
    sync(y)
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            y = step(y)
        sync(y)
        rates.append(2 * copy_bytes * iters / (time.perf_counter() - t))
    return rates


def _torch_copy_rates(device, copy_bytes: int, repeats: int) -> list[float] | None:
    """PyTorch's copy_ on the same GPU, when torch with CUDA is there (the best copy seen on an H200)."""
    if device.platform != "gpu":
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        with torch.cuda.device(device.local_hardware_id or 0):
            a = torch.randn(copy_bytes // 4, device="cuda")
            b = torch.empty_like(a)
            rates = _copy_rates(lambda _: b.copy_(a), None, copy_bytes, repeats, sync=lambda _: torch.cuda.synchronize())
            a = b = None  # freed before the cache is emptied
            torch.cuda.empty_cache()
            return rates
    except Exception as e:  # noqa: BLE001 - an optional peer; the jax copies still measure the ceiling
        log(f"  torch copy not measured: {type(e).__name__}: {e}")
        return None


def measure_ceilings(device, dtype, copy_bytes: int, matmul_n: int, repeats: int = 5) -> dict:
    """Copy bandwidth (read + write bytes per second) as the best of several copies reaches it, and
    the matmul rate, on one device.

    Copies: jax's elementwise pass in the model dtype (XLA's bf16 code reaches ~3.3 TB/s on an
    H200), jax's over 32-bit words (~4.1 TB/s) and PyTorch's copy_ where torch has CUDA (~4.26 TB/s).
    The ceiling is the best: what the memory can really deliver, not what one code path gets."""
    import jax
    import jax.numpy as jnp

    n = copy_bytes // jnp.dtype(dtype).itemsize
    by_method = {}
    with jax.default_device(device):
        x = jax.random.normal(jax.random.PRNGKey(1), (n,), jnp.float32).astype(dtype)  # never zeros
        by_method[f"jax negate ({jnp.dtype(dtype).name})"] = _copy_rates(jax.jit(lambda a: -a), x, copy_bytes, repeats)
        words = jax.lax.bitcast_convert_type(x.reshape(-1, 4 // jnp.dtype(dtype).itemsize), jnp.uint32) \
            if jnp.dtype(dtype).itemsize < 4 else jax.lax.bitcast_convert_type(x, jnp.uint32)
        del x
        by_method["jax xor (uint32)"] = _copy_rates(jax.jit(lambda a: a ^ jnp.uint32(1)), words, copy_bytes, repeats)
        del words
    torch_rates = _torch_copy_rates(device, copy_bytes, repeats)
    if torch_rates:
        by_method["torch copy_"] = torch_rates
    best = max(by_method, key=lambda m: statistics.median(by_method[m]))
    rates = by_method[best]
    with jax.default_device(device):
        iters = 10

        k1, k2 = jax.random.split(jax.random.PRNGKey(2))
        a = jax.random.normal(k1, (matmul_n, matmul_n), jnp.float32).astype(dtype)
        b = jax.random.normal(k2, (matmul_n, matmul_n), jnp.float32).astype(dtype)
        mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype))
        mm(a, b).block_until_ready()
        flops = []
        for _ in range(repeats):
            t = time.perf_counter()
            outs = [mm(a, b) for _ in range(iters)]
            jax.block_until_ready(outs)
            flops.append(2 * matmul_n**3 * iters / (time.perf_counter() - t))
            del outs
        del a, b
    return dict(
        copy_bytes=copy_bytes,
        copy_bandwidth_Bps=statistics.median(rates),
        copy_bandwidth_runs_Bps=rates,
        copy_method=best,
        copy_bandwidth_by_method_Bps={m: statistics.median(r) for m, r in by_method.items()},
        matmul_n=matmul_n,
        matmul_dtype=str(jnp.dtype(dtype)),
        matmul_flops_per_s=statistics.median(flops),
        matmul_runs_flops_per_s=flops,
    )


# ----------------------------------------------------------------------------- model figures


def model_figures(runner) -> dict:
    """Parameter counts and the bytes a decode step must read (per whole model, all devices).

    Works for every family: matmul parameters are counted from the parameter tree (gated q_proj,
    DeltaNet projections, active experts only), K/V only for full-attention layers, and a
    hybrid's per-sequence recurrent state, which each decode step reads and writes.
    """
    import jax
    import jax.numpy as jnp

    from jtp.models.attention import LayerKV

    cfg = runner.cfg
    from jtp.models.layers import BlockFp8, Int4Groups

    QUANTIZED = (BlockFp8, Int4Groups)

    leaves = jax.tree_util.tree_leaves_with_path(runner.params)
    param_bytes = sum(x.nbytes for _, x in leaves)  # what a decode step reads: FP8 values and their scales
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(runner.params, is_leaf=lambda x: isinstance(x, QUANTIZED)))
    embed = runner.params["embed"]
    tied = "lm_head" not in runner.params
    # Untied: the embedding table is only gathered (B rows) in decode; the lm_head is read whole.
    weight_bytes_read = param_bytes - (0 if tied else embed.nbytes)
    active_share = cfg.num_experts_per_tok / cfg.num_experts if cfg.num_experts else 1.0
    matmul_params, expert_bytes = 0, 0
    for layer in runner.params["layers"]:
        for name, w in layer.items():
            if len(w.shape) >= 2:  # a quantized weight's shape is its logical one: scales are bytes, not params
                matmul_params += math.prod(w.shape) * (active_share if name.startswith("experts_") else 1.0)
            if name.startswith("experts_"):
                expert_bytes += sum(x.nbytes for x in jax.tree.leaves(w))
    attention_layers = sum(isinstance(c, LayerKV) for c in runner.cache)
    state_bytes = sum(x.nbytes for c in runner.cache if not isinstance(c, LayerKV) for x in jax.tree.leaves(c))
    H, V, D = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    return dict(
        model_type=cfg.model_type,
        hidden_size=H,
        num_layers=cfg.num_layers,
        attention_layers=attention_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=D,
        intermediate_size=cfg.intermediate_size,
        vocab_size=V,
        tie_word_embeddings=tied,
        params=int(params),
        param_bytes=int(param_bytes),
        weight_bytes_read_per_decode_step=int(weight_bytes_read),  # every weight (all experts)
        routed_expert_bytes=int(expert_bytes),  # the routed experts' share of it (MoE)
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        matmul_params_per_token=int(matmul_params),
        lm_head_params=int(V * H),
        kv_bytes_per_token=int(attention_layers * 2 * cfg.num_kv_heads * D * jnp.dtype(runner.kv_dtype).itemsize),
        # Read and written once per decode step by every running sequence (0 for Qwen3).
        state_bytes_per_seq_step=int(2 * state_bytes // runner.max_num_seqs),
    )


def touched_weight_bytes(fig: dict, tokens: int) -> float:
    """The weight bytes a step over `tokens` tokens must read: every dense weight, and of the routed
    experts only those some token picks. Expected distinct experts per MoE layer when each token
    picks k of E uniformly (random weights route about uniformly; a trained router's skew touches
    fewer): E (1 - (1 - k/E)^tokens)."""
    E, k, experts = fig.get("num_experts", 0), fig.get("num_experts_per_tok", 0), fig.get("routed_expert_bytes", 0)
    if not E:
        return fig["weight_bytes_read_per_decode_step"]
    touched = 1 - (1 - k / E) ** tokens
    return fig["weight_bytes_read_per_decode_step"] - experts + experts * touched


def prefill_flops(fig: dict, prompt_len: int) -> float:
    """Useful FLOPs of one prompt: projections and MLP, causal attention, one lm_head row."""
    L = prompt_len
    dense = 2 * fig["matmul_params_per_token"] * L
    attn = fig["attention_layers"] * 2 * 2 * fig["num_heads"] * fig["head_dim"] * L * (L + 1) / 2
    return dense + attn + 2 * fig["lm_head_params"]


# ----------------------------------------------------------------------------- jtp engine runs


class StepTimer:
    """Splits each engine step into host work and waiting for the device.

    The engine dispatches step N+1 before it fetches step N's tokens, so a step's wall time is
    host work (scheduling, step inputs, dispatch, detokenizing) plus the time the host then
    waits for step N's results. A wait > 0 means the device was still busy when the host was
    ready: the host is not what bounds the step (no device idle gap). The numbers come from the
    engine's timing hook (`Engine.step_timings`, one `StepTiming` per step).
    """

    def __init__(self, engine):
        self.last_wait = 0.0
        self.compile_s = 0.0
        self.compile_calls = 0
        self.shapes: dict[str, int] = {}  # "T x B x M" of each dispatched step -> steps run with it
        self.last_shape = None
        self.phases = []  # every step's StepTiming since the last take_phases()
        engine.step_timings = self.record

    def take_phases(self) -> dict:
        """Median ms per step of each host phase (process without its wait) since the last call."""
        steps, self.phases = self.phases, []
        if not steps:
            return {}
        phase = {"schedule": lambda s: s.schedule, "prepare": lambda s: s.prepare, "dispatch": lambda s: s.dispatch,
                 "process": lambda s: s.process - s.wait}
        return {name: 1e3 * statistics.median(map(f, steps)) for name, f in phase.items()}

    def record(self, timing) -> None:
        self.last_wait += timing.wait
        self.phases.append(timing)
        if timing.shape is not None:
            self.last_shape = timing.shape
            key = "x".join(map(str, timing.shape))
            self.shapes[key] = self.shapes.get(key, 0) + 1
        if timing.compiled:
            self.compile_s += timing.dispatch
            self.compile_calls += 1

    def take_wait(self) -> float:
        wait, self.last_wait = self.last_wait, 0.0
        return wait


def random_prompt(rng, vocab: int, n: int) -> list[int]:
    return rng.integers(0, vocab, size=n).tolist()


def decode_fill_steps(batch: int, context: int, chunk: int) -> int:
    """Upper bound on the steps that prefill `batch` prompts (decode rows share the budget)."""
    return math.ceil(batch * context / max(1, chunk - batch)) + 2


def run_decode(engine, timer, rng, batch: int, args, chunk: int) -> dict:
    from jtp.core.sampling_params import SamplingParams

    cfg = engine.cfg
    max_tokens = (decode_fill_steps(batch, args.context, chunk)
                  + (args.warmup_steps + args.decode_steps) * args.num_scheduler_steps + 8)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rids = [engine.submit(random_prompt(rng, cfg.vocab_size, args.context), params) for _ in range(batch)]
    outs = [engine.outputs.stream(r) for r in rids]
    t = time.perf_counter()
    fill_steps = 0
    while any(not o.request.output_ids for o in outs):
        engine.step()
        fill_steps += 1
    fill_s = time.perf_counter() - t
    for _ in range(args.warmup_steps):
        engine.step()
    context_before = [o.request.num_tokens for o in outs]
    step_s, runner_s, tokens, rows = [], [], 0, []
    spec_before = engine.stats()
    t_all = time.perf_counter()
    timer.take_wait()
    timer.take_phases()
    for _ in range(args.decode_steps):
        t = time.perf_counter()
        events = engine.step()
        step_s.append(time.perf_counter() - t)
        runner_s.append(timer.take_wait())
        tokens += sum(len(e.token_ids) for e in events)
        rows.append(len({e.request_id for e in events}))
    total_s = time.perf_counter() - t_all
    spec = engine.stats()
    finished_early = sum(o.request.finish_reason is not None for o in outs)
    T, B_pad, M = timer.last_shape
    for r in rids:
        engine.abort(r)
        engine.release(r)
    return dict(
        batch=batch,
        context_mean=statistics.fmean(context_before),
        context_max=max(context_before),
        fill_steps=fill_steps,
        fill_s=fill_s,
        steps=args.decode_steps,
        tokens=tokens,
        rows_min=min(rows),
        rows_max=max(rows),
        finished_early=finished_early,
        total_s=total_s,
        tokens_per_s=tokens / total_s,
        decode_steps_per_dispatch=tokens / max(1, batch * args.decode_steps),
        ms_per_step_median=1e3 * statistics.median(step_s),
        ms_per_step_mean=1e3 * total_s / args.decode_steps,
        ms_per_step_max=1e3 * max(step_s),  # tokens/s counts every step: one slow step shows here
        wait_ms_per_step_median=1e3 * statistics.median(runner_s),
        host_ms_per_step_median=1e3 * statistics.median(s - r for s, r in zip(step_s, runner_s)),
        host_phases_ms_median=timer.take_phases(),
        plan_shape_TxBxM=[T, B_pad, M],
        speculative=None if engine.speculative is None else speculation_counts(spec_before, spec),
    )


def speculation_counts(before, after) -> dict:
    """Drafts verified in the timed steps: rows, tokens drafted and accepted, and the two rates."""
    rows = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return dict(rows=rows, draft_tokens=drafted, accepted_tokens=accepted,
                acceptance_rate=accepted / drafted if drafted else 0.0,
                mean_accepted_length=1 + accepted / rows if rows else 0.0)


def attention_probe(runner, batch: int, context: int, shape, iters: int = 20, seed: int = 0) -> dict | None:
    """Time the attention call alone for one layer at a decode step's exact shapes (T, B, M).

    Uses the runner's own attention (`runner.attention`, whatever it dispatches to) on layer 0's real KV
    buffers with random block tables; x attention layers gives its share of a decode step.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jtp.models.attention import AttentionMetadata, LayerKV

    cfg = runner.cfg
    kv = next((c for c in runner.cache if isinstance(c, LayerKV)), None)
    if runner.tp != 1 or not isinstance(kv, LayerKV):
        return None
    T, B_pad, M = shape
    num_blocks, bs = kv.k.shape[:2]
    rng = np.random.default_rng(seed)
    tables = np.zeros((B_pad, M), np.int32)
    tables[:batch] = rng.integers(0, num_blocks, size=(batch, M))
    positions = np.zeros(T, np.int32)
    positions[:batch] = context - 1
    token_rows = np.zeros(T, np.int32)
    token_rows[:batch] = np.arange(batch)
    context_lens = np.zeros(B_pad, np.int32)
    context_lens[:batch] = context
    row_starts = np.full(B_pad, batch, np.int32)
    row_starts[:batch] = np.arange(batch)
    row_lens = (context_lens > 0).astype(np.int32)
    meta = AttentionMetadata(positions, np.full(T, -1, np.int32), token_rows, tables, context_lens, row_starts,
                             row_lens, np.full(B_pad, -1, np.int32), np.arange(1, dtype=np.int32))
    meta = jax.tree.map(jnp.asarray, meta)  # query_bound of length 1: a decode step, like the runner's
    q = jax.random.normal(jax.random.PRNGKey(seed), (T, cfg.num_heads, cfg.head_dim), jnp.float32).astype(kv.k.dtype)

    def chained(attend: bool):
        """`iters` calls in one jitted loop, each call's q depending on the last output, so the device
        time is measured, not a host dispatch per call (which alone exceeds a B=1 call on a GPU)."""
        def body(_, q, k, v, meta):
            o = runner.attention(q, LayerKV(k, v), meta, scale=cfg.head_dim**-0.5) if attend else q
            return q + (jnp.sum(o.astype(jnp.float32)) * 1e-30).astype(q.dtype)

        return jax.jit(lambda q, k, v, meta: jax.lax.fori_loop(0, iters, lambda i, q: body(i, q, k, v, meta), q))

    timed = {}
    for attend in (True, False):  # the loop alone is subtracted
        fn = chained(attend)
        fn(q, kv.k, kv.v, meta).block_until_ready()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn(q, kv.k, kv.v, meta).block_until_ready()
            times.append((time.perf_counter() - t) / iters)
        timed[attend] = statistics.median(times)
    layers = sum(1 for i in range(cfg.num_layers) if not cfg.is_linear_layer(i))
    per_layer = max(timed[True] - timed[False], 0.0)
    return dict(attention_ms_per_layer=1e3 * per_layer, attention_layers=layers,
                attention_ms_per_step_est=1e3 * per_layer * layers)


def run_prefill(engine, rng, args) -> dict:
    from jtp.core.sampling_params import SamplingParams

    cfg, L = engine.cfg, args.prefill_len
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft() -> float:
        prompt = random_prompt(rng, cfg.vocab_size, L)
        t = time.perf_counter()
        rid = engine.submit(prompt, one)
        res = engine.result(rid)
        dt = time.perf_counter() - t
        engine.release(rid)
        assert len(res.token_ids) == 1, res
        return dt

    warm = ttft()  # compiles this prompt's shapes
    runs = [ttft() for _ in range(args.prefill_runs)]
    prompts = [random_prompt(rng, cfg.vocab_size, L) for _ in range(args.prefill_requests)]
    t = time.perf_counter()
    rids = [engine.submit(p, one) for p in prompts]
    results = [engine.result(r) for r in rids]
    batch_s = time.perf_counter() - t
    for r in rids:
        engine.release(r)
    return dict(
        prompt_len=L,
        warmup_s=warm,
        ttft_runs_s=runs,
        ttft_ms=1e3 * statistics.median(runs),
        single_tokens_per_s=L / statistics.median(runs),
        requests=len(prompts),
        tokens=sum(len(r.prompt_token_ids) for r in results),
        batch_s=batch_s,
        tokens_per_s=L * len(prompts) / batch_s,
    )


# ----------------------------------------------------------------------------- HF (subprocess)


def hf_worker(args) -> int:
    """Runs in its own process: torch + transformers, eager, on the same weights."""
    import numpy as np
    import torch
    import transformers

    out: dict = {"torch": torch.__version__, "transformers": transformers.__version__}
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out["device"] = torch.cuda.get_device_name(0) if dev.type == "cuda" else platform.processor() or "cpu"
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def save():
        args.hf_out.write_text(json.dumps(out, indent=1))

    t = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(args.model), dtype=dtype).to(dev).eval()
    out["load_s"] = time.perf_counter() - t
    out["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(args.seed + 1)
    out["decode"] = []
    save()

    with torch.inference_mode():
        for B in args.batch_sizes:
            try:
                ids = torch.as_tensor(rng.integers(0, vocab, (B, args.context)), device=dev)
                t = time.perf_counter()
                o = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                nxt = o.logits[:, -1].argmax(-1, keepdim=True)
                past = o.past_key_values
                sync()
                fill_s = time.perf_counter() - t
                for _ in range(args.warmup_steps):
                    o = model(input_ids=nxt, past_key_values=past, use_cache=True)
                    nxt, past = o.logits[:, -1].argmax(-1, keepdim=True), o.past_key_values
                sync()
                t = time.perf_counter()
                for _ in range(args.decode_steps):
                    o = model(input_ids=nxt, past_key_values=past, use_cache=True)
                    nxt, past = o.logits[:, -1].argmax(-1, keepdim=True), o.past_key_values
                sync()
                dt = time.perf_counter() - t
                out["decode"].append(dict(batch=B, context=args.context, steps=args.decode_steps, fill_s=fill_s,
                                          tokens=B * args.decode_steps, total_s=dt,
                                          tokens_per_s=B * args.decode_steps / dt,
                                          ms_per_step=1e3 * dt / args.decode_steps))
            except Exception as e:  # noqa: BLE001 - OOM at a large batch: record and go on
                out["decode"].append(dict(batch=B, error=f"{type(e).__name__}: {str(e)[:300]}"))
            finally:
                o = past = None
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            save()
        try:
            L = args.prefill_len
            runs = []
            for i in range(1 + args.prefill_runs):
                ids = torch.as_tensor(rng.integers(0, vocab, (1, L)), device=dev)
                sync()
                t = time.perf_counter()
                o = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                o.logits[:, -1].argmax(-1).item()
                if i:
                    runs.append(time.perf_counter() - t)
            out["prefill"] = dict(prompt_len=L, ttft_runs_s=runs, ttft_ms=1e3 * statistics.median(runs),
                                  tokens_per_s=L / statistics.median(runs))
        except Exception as e:  # noqa: BLE001
            out["prefill"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    if dev.type == "cuda":
        out["peak_device_bytes"] = torch.cuda.max_memory_allocated()
    save()
    return 0


def run_hf(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "hf.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--hf-worker", "--hf-out", str(out),
               "--model", str(args.model), "--batch-sizes", ",".join(map(str, args.batch_sizes)),
               "--context", str(args.context), "--prefill-len", str(args.prefill_len), "--dtype", args.dtype,
               "--decode-steps", str(args.decode_steps), "--warmup-steps", str(args.warmup_steps),
               "--prefill-runs", str(args.prefill_runs), "--seed", str(args.seed)]
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.hf_timeout)
            rc, tail = proc.returncode, (proc.stderr or "")[-2000:]
        except subprocess.TimeoutExpired as e:
            rc, tail = "timeout", str(e.stderr or "")[-2000:]
        result = json.loads(out.read_text()) if out.is_file() else {}
        result["wall_s"] = time.perf_counter() - t
        if rc != 0:
            result["error"] = f"HF subprocess exited with {rc}: {tail}"
        return result


# ----------------------------------------------------------------------------- report


def add_rooflines(res: dict) -> None:
    fig, ceil, tp = res["model"], res["ceilings"], res["engine"]["tensor_parallel_size"]
    bw, rate = ceil["copy_bandwidth_Bps"] * tp, ceil["matmul_flops_per_s"] * tp  # all devices together
    for d in res["decode"]:
        nbytes = touched_weight_bytes(fig, d["batch"]) + d["batch"] * (
            d["context_mean"] * fig["kv_bytes_per_token"] + fig.get("state_bytes_per_seq_step", 0))
        d["roofline_bytes_per_step"] = nbytes
        # per dispatch: a multi-step dispatch reads the weights once per step, a verify step once
        steps = 1 if d.get("speculative") else d.get("decode_steps_per_dispatch", 1)
        d["roofline_ms_per_step"] = 1e3 * nbytes / bw * steps
        d["roofline_tokens_per_s"] = d["batch"] / (nbytes / bw)
        d["fraction_of_roofline"] = d["tokens_per_s"] / d["roofline_tokens_per_s"]
        d["achieved_bandwidth_Bps"] = nbytes * d["tokens_per_s"] / d["batch"]  # one weight read per decode step
    p = res.get("prefill")
    if p:
        flops = prefill_flops(fig, p["prompt_len"])
        floor_s = max(flops / rate, touched_weight_bytes(fig, p["prompt_len"]) / bw)
        p["roofline_flops"] = flops
        p["roofline_ttft_ms"] = 1e3 * floor_s
        p["roofline_tokens_per_s"] = p["prompt_len"] / floor_s
        p["fraction_of_roofline"] = p["tokens_per_s"] / p["roofline_tokens_per_s"]
        p["achieved_flops_per_s"] = flops * p["requests"] / p["batch_s"]


def markdown(res: dict) -> str:
    hw, m, e, c = res["hardware"], res["model"], res["engine"], res["ceilings"]
    hf = res.get("hf") or {}
    hf_dec = {d["batch"]: d for d in hf.get("decode", []) if "tokens_per_s" in d}
    lines = [
        f"# jtp benchmark: {Path(res['model_dir']).name}",
        "",
        "```",
        res["command"],
        "```",
        "",
        f"- hardware: {hw['device_count']} x {hw['device_kind']} ({hw['platform']}), jax {hw['jax_version']}, "
        f"jaxlib {hw['jaxlib_version']}, python {hw['python']}; XLA_FLAGS={hw['xla_flags'] or '(none)'}",
        f"- model: {m['model_type']} {m['num_layers']} layers, hidden {m['hidden_size']}, heads {m['num_heads']}/"
        f"{m['num_kv_heads']} (head_dim {m['head_dim']}), intermediate {m['intermediate_size']}, vocab "
        f"{m['vocab_size']}, tied={m['tie_word_embeddings']}; {m['params'] / 1e9:.3f} B params, "
        f"{m['param_bytes'] / GiB:.2f} GiB ({res['dtype']}); {m['kv_bytes_per_token'] / 1024:.1f} KiB of K/V per token",
        f"- engine: tp={e['tensor_parallel_size']}, max_num_seqs={e['max_num_seqs']}, max_num_batched_tokens="
        f"{e['max_num_batched_tokens']}, KV pool {e['num_blocks']} blocks x {e['block_size']} = {e['kv_pool_tokens']:,} "
        f"tokens ({e['kv_pool_bytes'] / GiB:.2f} GiB), max_model_len={e['max_model_len']}, "
        f"{'expert parallelism, ' if e.get('expert_parallel') else ''}"
        f"{'random weights drawn on the devices in' if e.get('load_format') == 'dummy' else 'load'} {e['load_s']:.1f} s",
        f"- ceilings measured in this run (device 0): copy {rate(c['copy_bandwidth_Bps'], 'B/s')} "
        f"(read+write, {c['copy_bytes'] / GiB:.2f} GiB buffer; best of "
        + ", ".join(f"{m} {rate(v, 'B/s')}" for m, v in c.get("copy_bandwidth_by_method_Bps", {}).items())
        + f"), {c['matmul_dtype']} matmul "
        f"{rate(c['matmul_flops_per_s'], 'FLOP/s')} (n={c['matmul_n']})",
    ]
    mem = res.get("memory", {})
    if mem.get("peak_device_bytes") is not None:
        lines.append(f"- peak device memory: {mem['peak_device_bytes'] / GiB:.2f} GiB "
                     f"(after load: {mem['bytes_in_use_after_load'] / GiB:.2f} GiB incl. KV pool)")
    if res.get("compile"):
        lines.append(f"- compilation: {res['compile']['calls']} step shapes compiled, "
                     f"{res['compile']['seconds']:.1f} s in those first calls")
    if hf:
        lines.append(f"- HF: transformers {hf.get('transformers')} / torch {hf.get('torch')}, eager, attention "
                     f"{hf.get('attn_implementation')}, on {hf.get('device')}" + (
                         f"; error: {hf['error'][:300]}" if hf.get("error") else ""))
    lines += [
        "",
        "| measurement | jtp | roofline | jtp / roofline | HF eager | jtp / HF |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for d in res["decode"]:
        h = hf_dec.get(d["batch"])
        ratio = d["tokens_per_s"] / h["tokens_per_s"] if h else None
        lines.append(
            f"| decode B={d['batch']}, ctx≈{d['context_mean']:.0f}: tokens/s | {fmt(d['tokens_per_s'])} | "
            f"{fmt(d['roofline_tokens_per_s'])} | {pct(d['fraction_of_roofline'])} | "
            f"{fmt(h['tokens_per_s']) if h else '—'} | {fmt(ratio, 2) + '×' if ratio else '—'} |")
        lines.append(
            f"| decode B={d['batch']}: ms/dispatch of {d['decode_steps_per_dispatch']:.1f} decode steps "
            f"(waiting on device / host work) | {fmt(d['ms_per_step_median'], 2)} "
            f"({fmt(d['wait_ms_per_step_median'], 2)} / {fmt(d['host_ms_per_step_median'], 2)}) | "
            f"{fmt(d['roofline_ms_per_step'], 2)} | | {fmt(h['ms_per_step'], 2) if h else '—'} | |")
        if d.get("speculative"):
            sp = d["speculative"]
            lines.append(
                f"| decode B={d['batch']}: drafts accepted / drafted (rate, mean accepted length) | "
                f"{sp['accepted_tokens']} / {sp['draft_tokens']} ({pct(sp['acceptance_rate'])}, "
                f"{sp['mean_accepted_length']:.2f}) | | | | |")
        if "attention_ms_per_step_est" in d:
            kv_ms = 1e3 * d["batch"] * d["context_mean"] * res["model"]["kv_bytes_per_token"] / (
                res["ceilings"]["copy_bandwidth_Bps"] * res["engine"]["tensor_parallel_size"])
            lines.append(
                f"| decode B={d['batch']}: attention ms/step (probe x {d['attention_layers']} layers) | "
                f"{fmt(d['attention_ms_per_step_est'], 2)} | {fmt(kv_ms, 2)} (K/V read) | "
                f"{pct(kv_ms / d['attention_ms_per_step_est']) if d['attention_ms_per_step_est'] else '—'} | | |")
    p = res.get("prefill")
    if p:
        hp = hf.get("prefill") or {}
        hp_ok = "ttft_ms" in hp
        lines.append(
            f"| prefill {p['prompt_len']} tokens x {p['requests']}: tokens/s | {fmt(p['tokens_per_s'])} | "
            f"{fmt(p['roofline_tokens_per_s'])} | {pct(p['fraction_of_roofline'])} | "
            f"{fmt(hp['tokens_per_s']) if hp_ok else '—'} | "
            f"{fmt(p['tokens_per_s'] / hp['tokens_per_s'], 2) + '×' if hp_ok else '—'} |")
        lines.append(
            f"| TTFT, one {p['prompt_len']}-token prompt: ms | {fmt(p['ttft_ms'], 1)} | {fmt(p['roofline_ttft_ms'], 2)} | "
            f"{pct(p['roofline_ttft_ms'] / p['ttft_ms'])} | {fmt(hp['ttft_ms'], 1) if hp_ok else '—'} | |")
    lines += [
        "",
        "Decode roofline: (weight bytes read per step + batch x context x K/V bytes per token) / measured copy "
        "bandwidth; on MoE models only the routed experts a step touches count, E (1 - (1 - k/E)^tokens) per layer "
        "(uniform routing). Prefill roofline: (2 x matmul params x tokens + causal attention + one lm_head row) / measured "
        "matmul rate (or the weight read, if longer). ms/step is the median engine.step(); device = the runner "
        "call (plan upload, jitted step, result download), host = scheduling and bookkeeping. The attention row "
        "times the engine's paged_attention alone, for one layer at the decode step's padded shapes (T x B x M), "
        "as device time (calls chained in one jitted loop, the loop's own cost subtracted), times the number of "
        "attention layers.",
    ]
    skipped = res.get("skipped")
    if skipped:
        lines.append(f"\nSkipped (time budget): {', '.join(skipped)}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from jtp.config.engine_args import EngineArgs

    args.model = Path(EngineArgs(model=args.model).model_dir())  # the demo when None, a repo id's snapshot
    if args.hf_worker:
        return hf_worker(args)

    clock = Clock(args.max_seconds)
    import jax
    import numpy as np

    from jtp.config.engine_args import EngineArgs
    from jtp.config.engine_config import EngineConfig
    from jtp.engine.engine import Engine

    max_b = max(args.batch_sizes)
    bs = args.block_size
    chunk = args.max_num_batched_tokens or max(args.prefill_len, 2 * max_b)
    decode_tokens = (decode_fill_steps(max_b, args.context, chunk)
                     + (args.warmup_steps + args.decode_steps) * args.num_scheduler_steps + 8)
    per_seq_blocks = -(-(args.context + decode_tokens) // bs) + 1
    prefill_blocks = args.prefill_requests * (-(-(args.prefill_len + 1) // bs) + 1)
    num_blocks = max(max_b * per_seq_blocks, prefill_blocks)
    max_model_len = max(args.context + decode_tokens, args.prefill_len + 1)
    # One EngineArgs for the engine and (multi-process) its followers.
    engine_args = EngineArgs(
        model=str(args.model), tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype,
        max_num_seqs=max_b, max_num_batched_tokens=chunk, block_size=bs, num_blocks=num_blocks,
        max_model_len=max_model_len, skip_tokenizer_init=True, num_processes=args.num_processes,
        num_scheduler_steps=args.num_scheduler_steps, speculative_config=args.speculative_config,
        enable_expert_parallel=args.enable_expert_parallel, load_format=args.load_format,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    group = devices = None
    if args.num_processes > 1:  # before anything touches a device: the group joins JAX's runtime first
        from jtp.distributed.group import start_leader

        group, devices = start_leader(engine_args)

    res: dict = {
        "command": " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], Path.cwd())] + sys.argv[1:])
        if argv is None else " ".join(shlex.quote(a) for a in ["scripts/bench.py", *argv]),
        "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model_dir": str(args.model),
        "dtype": args.dtype,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "skipped": [],
    }
    def save() -> None:
        res["total_s"] = clock.elapsed()
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(res, indent=1) + "\n")

    dev0 = jax.local_devices()[0]
    res["hardware"] = dict(
        platform=dev0.platform,
        device_kind=dev0.device_kind,
        device_count=jax.device_count(),
        jax_version=jax.__version__,
        jaxlib_version=getattr(jax.lib, "__version__", None) or _jaxlib_version(),
        python=platform.python_version(),
        host=platform.node(),
        cpu_count=os.cpu_count(),
        xla_flags=os.environ.get("XLA_FLAGS", ""),
    )
    log(f"{res['hardware']['device_count']} x {dev0.device_kind}, jax {jax.__version__}")

    on_gpu = dev0.platform not in ("cpu",)
    import jax.numpy as jnp

    dtype = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}[args.dtype]
    copy_bytes = int((args.copy_gib if args.copy_gib is not None else (2.0 if on_gpu else 1 / 16)) * GiB)
    matmul_n = args.matmul_n or (8192 if on_gpu else 512)
    log("measuring ceilings (copy, matmul)")
    res["ceilings"] = measure_ceilings(dev0, dtype, copy_bytes, matmul_n)
    c = res["ceilings"]
    log(f"copy {c['copy_bandwidth_Bps'] / 1e9:.1f} GB/s, matmul {c['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s")
    save()


    log(f"loading {args.model} (tp={args.tensor_parallel_size}, {args.dtype})")
    t = time.perf_counter()
    engine = Engine(EngineConfig.from_args(engine_args), group=group, devices=devices)
    jax.block_until_ready(engine.runner.params)
    load_s = time.perf_counter() - t
    runner = engine.runner
    stats = runner.memory_stats() or {}
    res["engine"] = dict(
        tensor_parallel_size=runner.tp,
        num_processes=args.num_processes,
        max_num_seqs=max_b,
        max_num_batched_tokens=chunk,
        block_size=bs,
        num_blocks=num_blocks,
        kv_pool_tokens=num_blocks * bs,
        kv_pool_bytes=num_blocks * runner.bytes_per_block() * runner.tp,
        max_model_len=engine.max_model_len,
        load_s=load_s,
        load_format=args.load_format,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        expert_parallel=args.enable_expert_parallel,
    )
    res["model"] = model_figures(runner)
    res["memory"] = dict(bytes_in_use_after_load=stats.get("bytes_in_use"), bytes_limit=stats.get("bytes_limit"))
    log(f"loaded in {load_s:.1f}s: {res['model']['params'] / 1e9:.3f} B params, KV pool {num_blocks} blocks")
    save()

    timer = StepTimer(engine)
    rng = np.random.default_rng(args.seed)
    res["decode"] = []
    for B in args.batch_sizes:
        if clock.over():
            res["skipped"].append(f"decode B={B}")
            continue
        log(f"decode B={B}, context {args.context}")
        d = run_decode(engine, timer, rng, B, args, chunk)
        try:
            if group is not None:  # the probe runs on the leader alone; over a group's mesh it would hang
                raise RuntimeError("skipped: multi-process run")
            d.update(attention_probe(runner, B, round(d["context_mean"]), d["plan_shape_TxBxM"], seed=args.seed) or {})
        except Exception as e:  # noqa: BLE001 - the probe is a diagnostic; never lose the run for it
            d["attention_probe_error"] = f"{type(e).__name__}: {e}"
        res["decode"].append(d)
        log(f"  {d['tokens_per_s']:.1f} tokens/s, {d['ms_per_step_median']:.2f} ms/step (slowest {d['ms_per_step_max']:.1f}) "
            f"(waiting on device {d['wait_ms_per_step_median']:.2f}, attention est. {d.get('attention_ms_per_step_est', float('nan')):.2f}), "
            f"fill {d['fill_s']:.1f}s/{d['fill_steps']} steps")
        add_rooflines(res)
        save()

    if clock.over():
        res["skipped"].append("prefill")
    else:
        log(f"prefill {args.prefill_len} tokens")
        res["prefill"] = run_prefill(engine, rng, args)
        log(f"  TTFT {res['prefill']['ttft_ms']:.1f} ms, {res['prefill']['tokens_per_s']:.0f} tokens/s")
    res["compile"] = dict(calls=timer.compile_calls, seconds=timer.compile_s, step_traces=runner.compilations,
                          plan_shapes_TxBxM=timer.shapes)
    stats = runner.memory_stats() or {}
    res["memory"].update(peak_device_bytes=stats.get("peak_bytes_in_use"), peak_host_rss_bytes=host_peak_rss())
    add_rooflines(res)
    save()

    if args.hf:
        if clock.over():
            res["skipped"].append("hf")
        else:
            log("HF transformers (subprocess)")
            res["hf"] = run_hf(args)
            if res["hf"].get("error"):
                log(f"  HF: {res['hf']['error'][:500]}")
            for d in res["hf"].get("decode", []):
                jd = next((x for x in res["decode"] if x["batch"] == d["batch"]), None)
                if jd and "tokens_per_s" in d:
                    d["jtp_over_hf"] = jd["tokens_per_s"] / d["tokens_per_s"]
            save()

    if group is not None:
        engine.close()  # followers leave JAX's runtime before this process (which hosts it) exits
    md = markdown(res)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(md)
    save()
    print(md)
    return 0


def _jaxlib_version():
    try:
        import jaxlib

        return jaxlib.__version__
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    sys.exit(main())
