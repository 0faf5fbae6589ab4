"""The `jtp` command line.

    jtp generate [--model DIR] [--tensor-parallel-size N] [--max-tokens N] [--temperature T]
                 [--dtype float32|bfloat16] [--json] [--chat] PROMPT
    jtp convert --model DIR --output DIR            HF safetensors -> Orbax
    jtp batch ...                                   offline batch generation (scripts/generate_offline.py)

With no --model, `generate` runs the embedded demo checkpoint (random weights, created on
first use under checkpoints/; no downloads).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face model directory (default: the embedded demo checkpoint)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from device memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of device memory jtp may use, weights included, when sizing the KV pool")


def engine_from_args(args, model_dir: str):
    from jtp.engine import Engine

    return Engine(
        model_dir, args.tensor_parallel_size, args.dtype, max_num_seqs=args.max_num_seqs, num_blocks=args.num_blocks,
        memory_utilization=args.gpu_memory_utilization,
    )


def _model_dir(args) -> tuple[str, str | None]:
    if args.model:
        return args.model, None
    from jtp.demo import DEMO_LABEL, ensure_demo_checkpoint

    return str(ensure_demo_checkpoint()), DEMO_LABEL


def cmd_generate(args) -> int:
    from jtp.engine import RequestError
    from jtp.sampling import SamplingParams

    model_dir, label = _model_dir(args)
    engine = engine_from_args(args, model_dir)
    tok = engine.tokenizer
    if tok is None:
        print(f"error: {model_dir} has no tokenizer.json", file=sys.stderr)
        return 2
    text = args.prompt
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    prompt_ids = tok.encode(text)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    try:
        rid = engine.submit(prompt_ids, params)
    except RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        done = engine.result(rid)
        record = {
            "model": model_dir,
            "text": done.text,
            "token_ids": done.token_ids,
            "prompt_token_ids": prompt_ids,
            "finish_reason": done.finish_reason,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(done.token_ids)},
        }
        if label:
            record["note"] = label
        print(json.dumps(record, ensure_ascii=False))
        return 0
    if label:
        print(f"[{label}]", file=sys.stderr)
    for event in engine.stream(rid):
        sys.stdout.write(event.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_convert(args) -> int:
    from jtp.weights import convert_to_orbax

    out = convert_to_orbax(args.model, args.output, None if args.dtype == "auto" else args.dtype)
    print(f"wrote {out}")
    return 0


def cmd_batch(args) -> int:
    from jtp.batch import run_args

    return run_args(args)


def enable_compilation_cache() -> None:
    """Persist compiled steps across runs, so the second start of a model skips XLA compilation.

    JTP_COMPILATION_CACHE sets the directory ("" turns it off); default ~/.cache/jtp/xla.
    """
    import os
    from pathlib import Path

    import jax

    path = os.environ.get("JTP_COMPILATION_CACHE", str(Path.home() / ".cache" / "jtp" / "xla"))
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jtp", description="JAX/XLA inference for the Qwen3 family")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt")
    _engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("prompt")
    gen.set_defaults(func=cmd_generate)

    conv = sub.add_parser("convert", help="HF safetensors -> Orbax checkpoint directory")
    conv.add_argument("--model", required=True)
    conv.add_argument("--output", required=True)
    conv.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    conv.set_defaults(func=cmd_convert)

    from jtp.batch import add_arguments as batch_arguments

    batch = sub.add_parser("batch", help="offline batch generation: JSONL prompts in, JSONL completions out")
    _engine_args(batch)
    batch_arguments(batch)
    batch.set_defaults(func=cmd_batch)

    args, rest = parser.parse_known_args(argv)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    enable_compilation_cache()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
