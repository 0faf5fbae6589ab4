"""What the engine knows of a model's image input: the vision tokens and the preprocessor the API
layer needs to build prompts, and the checks a request with images passes at submit."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

from jtp.config.vision_config import ImageProcessorConfig
from jtp.core.multimodal import MAX_IMAGE_PATCHES, ImagePrompt, MultiModalPrompt
from jtp.errors import ConfigError, RequestError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineVision:
    image_token_id: int
    vision_start_id: int
    vision_end_id: int
    merge_size: int
    processor: ImageProcessorConfig
    max_images_per_prompt: int | None = None  # None: no limit
    patch_dim: int = 0  # values per patch the tower takes (channels x temporal patch x patch x patch)


def engine_vision(runner, model_dir: str | Path, max_images_per_prompt: int | None = None) -> EngineVision | None:
    """The model's image input, None when it takes none (no tower, or a worker group);
    `max_images_per_prompt`: --limit-mm-per-prompt's image count."""
    if runner.images is None:
        return None
    cfg = runner.images.cfg
    try:
        processor = ImageProcessorConfig.from_dir(model_dir)
    except ConfigError as e:  # a config-only directory (random weights): the processor's defaults
        log.warning("%s; images are preprocessed with the processor's defaults at the tower's patch size", e)
        processor = ImageProcessorConfig(patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size,
                                         merge_size=cfg.spatial_merge_size)
    cap = MAX_IMAGE_PATCHES * processor.patch_size**2
    if processor.max_pixels > cap:
        log.info("images are resized to at most %d pixels (%d patches; the checkpoint allows %d): the vision "
                 "tower's attention is dense", cap, MAX_IMAGE_PATCHES, processor.max_pixels)
        processor = dataclasses.replace(processor, max_pixels=cap, min_pixels=min(processor.min_pixels, cap))
    return EngineVision(cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id,
                        cfg.spatial_merge_size, processor, max_images_per_prompt, cfg.patch_dim)


def prompt_images(vision: EngineVision | None, prompt_ids: list[int], images: Sequence[ImagePrompt],
                  unsupported: str | None) -> MultiModalPrompt | None:
    """A request's images checked against its prompt (None without images); `unsupported`: what
    of the engine's configuration cannot serve them."""
    if not images:
        if vision is not None and vision.image_token_id in prompt_ids:
            raise RequestError("the prompt holds image placeholder tokens but no image came with it")
        return None
    if vision is None:
        raise RequestError("this model takes no images (its checkpoint has no vision tower, or it is served by a "
                           "worker group of several processes)")
    if unsupported is not None:
        raise RequestError(f"images are not served with {unsupported}")
    if vision.max_images_per_prompt is not None and len(images) > vision.max_images_per_prompt:
        raise RequestError(f"{len(images)} images in one prompt; at most {vision.max_images_per_prompt}")
    for i, image in enumerate(images):
        patches = image.grid_thw[0] * image.grid_thw[1] * image.grid_thw[2]
        if image.pixel_values.shape != (patches, vision.patch_dim):
            raise RequestError(f"image {i}: pixel values of shape {list(image.pixel_values.shape)}; its grid "
                               f"{list(image.grid_thw)} needs [{patches}, {vision.patch_dim}]")
        if patches > MAX_IMAGE_PATCHES:
            raise RequestError(f"image {i}: {patches} patches, more than the {MAX_IMAGE_PATCHES} one image may have "
                               "(resize it smaller)")
    try:
        return MultiModalPrompt.of(prompt_ids, images, vision.image_token_id, vision.merge_size)
    except ValueError as e:
        raise RequestError(str(e)) from None


def live_images(engine) -> set[bytes]:
    """The images of every request not yet finished (takes the intake lock): the pool keeps them."""
    with engine._intake:
        return {image.digest for stream in engine.outputs.unfinished() if stream.request.mm is not None
                for image in stream.request.mm.images}
