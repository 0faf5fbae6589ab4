#!/usr/bin/env python
"""Correctness on the device, for each model family at real shapes (random weights, nothing
downloaded), through the engine's real step (continuous batching, multi-step decode):

  1. float32 greedy tokens at tp=N equal tp=1, token for token, and the compiled decode step at
     tp=N holds the all-reduces tensor parallelism needs and nothing larger (jtp/parallel/collectives.py);
     the decode loop (8 steps a dispatch) gives one step per dispatch's tokens and logprobs;
  2. float32 top-20 logprobs against Hugging Face transformers (torch, float32, same device kind,
     TF32 off), teacher-forced on jtp's tokens: max |difference| <= --f32-tol;
  3. bfloat16 the same against transformers in bfloat16: max |difference| <= --bf16-tol (both
     round differently: this bounds, it does not equate), plus how often the argmaxes agree; or,
     where the two bf16 runs part by more (MoE routers: bf16 rounding flips experts in the top-k),
     jtp's bf16 no further from float32 transformers than transformers' own bf16 (mean |diff|,
     within 25%).
  4. with --fp8: a checkpoint in Qwen's FP8 format (written from the bf16 one), batched and one
     request at a time, in bfloat16 against transformers' bfloat16 on its dequantized weights (the
     model the file stands for; bound: 1.5 x the bf16 check's mean gap + 0.005); `--quantization
     fp8` and the FP8 KV cache against transformers on the unquantized weights (bound: --fp8-tol;
     for the weights, 1.25 x what the FP8 checkpoint itself loses if larger); each with how often
     the argmaxes agree.

    python3 scripts/gpu_check.py --out DIR [--fp8] [--presets qwen3-0.6b,qwen3-30b-a3b-4l,qwen3.5-0.8b,qwen3.5-35b-a3b-4l,qwen3-next-80b-a3b-4l] [--tp 2 | --tp 4,8]

Float32 runs with full-precision dots and without GEMM autotuning (set here before jax loads), so
tp=1 and tp=N differ only in the order of their reductions. Prints one line per check and writes
DIR/gpu_check.json; exits 1 if any check fails. On CPUs it runs the same checks (forced host
devices stand in for GPUs; tests/test_gpu_check.py runs it on the tiny presets).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), "--xla_gpu_autotune_level=0"]))
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402


def prompts_for(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def run_engine(model_dir: Path, tp: int, dtype: str, prompts, max_tokens: int, block_size: int,
               collectives: list | None = None, **engine_args) -> list[dict]:
    """Greedy completions with top-20 logprobs, all prompts batched through one engine. With a
    `collectives` list, also count the collectives of the engine's compiled decode step into it."""
    from jtp.config.engine_args import EngineArgs
    from jtp.core.sampling_params import SamplingParams
    from jtp.engine.engine import Engine
    from jtp.parallel.collectives import step_collectives

    longest = max(map(len, prompts)) + max_tokens
    engine = Engine.from_args(EngineArgs(**{**dict(
        model=str(model_dir), tensor_parallel_size=tp, dtype=dtype or "auto", max_num_seqs=8, max_num_batched_tokens=256,
        block_size=block_size, num_blocks=len(prompts) * (-(-longest // block_size)) + 8,
        max_model_len=longest + block_size, skip_tokenizer_init=True), **engine_args}))
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=20)
        outs = [dict(tokens=c.token_ids, top=c.top_logprobs) for c in engine.generate(prompts, params)]
        if collectives is not None:  # a decode step of 8 rows, at the engine's own bucketed shape
            buckets = engine.scheduler.buckets
            plan = engine.scheduler.padding_plan(*buckets.step_shape(8, 8, 1))
            collectives.append(step_collectives(engine.runner, plan))
        return outs
    finally:
        engine.close()


def hf_logprobs(model_dir: Path, dtype: str, prompts, outs) -> list[np.ndarray]:
    """log_softmax of transformers' logits at each generated position (teacher-forced)."""
    import torch
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    result = []
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            ids = torch.tensor([prompt + out["tokens"]], device=device)
            logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(out["tokens"])]
            result.append(torch.log_softmax(logits.float(), -1).cpu().numpy())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def compare_logprobs(outs, ref: list[np.ndarray]) -> dict:
    diffs, agree, total = [], 0, 0
    for out, lp in zip(outs, ref):
        for i, (token, top) in enumerate(zip(out["tokens"], out["top"])):
            diffs += [abs(v - float(lp[i, t])) for t, v in top.items()]
            agree += int(np.argmax(lp[i]) == token)
            total += 1
    return dict(max_abs_diff=float(max(diffs)), mean_abs_diff=float(np.mean(diffs)), argmax_agreement=agree / total)


def check_preset(preset: str, args, root: Path) -> list[dict]:
    import jax
    from make_random_checkpoint import write_checkpoint

    model_dir = root / preset
    if not (model_dir / "model.safetensors").is_file():  # one file (quantize_checkpoint's input); stale shards go
        write_checkpoint(preset, model_dir, dtype="bfloat16", quiet=True, shard_gib=256,
                         generator="jax" if jax.default_backend() == "gpu" else "numpy")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = prompts_for(vocab, args.prompt_lengths)
    checks = []

    def record(name, ok, **detail):
        checks.append(dict(preset=preset, check=name, ok=bool(ok), **detail))
        print(f"{'PASS' if ok else 'FAIL'} {preset}: {name} {json.dumps(detail)}", flush=True)

    f32 = {1: run_engine(model_dir, 1, "float32", prompts, args.tokens, args.block_size)}
    for tp in (tp for tp in args.tp if tp > 1):  # with one device there is nothing to compare against
        t = time.perf_counter()
        found: list = []
        f32[tp] = run_engine(model_dir, tp, "float32", prompts, args.tokens, args.block_size, found)
        same = [a["tokens"] == b["tokens"] for a, b in zip(f32[1], f32[tp])]
        first_diff = [next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
                      for a, b in zip(f32[1], f32[tp])]
        record(f"float32 greedy tokens, tp={tp} == tp=1", all(same), prompts=len(prompts), tokens=args.tokens,
               first_difference=first_diff, seconds=round(time.perf_counter() - t, 1))
        record(f"decode step collectives at tp={tp}: 2 x layers + 1 all-reduces of [T, H], nothing larger",
               found[0].ok, **found[0].summary())

    # The decode loop (one CUDA graph on a GPU, its while loop a conditional node) against one step per dispatch.
    t = time.perf_counter()
    looped = run_engine(model_dir, 1, "float32", prompts, args.tokens, args.block_size, num_scheduler_steps=8)
    stats = compare_logprobs(looped, [top_as_dense(o, vocab) for o in f32[1]])
    record("decode loop (--num-scheduler-steps 8): float32 greedy tokens and top-20 logprobs == one step per dispatch",
           [o["tokens"] for o in looped] == [o["tokens"] for o in f32[1]] and stats["max_abs_diff"] <= args.f32_tol,
           tolerance=args.f32_tol, **stats, seconds=round(time.perf_counter() - t, 1))

    t = time.perf_counter()
    stats = compare_logprobs(f32[1], hf_logprobs(model_dir, "float32", prompts, f32[1]))
    record("float32 top-20 logprobs vs transformers", stats["max_abs_diff"] <= args.f32_tol, tolerance=args.f32_tol,
           **stats, seconds=round(time.perf_counter() - t, 1))

    t = time.perf_counter()
    bf16 = run_engine(model_dir, 1, "bfloat16", prompts, args.tokens, args.block_size)
    stats = compare_logprobs(bf16, hf_logprobs(model_dir, "bfloat16", prompts, bf16))
    # Both bf16 runs also against float32 transformers on the same tokens: on MoE models bf16
    # rounding alone changes a token's top-k experts in a few % of (token, layer) pairs, in either
    # implementation, so two bf16 runs can differ by more than the tolerance while each is as close
    # to float32 as the other. Then the check asks that jtp be no further from float32 than HF is.
    exact = hf_logprobs(model_dir, "float32", prompts, bf16)
    ours = compare_logprobs(bf16, exact)
    theirs = compare_hf(hf_logprobs(model_dir, "bfloat16", prompts, bf16), exact, bf16)
    peer_ok = ours["mean_abs_diff"] <= 1.25 * theirs["mean_abs_diff"]
    record("bfloat16 top-20 logprobs vs transformers", stats["max_abs_diff"] <= args.bf16_tol or peer_ok,
           tolerance=args.bf16_tol, **stats, jtp_bf16_vs_f32=ours, hf_bf16_vs_f32=theirs,
           seconds=round(time.perf_counter() - t, 1))
    if args.fp8:
        checks_fp8(model_dir, prompts, args, record, bf16_mean=stats["mean_abs_diff"])
    return checks


def checks_fp8(model_dir: Path, prompts, args, record, bf16_mean: float) -> None:
    """FP8 weights and the FP8 KV cache, each in bfloat16.

    Qwen's FP8 format (scripts/quantize_checkpoint.py writes the checkpoint's copy: float8 values,
    bf16 block scales) is checked against transformers' bf16 on *its dequantized weights*, the model
    the file stands for: the FP8 kernels must then be as close as jtp's bf16 is to transformers on
    the original (mean |diff| <= 1.5 x the bf16 check's + 0.005), whatever the quantization costs.
    Batched, and one request at a time (every decode step the one-token shape: the GEMV kernel's).
    `--quantization fp8` (quantized at load, float32 scales) and the FP8 KV cache are checked against
    transformers on the unquantized weights, bounded by --fp8-tol; what weight quantization costs
    depends on the model (random hybrids lose more than Qwen3), so `--quantization fp8` may also
    lose up to 1.25 x what the FP8 checkpoint itself loses there."""
    import math

    import ml_dtypes
    from quantize_checkpoint import WEIGHTS, linear_modules, quantize_checkpoint, read_tensors, write_dequantized

    fp8_dir, decoded_dir = model_dir.with_name(model_dir.name + "-fp8"), model_dir.with_name(model_dir.name + "-fp8-decoded")
    if not (decoded_dir / "config.json").is_file():
        # Qwen's 128 x 128 blocks, or the largest power of two that splits the tiny presets' weights too.
        tensors = read_tensors(model_dir / WEIGHTS)
        dims = math.gcd(*(n for m in linear_modules(tensors) for n in tensors[m + ".weight"].shape))
        quantize_checkpoint(model_dir, fp8_dir, "fp8", block=math.gcd(dims, 128))
        write_dequantized(fp8_dir, decoded_dir, ml_dtypes.bfloat16)
    bound = 1.5 * bf16_mean + 0.005
    lost = []  # what each FP8 checkpoint run loses against the unquantized weights
    for name, engine_args in (("FP8 checkpoint", {}), ("FP8 checkpoint, one request at a time", dict(max_num_seqs=1))):
        t = time.perf_counter()
        outs = run_engine(fp8_dir, 1, "bfloat16", prompts, args.tokens, args.block_size, **engine_args)
        stats = compare_logprobs(outs, hf_logprobs(decoded_dir, "bfloat16", prompts, outs))
        lost.append(compare_logprobs(outs, hf_logprobs(model_dir, "bfloat16", prompts, outs))["mean_abs_diff"])
        record(f"{name}: bfloat16 top-20 logprobs vs transformers' bfloat16 on the dequantized weights",
               stats["mean_abs_diff"] <= bound, tolerance=round(bound, 4), **stats, vs_unquantized_mean=round(lost[-1], 4),
               seconds=round(time.perf_counter() - t, 1))
    for name, engine_args, tol in (
            ("FP8 weights (--quantization fp8)", dict(quantization="fp8"), max(args.fp8_tol, 1.25 * max(lost))),
            ("FP8 KV cache", dict(kv_cache_dtype="fp8"), args.fp8_tol)):
        t = time.perf_counter()
        outs = run_engine(model_dir, 1, "bfloat16", prompts, args.tokens, args.block_size, **engine_args)
        stats = compare_logprobs(outs, hf_logprobs(model_dir, "bfloat16", prompts, outs))
        record(f"{name}: bfloat16 top-20 logprobs vs transformers' bfloat16", stats["mean_abs_diff"] <= tol,
               tolerance=round(tol, 4), **stats, seconds=round(time.perf_counter() - t, 1))


def top_as_dense(out: dict, vocab: int) -> np.ndarray:
    """A run's top-20 logprobs as [tokens, vocab] rows (-inf elsewhere): a reference for compare_logprobs."""
    dense = np.full((len(out["top"]), vocab), -np.inf, np.float32)
    for i, top in enumerate(out["top"]):
        dense[i, list(top)] = list(top.values())
    return dense


def compare_hf(hf_bf16: list[np.ndarray], exact: list[np.ndarray], outs) -> dict:
    """transformers' bf16 logprobs against float32, at the same top-20 ids compare_logprobs uses."""
    diffs, agree, total = [], 0, 0
    for out, lp, ref in zip(outs, hf_bf16, exact):
        for i, top in enumerate(out["top"]):
            diffs += [abs(float(lp[i, t]) - float(ref[i, t])) for t in top]
            agree += int(np.argmax(lp[i]) == np.argmax(ref[i]))
            total += 1
    return dict(max_abs_diff=float(max(diffs)), mean_abs_diff=float(np.mean(diffs)), argmax_agreement=agree / total)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--presets", default="qwen3-0.6b,qwen3-30b-a3b-4l,qwen3.5-0.8b,qwen3.5-35b-a3b-4l,qwen3-next-80b-a3b-4l")
    ap.add_argument("--tp", type=lambda s: [int(x) for x in s.split(",")], default=[2],
                    help="tensor-parallel sizes checked against tp=1, e.g. 4,8 (1: no such check, one device)")
    ap.add_argument("--tokens", type=int, default=24, help="greedy tokens per prompt")
    ap.add_argument("--prompt-lengths", type=lambda s: [int(x) for x in s.split(",")], default=[5, 37, 130, 300])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--f32-tol", type=float, default=2e-3)
    ap.add_argument("--bf16-tol", type=float, default=0.1)
    ap.add_argument("--fp8", action="store_true", help="also check FP8 weights and the FP8 KV cache")
    ap.add_argument("--fp8-tol", type=float, default=0.1, help="FP8 checks: mean |logprob difference|")
    ap.add_argument("--checkpoints", type=Path, default=Path("/tmp/gpu_check"), help="where the checkpoints go")
    args = ap.parse_args(argv)

    import jax

    args.out.mkdir(parents=True, exist_ok=True)
    devices = jax.devices()
    if len(devices) < max(args.tp):
        raise SystemExit(f"--tp {max(args.tp)} needs {max(args.tp)} devices; {len(devices)} visible")
    checks = []
    for preset in args.presets.split(","):
        checks += check_preset(preset, args, args.checkpoints)
    report = dict(devices=[str(d.device_kind) for d in devices], jax=jax.__version__, args=vars(args) | dict(
        out=str(args.out), checkpoints=str(args.checkpoints)), checks=checks,
        passed=all(c["ok"] for c in checks))
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(f"{sum(c['ok'] for c in checks)}/{len(checks)} checks passed on {len(devices)} x {devices[0].device_kind}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
