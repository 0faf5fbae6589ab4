"""Images through the engine against HF transformers' Qwen3_5ForConditionalGeneration (float32):
greedy tokens for prompts with one and with two images, at tp 1 and 2, with chunked prefill cutting
inside an image's tokens; the prefix cache keyed by the image's content; the encoder's pool reused
for a resent image."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_hybrid import ROPE, build_model, save_multimodal  # noqa: E402

from jtp.config.engine_args import EngineArgs  # noqa: E402
from jtp.core.multimodal import ImagePrompt  # noqa: E402
from jtp.core.sampling_params import SamplingParams  # noqa: E402
from jtp.engine.engine import Engine  # noqa: E402
from jtp.errors import RequestError  # noqa: E402

IDS = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)
PATCH_DIM = 3 * 2 * 16 * 16  # channels x temporal patch x patch x patch
TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # rope_theta 10: every M-RoPE row turns its frequencies by a large angle per position, so a row
    # mix-up changes the tokens (at 1e7 the height and width rows barely turn).
    model = build_model("qwen3_5", seed=5, vision=dict(depth=2), outer=IDS, rope_parameters={**ROPE, "rope_theta": 10.0})
    return model, save_multimodal(model, tmp_path_factory.mktemp("qwen3_5-images"))


def image(grid, seed):
    t, h, w = grid
    return np.random.default_rng(seed).normal(size=(t * h * w, PATCH_DIM)).astype(np.float32), grid


def prompt_with(images, text_seed=0):
    """Text, then each image's vision_start, placeholders, vision_end, then text: (ids, ImagePrompts)."""
    rng = np.random.default_rng(text_seed)
    ids, prompts = rng.integers(0, 110, 7).tolist(), []
    for pixels, grid in images:
        ids.append(IDS["vision_start_token_id"])
        prompts.append(ImagePrompt.of(pixels, grid, len(ids), 2))
        ids += [IDS["image_token_id"]] * prompts[-1].num_tokens + [IDS["vision_end_token_id"]]
        ids += rng.integers(0, 110, 5).tolist()
    return ids, prompts


def hf_greedy(model, ids, images) -> tuple[list[int], np.ndarray]:
    """HF's greedy tokens and each one's log-probability."""
    # mm_token_type_ids (the processor's: 1 at image tokens) is what makes HF lay out M-RoPE positions.
    extra = dict(pixel_values=torch.tensor(np.concatenate([p for p, _ in images])),
                 image_grid_thw=torch.tensor([g for _, g in images]),
                 mm_token_type_ids=(torch.tensor([ids]) == IDS["image_token_id"]).int()) if images else {}
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             **extra)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [torch.log_softmax(step[0].double(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, np.array(logprobs)


def make_engine(path, tp=1, pp=1, **overrides):
    args = dict(model=str(path), dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp, num_blocks=64, block_size=8,
                max_num_seqs=4, max_num_batched_tokens=16, skip_tokenizer_init=True, warmup=False) | overrides
    return Engine.from_args(EngineArgs(**args))


def greedy(engine, ids, prompts, logprobs: list | None = None) -> tuple[list[int], int]:
    """jtp's greedy tokens and the prompt tokens it found cached (each token's logprob into `logprobs`)."""
    rid = engine.submit(ids, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=0),
                        images=prompts)
    events = list(engine.stream(rid))
    assert events[-1].finish_reason == "length", events[-1]
    if logprobs is not None:
        logprobs += [lp for e in events for lp in e.logprobs or []]
    return [t for e in events for t in e.token_ids], events[-1].cached_tokens


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_image_prompts_give_hf_greedy_tokens(checkpoint, tp, pp):
    """At tp 1 and 2, and as two pipeline stages (the tower and image pool with stage 0)."""
    model, path = checkpoint
    one = [image((1, 8, 8), 1)]  # 16 image tokens: chunks of 16 tokens cut inside them
    two = [image((1, 8, 8), 1), image((1, 4, 6), 2)]
    engine = make_engine(path, tp, pp)
    try:
        assert engine.vision is not None and engine.runner.images is not None
        # Text alone through the same (multimodal) engine too: three equal M-RoPE rows.
        text = (np.random.default_rng(9).integers(0, 110, 20).tolist(), [])
        for (ids, prompts), images in ((prompt_with(one), one), (prompt_with(two), two), (text, [])):
            ours = []
            tokens = greedy(engine, ids, prompts, ours)[0]
            ref_tokens, ref_logprobs = hf_greedy(model, ids, images)
            assert tokens == ref_tokens, (tp, pp, len(images))
            np.testing.assert_allclose(ours, ref_logprobs, atol=2e-4, err_msg=f"tp={tp}, pp={pp}, {len(images)} image(s)")
    finally:
        engine.close()


def test_prefix_cache_is_keyed_by_the_image_and_the_pool_by_its_content(checkpoint):
    _, path = checkpoint
    engine = make_engine(path, enable_prefix_caching=True)
    try:
        first = [image((1, 8, 8), 1)]
        ids, prompts = prompt_with(first)
        tokens, cached = greedy(engine, ids, prompts)
        assert cached == 0 and engine.runner.images.encoded == 1
        again, cached = greedy(engine, ids, prompt_with(first)[1])  # the same image, sent again
        assert again == tokens and cached >= 16 and engine.runner.images.encoded == 1  # no second encode
        other = [image((1, 8, 8), 7)]  # same ids, another image: only the text before it may be reused
        other_ids, other_prompts = prompt_with(other)
        assert other_ids == ids
        _, cached = greedy(engine, other_ids, other_prompts)
        assert cached <= other_prompts[0].offset and engine.runner.images.encoded == 2
    finally:
        engine.close()


def test_bad_image_requests_are_refused(checkpoint):
    _, path = checkpoint
    engine = make_engine(path)
    try:
        ids, prompts = prompt_with([image((1, 8, 8), 1)])
        with pytest.raises(RequestError, match="placeholder"):
            engine.submit(ids, SamplingParams(max_tokens=1))  # placeholders without their image
        with pytest.raises(RequestError, match="placeholder"):
            engine.submit(ids[:-8], SamplingParams(max_tokens=1), images=prompts)  # the image's tokens cut short
        wrong = ImagePrompt.of(prompts[0].pixel_values[:, :100], prompts[0].grid_thw, prompts[0].offset, 2)
        with pytest.raises(RequestError, match="pixel values of shape"):
            engine.submit(ids, SamplingParams(max_tokens=1), images=[wrong])
        rid = engine.submit(ids, SamplingParams(max_tokens=2), images=prompts)
        with pytest.raises(RequestError, match="images"):
            engine.snapshot(rid)  # restore could not carry the images
        engine.result(rid)
        tokens, _ = greedy(engine, ids, prompts)  # and the engine still serves
        assert len(tokens) == TOKENS
    finally:
        engine.close()


def test_images_are_resized_to_the_patches_the_dense_tower_can_hold(tmp_path):
    """A checkpoint allowing 16.7 MP (Qwen3.5's longest_edge) is capped at MAX_IMAGE_PATCHES patches:
    the preprocessor then resizes a big image down to that many, counted from its grid."""
    import json
    from types import SimpleNamespace

    from hf_hybrid import PREPROCESSOR
    from PIL import Image

    from jtp.config.vision_config import VisionConfig
    from jtp.engine.image_processor import preprocess_images
    from jtp.engine.multimodal import MAX_IMAGE_PATCHES, engine_vision

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        PREPROCESSOR | {"size": {"shortest_edge": 32 * 32, "longest_edge": 16777216}}))
    vision = engine_vision(SimpleNamespace(images=SimpleNamespace(cfg=VisionConfig(patch_size=16))), tmp_path)
    assert vision.processor.max_pixels == MAX_IMAGE_PATCHES * 16 * 16
    big = Image.fromarray(np.zeros((3000, 4000, 3), np.uint8))
    grid = preprocess_images([big], vision.processor).grid_thw[0]
    assert MAX_IMAGE_PATCHES / 2 < grid[0] * grid[1] * grid[2] <= MAX_IMAGE_PATCHES


def test_a_pool_too_full_for_a_request_refuses_it_whole_and_serves_on(checkpoint):
    """Capacity 64 image tokens (max_model_len 64): A holds 32 while it runs; B's two images (24 + 16)
    do not fit beside them. B is a QueueFullError (retry later), keeps nothing in the pool, and A and
    later requests are served from a pool that is still whole."""
    from jtp.errors import QueueFullError

    model, path = checkpoint
    engine = make_engine(path, max_model_len=64)
    try:
        assert engine.runner.images.capacity == 64
        a_images = [image((1, 8, 8), 11), image((1, 8, 8), 12)]
        a_ids, a_prompts = prompt_with(a_images)
        a = engine.submit(a_ids, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True), images=a_prompts)
        b_ids, b_prompts = prompt_with([image((1, 8, 12), 13), image((1, 8, 8), 14)])
        with pytest.raises(QueueFullError, match="image cache"):
            engine.submit(b_ids, SamplingParams(max_tokens=1), images=b_prompts)
        assert not {p.digest for p in b_prompts} & set(engine.runner.images.entries)
        tokens = [t for e in engine.stream(a) for t in e.token_ids]
        assert tokens == hf_greedy(model, a_ids, a_images)[0]
        one = [image((1, 8, 12), 13)]  # B's first image, alone now: encoded afresh, right
        ids, prompts = prompt_with(one)
        assert greedy(engine, ids, prompts)[0] == hf_greedy(model, ids, one)[0]
    finally:
        engine.close()


def test_warm_up_compiles_every_patch_bucket_and_leaves_the_pool_intact(checkpoint):
    """After the encoder's warm-up, images of any size up to MAX_IMAGE_PATCHES compile nothing, and
    the images placed before it are still right."""
    from jtp.models import vision

    model, path = checkpoint
    engine = make_engine(path, max_model_len=256)
    try:
        before_ids, before_prompts = prompt_with([image((1, 8, 8), 21)])
        assert greedy(engine, before_ids, before_prompts)[0] == hf_greedy(model, before_ids, [image((1, 8, 8), 21)])[0]
        assert engine.runner.warm_images() == 8  # buckets 64 .. 8192 patches
        compiled = vision.encode_patches._cache_size()
        for grid in [(1, 4, 6), (1, 12, 10), (1, 16, 14)]:  # 24, 120 and 224 patches: three buckets
            ids, prompts = prompt_with([image(grid, 22)])
            assert greedy(engine, ids, prompts)[0] == hf_greedy(model, ids, [image(grid, 22)])[0], grid
        assert vision.encode_patches._cache_size() == compiled
        assert greedy(engine, before_ids, before_prompts)[0] == hf_greedy(model, before_ids, [image((1, 8, 8), 21)])[0]
    finally:
        engine.close()
