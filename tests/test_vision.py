"""Qwen3.5 image input, first half (issue 29): the vision encoder, image preprocessing and M-RoPE,
each against HF transformers live.

A tiny composite Qwen3.5 checkpoint (tests/hf_hybrid.py: two vision blocks, vision weights far from
their init so attention is sharp enough that a RoPE or masking slip shows) is written with HF's
save_pretrained plus a preprocessor_config.json; jtp loads the vision tower from the safetensors.
References: Qwen3_5ForConditionalGeneration.get_image_features, the image processor HF picks for
the directory (Qwen2VLImageProcessorPil without torchvision), Qwen3_5Model.get_rope_index and the
text model's rotary embedding.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_hybrid as hh  # noqa: E402

from jtp.config.vision_config import ImageProcessorConfig, VisionConfig  # noqa: E402
from jtp.core.mrope import mrope_positions, text_positions  # noqa: E402
from jtp.errors import CheckpointError, ConfigError  # noqa: E402

ENCODER_TOL = 1e-5  # max |jtp - HF| / max |HF| (outputs ~25; fp32 differences ~3e-5 absolute)
# Grids (t, h, w) in patches. The position table is 4 x 4: 4 x 4 hits it exactly, 10 x 6 and
# 8 x 2 interpolate between its entries, 2 x 2 is smaller than it.
ONE_IMAGE = [[1, 4, 4]]
TWO_IMAGES = [[1, 10, 6], [1, 2, 2]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(HF model, directory, VisionConfig, jtp vision params)."""
    from jtp.loading.vision_weights import load_vision_params
    from jtp.parallel.sharding import make_mesh

    model = hh.build_model("qwen3_5", seed=3, vision=dict(depth=2))
    path = hh.save_multimodal(model, tmp_path_factory.mktemp("qwen3_5-vision"))
    cfg = VisionConfig.from_dir(path)
    return model, path, cfg, load_vision_params(path, cfg, make_mesh(1))


def pixels(grids, seed=0) -> np.ndarray:
    n = int(np.prod(grids, axis=1).sum())
    return np.random.default_rng(seed).standard_normal((n, 3 * 2 * 16 * 16)).astype(np.float32)


def hf_image_features(model, pixel_values, grids) -> np.ndarray:
    with torch.no_grad():
        out = model.get_image_features(torch.from_numpy(pixel_values), torch.tensor(grids))
    return torch.cat(out.pooler_output).numpy()


def rel(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


# ----------------------------------------------------------------------------- the encoder


@pytest.mark.parametrize("grids", [ONE_IMAGE, TWO_IMAGES, [[1, 8, 2], [1, 4, 6], [1, 4, 4]]],
                         ids=["one", "two", "three"])
def test_encoder_matches_hf_get_image_features(checkpoint, grids):
    from jtp.models.vision import encode_images

    model, _, cfg, params = checkpoint
    pv = pixels(grids)
    ref = hf_image_features(model, pv, grids)
    out = np.asarray(encode_images(params, cfg, pv, np.array(grids)))
    assert out.shape == ref.shape == (sum(t * h * w for t, h, w in grids) // 4, 64)
    assert rel(out, ref) < ENCODER_TOL


def test_images_do_not_see_each_other_or_the_padding(checkpoint):
    """Encoded together (and padded to a larger bucket), each image's tokens are what it gets alone."""
    from jtp.models.vision import encode_images

    _, _, cfg, params = checkpoint
    pv = pixels(TWO_IMAGES, seed=1)
    together = np.asarray(encode_images(params, cfg, pv, np.array(TWO_IMAGES), num_patches=128))
    split = 60  # the first image's patches
    alone = [np.asarray(encode_images(params, cfg, pv[:split], np.array(TWO_IMAGES[:1]))),
             np.asarray(encode_images(params, cfg, pv[split:], np.array(TWO_IMAGES[1:])))]
    assert rel(together, np.concatenate(alone)) < 1e-6


def test_patch_buckets_are_few_and_whole_tokens():
    from jtp.models.vision import MIN_BUCKET, patch_bucket

    assert [patch_bucket(n, 4) for n in (1, 64, 65, 1000, 4096)] == [MIN_BUCKET, 64, 128, 1024, 4096]
    assert patch_bucket(100, 9) % 9 == 0


def test_missing_vision_tensor_is_named(checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file

    from jtp.loading.vision_weights import load_vision_params
    from jtp.parallel.sharding import make_mesh

    model, _, cfg, _ = checkpoint
    path = hh.save_multimodal(model, tmp_path / "missing")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.visual.blocks.1.attn.qkv.bias"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.visual.blocks.1.attn.qkv.bias"):
        load_vision_params(path, cfg, make_mesh(1))


def test_vision_config(checkpoint):
    _, path, cfg, _ = checkpoint
    assert (cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.out_hidden_size, cfg.patch_dim) == (2, 32, 4, 64, 1536)
    assert (cfg.image_token_id, cfg.mrope_section, cfg.position_grid_side) == (248056, (2, 1, 1), 4)
    raw = hh.config_json(path)
    with pytest.raises(ConfigError, match="vision tower"):
        VisionConfig.from_hf({**raw["text_config"], "model_type": "qwen3_5_text"})
    with pytest.raises(ConfigError, match="num_position_embeddings"):
        VisionConfig.from_hf({**raw, "vision_config": {**raw["vision_config"], "num_position_embeddings": 15}})


# ----------------------------------------------------------------------------- preprocessing


def hf_processor(path):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(path)


def test_hf_uses_the_pil_processor_we_match(checkpoint):
    """Without torchvision HF picks the Pillow backend, whose arithmetic jtp reproduces; the
    torchvision one (Qwen2VLImageProcessor) resizes with torch and differs in the last bits."""
    assert type(hf_processor(checkpoint[1])).__name__ == "Qwen2VLImageProcessorPil"


def images():
    """(name, image): sizes on and off the 32-pixel blocks, below min_pixels (upscaled), above
    max_pixels (downscaled), an RGBA image (composited onto white), a grey one, PNG bytes."""
    from PIL import Image

    rng = np.random.default_rng(5)
    rgb = lambda h, w: Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))  # noqa: E731
    out = [("64x64", rgb(64, 64)), ("70x50", rgb(50, 70)), ("33x20 small", rgb(20, 33)), ("200x90 large", rgb(90, 200)),
           ("rgba", Image.fromarray(rng.integers(0, 256, (40, 60, 4), dtype=np.uint8), "RGBA")),
           ("grey", Image.fromarray(rng.integers(0, 256, (45, 45), dtype=np.uint8), "L"))]
    png = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (47, 81, 4), dtype=np.uint8), "RGBA").save(png, format="PNG")
    return out + [("png bytes", png.getvalue())]


def test_preprocessing_matches_hf(checkpoint):
    from PIL import Image

    from jtp.engine.image_processor import image_grid, preprocess_images

    path = checkpoint[1]
    proc, cfg = hf_processor(path), ImageProcessorConfig.from_dir(path)
    named = images()
    decoded = [Image.open(io.BytesIO(im)) if isinstance(im, bytes) else im for _, im in named]
    for (name, image), pil in zip(named, decoded):
        ref = proc(images=[pil], return_tensors="np")
        ours = preprocess_images([image], cfg)
        assert ours.grid_thw.tolist() == ref["image_grid_thw"].tolist(), name
        assert image_grid(pil.height, pil.width, cfg) == tuple(ref["image_grid_thw"][0]), name
        assert ours.pixel_values.dtype == np.float32 and ours.pixel_values.shape == ref["pixel_values"].shape, name
        assert np.abs(ours.pixel_values - ref["pixel_values"]).max() <= 1e-5, name
    ref = proc(images=decoded, return_tensors="np")
    ours = preprocess_images([im for _, im in named], cfg)
    assert np.abs(ours.pixel_values - ref["pixel_values"]).max() <= 1e-5
    assert ours.num_tokens(2) == [int(np.prod(g)) // 4 for g in ref["image_grid_thw"]]


def test_preprocessor_config_fields(tmp_path):
    raw = {**hh.PREPROCESSOR, "min_pixels": 4096, "max_pixels": 65536}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(raw))
    cfg = ImageProcessorConfig.from_dir(tmp_path)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.factor) == (4096, 65536, 32)  # min/max_pixels win over size
    with pytest.raises(ConfigError, match="image_std"):
        ImageProcessorConfig.from_hf({**hh.PREPROCESSOR, "image_std": [0.5, 0, 0.5]})
    with pytest.raises(ConfigError, match="preprocessor_config.json"):
        ImageProcessorConfig.from_dir(tmp_path / "nowhere")


def test_bad_images_are_request_errors():
    from PIL import Image

    from jtp.engine.image_processor import ImageError, preprocess_images
    from jtp.errors import RequestError

    cfg = ImageProcessorConfig.from_hf(hh.PREPROCESSOR)
    with pytest.raises(ImageError, match="aspect ratio"):
        preprocess_images([Image.new("RGB", (402, 2))], cfg)
    with pytest.raises(RequestError, match="cannot decode"):
        preprocess_images([b"not an image"], cfg)


# ----------------------------------------------------------------------------- M-RoPE


def prompt(grids, image=248056, start=248053, end=248054):
    """Token ids: text, then per image <vision_start> placeholders <vision_end> and more text."""
    ids = list(range(5))
    for k, (t, h, w) in enumerate(grids):
        ids += [start] + [image] * (t * h * w // 4) + [end] + list(range(10, 13 + k))
    return ids


def hf_rope_index(model, ids, grids):
    input_ids = torch.tensor([ids])
    types = (input_ids == model.config.image_token_id).int()
    with torch.no_grad():
        positions, deltas = model.model.get_rope_index(input_ids, types, image_grid_thw=torch.tensor(grids))
    return positions[:, 0].numpy(), int(deltas[0, 0])


@pytest.mark.parametrize("grids", [ONE_IMAGE, TWO_IMAGES, [[1, 2, 8]]], ids=["one", "two", "wide"])
def test_mrope_positions_match_hf_get_rope_index(checkpoint, grids):
    model, _, cfg, _ = checkpoint
    ids = prompt(grids)
    ref, ref_delta = hf_rope_index(model, ids, grids)
    positions, delta = mrope_positions(ids, np.array(grids), cfg.image_token_id, cfg.spatial_merge_size)
    assert positions.shape == (3, len(ids)) and np.array_equal(positions, ref)
    assert delta == ref_delta
    # Generated tokens continue from the prompt's end on all three rows (HF: cache length + rope_deltas).
    assert np.array_equal(text_positions(len(ids), 3, delta), np.broadcast_to(np.arange(3) + positions.max() + 1, (3, 3)))


def test_text_only_positions_are_one_row_repeated():
    positions, delta = mrope_positions(list(range(7)), None, 248056, 2)
    assert delta == 0 and np.array_equal(positions, np.broadcast_to(np.arange(7), (3, 7)))


def test_mismatched_placeholders_are_refused():
    with pytest.raises(ValueError, match="placeholder"):
        mrope_positions(prompt(ONE_IMAGE)[:-8], np.array(ONE_IMAGE), 248056, 2)  # a token short
    with pytest.raises(ValueError, match="placeholder"):
        mrope_positions(prompt(ONE_IMAGE), np.array(TWO_IMAGES), 248056, 2)


def test_mrope_cos_sin_match_hf_rotary_embedding(checkpoint):
    import jax.numpy as jnp

    from jtp.config.model_config import ModelConfig
    from jtp.models.layers import mrope_cos_sin, rope_cos_sin

    model, path, vcfg, _ = checkpoint
    cfg = ModelConfig.from_dir(path)
    ids = prompt(TWO_IMAGES)
    positions, _ = mrope_positions(ids, np.array(TWO_IMAGES), vcfg.image_token_id, 2)
    rotary = model.model.language_model.rotary_emb
    with torch.no_grad():
        ref_cos, ref_sin = rotary(torch.zeros(1, dtype=torch.float32), torch.from_numpy(positions)[:, None])
    cos, sin = mrope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, vcfg.mrope_section, jnp.float32)
    # The same fp32 angles; XLA's and torch's cos/sin may differ in the last bit.
    assert np.abs(np.asarray(cos) - ref_cos[0].numpy()).max() < 1e-6
    assert np.abs(np.asarray(sin) - ref_sin[0].numpy()).max() < 1e-6
    # Text-only positions: exactly today's 1-D RoPE.
    flat = np.broadcast_to(np.arange(40), (3, 40))
    for a, b in zip(mrope_cos_sin(flat, cfg.rotary_dim, cfg.rope_theta, vcfg.mrope_section, jnp.float32),
                    rope_cos_sin(jnp.arange(40), cfg.rotary_dim, cfg.rope_theta, jnp.float32)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_embeddings_and_positions_reproduce_hf_multimodal_logits(checkpoint):
    """The contract for the engine: HF's language model fed jtp's image embeddings at the
    placeholders and jtp's M-RoPE positions gives HF's own multimodal forward's logits."""
    from jtp.models.vision import encode_images

    import copy
    import dataclasses

    model, _, cfg, params = checkpoint
    # Special tokens inside the tiny vocabulary, so HF's forward can embed the prompt.
    model = copy.deepcopy(model)
    model.config.image_token_id, cfg = 100, dataclasses.replace(cfg, image_token_id=100)
    grids = TWO_IMAGES
    ids, pv = prompt(grids, image=100, start=101, end=102), pixels(grids, seed=2)
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        ref = model(input_ids, pixel_values=torch.from_numpy(pv), image_grid_thw=torch.tensor(grids),
                    mm_token_type_ids=(input_ids == cfg.image_token_id).int()).logits[0].numpy()
        embeds = model.model.language_model.embed_tokens(input_ids)
        image = torch.from_numpy(np.asarray(encode_images(params, cfg, pv, np.array(grids))).copy())
        embeds[0, input_ids[0] == cfg.image_token_id] = image
        positions, _ = mrope_positions(ids, np.array(grids), cfg.image_token_id, cfg.spatial_merge_size)
        hidden = model.model.language_model(inputs_embeds=embeds, position_ids=torch.from_numpy(positions)[:, None])
        logits = model.lm_head(hidden.last_hidden_state)[0].numpy()
    assert rel(logits, ref) < 1e-4
