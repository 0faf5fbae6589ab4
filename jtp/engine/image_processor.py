"""Host-side image preprocessing for Qwen3.5's vision encoder (numpy + Pillow, no jax).

What HF's Qwen2-VL image processor computes (transformers' Qwen2VLImageProcessorPil, the one
Qwen3.5 checkpoints name), step for step so the numbers are its numbers:

  1. decode (turned upright by its EXIF orientation, as HF's load_image does) and convert to RGB
     (transparency composited onto white);
  2. resize with Pillow (bicubic) to (h', w'), multiples of factor = patch * merge, with
     min_pixels <= h' w' <= max_pixels and the aspect ratio kept as well as possible (`smart_resize`);
  3. x = (x_uint8 * rescale_factor - mean) / std per channel, float32;
  4. cut into patch x patch squares, listed merge-block by merge-block (the merge x merge patches
     that become one image token are consecutive), each square repeated temporal_patch_size times
     (a still image is a clip of identical frames) and flattened in (C, T, patch, patch) order.

Result: pixel_values [sum of h_i w_i patches, C * T * patch^2] and grid_thw [images, 3] = (1, h_i, w_i)
in patches; an image becomes h_i w_i / merge^2 image tokens.
"""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np

from jtp.config.vision_config import ImageProcessorConfig
from jtp.errors import RequestError

if TYPE_CHECKING:
    import PIL.Image

MAX_ASPECT_RATIO = 200  # HF's bound: a longer strip is refused


class ImageError(RequestError):
    """An image that cannot be used (undecodable, degenerate size, aspect ratio past 200): a 400."""


class ImageInputs(NamedTuple):
    pixel_values: np.ndarray  # float32 [patches, C * temporal * patch * patch]
    grid_thw: np.ndarray  # int64 [images, 3]: (1, patch rows, patch cols)

    def num_tokens(self, merge_size: int) -> list[int]:
        """Image tokens (placeholders in the prompt) per image."""
        return [int(t * h * w) // merge_size**2 for t, h, w in self.grid_thw]


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(h', w'): both multiples of `factor`, h' w' within [min_pixels, max_pixels], the aspect
    ratio kept as closely as possible (HF's `smart_resize`, including its rounding)."""
    if min(height, width) <= 0:
        raise ImageError(f"an image of {width}x{height} pixels has no area")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"an image of {width}x{height} pixels: aspect ratio past {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def upright(image: PIL.Image.Image) -> PIL.Image.Image:
    """The decoded image as viewers (and HF's load_image) show it: its EXIF Orientation applied (a
    phone's portrait photo holds landscape pixels and a tag saying to turn them)."""
    from PIL import ImageOps

    image.load()
    return ImageOps.exif_transpose(image)


def to_rgb(image) -> PIL.Image.Image:
    """Encoded bytes, a PIL image or a uint8 array [H, W, C] -> an RGB PIL image; transparency
    (an alpha band or a palette's transparent colour) is composited onto white, as HF does."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, (bytes, bytearray, memoryview)):
        try:
            image = upright(Image.open(io.BytesIO(bytes(image))))
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
            raise ImageError(f"cannot decode the image ({e})") from e
    elif isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (1, 3, 4)):
            raise ImageError(f"an image array must be uint8 [H, W] or [H, W, 1|3|4], got {image.dtype} {image.shape}")
        image = Image.fromarray(image[..., 0] if image.ndim == 3 and image.shape[2] == 1 else image)
    elif not isinstance(image, Image.Image):
        raise ImageError(f"expected image bytes, a PIL image or a uint8 array, got {type(image).__name__}")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def resized_size(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """The (height, width) an image of this size is resized to."""
    if not cfg.do_resize:
        return height, width
    return smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)


def image_grid(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int, int]:
    """grid_thw of an image of this size (before decoding it: enough to count its placeholders)."""
    h, w = resized_size(height, width, cfg)
    if h % cfg.factor or w % cfg.factor:
        raise ImageError(f"an image of {w}x{h} pixels is not a whole number of {cfg.factor}-pixel blocks "
                         "(do_resize is off in preprocessor_config.json)")
    return 1, h // cfg.patch_size, w // cfg.patch_size


def normalized_pixels(image, cfg: ImageProcessorConfig) -> np.ndarray:
    """One image -> float32 [C, h', w'], resized, rescaled and normalized (steps 1-3)."""
    from PIL import Image

    pil = to_rgb(image) if cfg.do_convert_rgb or not isinstance(image, Image.Image) else image
    width, height = pil.size
    h, w = resized_size(height, width, cfg)
    if cfg.do_resize:
        pil = pil.resize((w, h), resample=Image.Resampling(cfg.resample))
    pixels = np.asarray(pil)
    pixels = (pixels[..., None] if pixels.ndim == 2 else pixels).transpose(2, 0, 1)  # [C, H, W]
    if cfg.do_rescale:  # in float64, then float32 (HF's order of rounding)
        pixels = (pixels.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    pixels = pixels.astype(np.float32, copy=False)
    if cfg.do_normalize:
        mean, std = np.asarray(cfg.image_mean, np.float32), np.asarray(cfg.image_std, np.float32)
        pixels = (pixels - mean[:, None, None]) / std[:, None, None]
    return pixels


def patchify(pixels: np.ndarray, cfg: ImageProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """float32 [C, H, W] -> the patches [h w, C T p p] in merge-block order, and grid_thw (step 4)."""
    C, H, W = pixels.shape
    p, m, T = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    if H % (p * m) or W % (p * m):
        raise ImageError(f"an image of {W}x{H} pixels is not a whole number of {p * m}-pixel blocks")
    h, w = H // p, W // p
    x = pixels.reshape(C, h // m, m, p, w // m, m, p)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # (block row, block col, row in block, col in block, C, py, px)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], T, p, p))  # T identical frames
    return x.reshape(h * w, C * T * p * p), (1, h, w)


def preprocess_images(images: Sequence, cfg: ImageProcessorConfig) -> ImageInputs:
    """Images (bytes, PIL images or uint8 arrays) -> the vision encoder's inputs for all of them."""
    if not images:
        raise ImageError("no images to preprocess")
    patches, grids = [], []
    for image in images:
        x, grid = patchify(normalized_pixels(image, cfg), cfg)
        patches.append(x)
        grids.append(grid)
    return ImageInputs(np.concatenate(patches, axis=0), np.asarray(grids, np.int64))
