"""Time to first token of a chat turn with one image, on a Qwen3.5-shaped model with its vision tower:
host preprocessing, the encoder (submit, which encodes the image into the engine's pool), and the
first token, against a text prompt of the same length. Random weights drawn on the devices.

    python scripts/make_random_checkpoint.py --preset qwen3.5-9b --out /tmp/q9 --config-only
    python scripts/image_ttft.py --model /tmp/q9 [--image-size 1024] [--runs 4] [--json OUT]

`--model` is a text model's config directory; the script wraps it into a composite Qwen3.5 config
with the released vision tower's shape (27 blocks of width 1152, patch 16, merge 2). The first image
compiles the encoder for its patch count (the "cold" run); later images of that size reuse it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VISION = dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, hidden_act="gelu_pytorch_tanh",
              in_channels=3, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
              num_position_embeddings=2304, model_type="qwen3_5_vision")
TOKENS = dict(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053, vision_end_token_id=248054)
PREPROCESSOR = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5],
                    image_std=[0.5, 0.5, 0.5], size={"shortest_edge": 65536, "longest_edge": 16777216})


def composite_dir(text_dir: Path, out: Path, depth: int, width: int) -> Path:
    text = json.loads((text_dir / "config.json").read_text())
    if text.get("model_type") not in ("qwen3_5_text", "qwen3_5"):
        raise SystemExit(f"{text_dir}: a qwen3_5_text config is needed, got {text.get('model_type')!r}")
    text = text.get("text_config", text)
    config = dict(model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"], text_config=text,
                  vision_config={**VISION, "depth": depth, "hidden_size": width, "intermediate_size": VISION[
                      "intermediate_size"] * width // VISION["hidden_size"], "out_hidden_size": text["hidden_size"]},
                  tie_word_embeddings=text.get("tie_word_embeddings", False),
                  **(TOKENS if text["vocab_size"] > max(TOKENS.values())  # else a small vocabulary's last ids
                     else {k: text["vocab_size"] - 5 + i for i, k in enumerate(TOKENS)}))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    if (text_dir / "generation_config.json").exists():
        shutil.copy(text_dir / "generation_config.json", out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--image-size", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--vision-depth", type=int, default=VISION["depth"], help="smaller: a CPU smoke run")
    ap.add_argument("--vision-width", type=int, default=VISION["hidden_size"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import jax
    from PIL import Image

    from jtp.config.engine_args import EngineArgs
    from jtp.core.multimodal import ImagePrompt
    from jtp.core.sampling_params import SamplingParams
    from jtp.engine.engine import Engine
    from jtp.engine.image_processor import preprocess_images

    model = composite_dir(args.model, Path(tempfile.mkdtemp()) / "model", args.vision_depth, args.vision_width)
    t = time.perf_counter()
    engine = Engine.from_args(EngineArgs(model=str(model), load_format="dummy", dtype=args.dtype, max_model_len=min(8192, json.loads((model / "config.json").read_text())["text_config"].get("max_position_embeddings", 8192)),
                                         max_num_batched_tokens=2048, max_num_seqs=8, skip_tokenizer_init=True,
                                         enable_prefix_caching=False))
    engine.warmup()  # every step shape compiled, as `jtp serve` does before it is ready
    ready_s = time.perf_counter() - t
    engine.start()
    vision, rng = engine.vision, np.random.default_rng(0)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def first_token_s(ids, images) -> tuple[float, float]:
        t0 = time.perf_counter()
        rid = engine.submit(ids, params, images=images)
        jax.block_until_ready(engine.runner.params.get("image_pool"))  # the encoder's work done (async otherwise)
        t1 = time.perf_counter()
        first = None
        for _ in engine.stream(rid):
            first = first or time.perf_counter()
        return t1 - t0, first - t0

    rows = []
    for run in range(args.runs):
        pixels = rng.integers(0, 256, (args.image_size, args.image_size, 3), dtype=np.uint8)
        t0 = time.perf_counter()
        inputs = preprocess_images([Image.fromarray(pixels)], vision.processor)
        preprocess_s = time.perf_counter() - t0
        text = rng.integers(0, 1000, 16).tolist()
        ids = text + [vision.vision_start_id]
        image = ImagePrompt.of(inputs.pixel_values, inputs.grid_thw[0], len(ids), vision.merge_size)
        ids += [vision.image_token_id] * image.num_tokens + [vision.vision_end_id] + text
        before = engine.runner.compilations
        submit_s, ttft_s = first_token_s(ids, [image])
        compiled = engine.runner.compilations - before
        _, text_ttft_s = first_token_s(rng.integers(0, 1000, len(ids)).tolist(), [])
        rows.append(dict(run=run, cold=run == 0, grid=list(image.grid_thw), image_tokens=image.num_tokens,
                         prompt_tokens=len(ids), step_compilations=compiled, preprocess_ms=1e3 * preprocess_s, encode_ms=1e3 * submit_s,
                         ttft_ms=1e3 * ttft_s, text_ttft_ms=1e3 * text_ttft_s,
                         total_ms=1e3 * (preprocess_s + ttft_s)))
    engine.close()
    device = jax.devices()[0].device_kind
    print(f"# one {args.image_size}x{args.image_size} image, Qwen3.5 vision tower ({args.vision_depth} x "
          f"{args.vision_width}) + {args.model.name} "
          f"text model, {args.dtype}, {device}; engine ready in {ready_s:.1f} s")
    print("| run | image tokens | prompt tokens | step compilations | preprocess ms | encode ms (submit) | "
          "TTFT ms (from submit) | text-only TTFT ms, same length | preprocess + TTFT ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['run']}{' (cold)' if r['cold'] else ''} | {r['image_tokens']} | {r['prompt_tokens']} | "
              f"{r['step_compilations']} | "
              f"{r['preprocess_ms']:.1f} | {r['encode_ms']:.1f} | {r['ttft_ms']:.1f} | {r['text_ttft_ms']:.1f} | "
              f"{r['total_ms']:.1f} |")
    warm = rows[1:] or rows
    summary = {k: statistics.median(r[k] for r in warm) for k in ("preprocess_ms", "encode_ms", "ttft_ms",
                                                                 "text_ttft_ms", "total_ms")}
    print("warm medians: " + ", ".join(f"{k} {v:.1f}" for k, v in summary.items()))
    if args.json:
        args.json.write_text(json.dumps(dict(device=device, ready_s=ready_s, rows=rows, warm_medians=summary,
                                             model=args.model.name, image_size=args.image_size), indent=1))


if __name__ == "__main__":
    main()
