"""A prompt's images as the scheduler and the worker see them (numpy only): where each image's
placeholder tokens sit in the prompt, its preprocessed patches, its content digest, and the prompt's
multimodal RoPE positions.

The digest keys the encoder's output cache (a resent image is not encoded again) and goes into the
prefix cache's block keys (two prompts with the same text and different images never share K/V).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

from jtp.core.mrope import mrope_positions

# Patches of one image at most: the vision tower's attention is dense over an image's patches (memory
# grows with their square; 8192 patches hold ~4 GiB of fp32 scores), so larger images are resized down.
MAX_IMAGE_PATCHES = 8192


@dataclasses.dataclass(frozen=True, eq=False)
class ImagePrompt:
    """One image of a prompt, preprocessed: `num_tokens` placeholder tokens from `offset`."""

    pixel_values: np.ndarray | None  # f32 [patches, channels x temporal x patch x patch] (None once encoded)
    grid_thw: tuple[int, int, int]  # patches along time, height, width
    offset: int  # index of its first placeholder token in the prompt
    num_tokens: int  # t * h * w / merge^2
    digest: bytes  # sha256 of the patches and the grid

    @classmethod
    def of(cls, pixel_values: np.ndarray, grid_thw: Sequence[int], offset: int, merge_size: int) -> "ImagePrompt":
        grid = tuple(int(g) for g in grid_thw)
        pixels = np.ascontiguousarray(pixel_values, np.float32)
        digest = hashlib.sha256(np.asarray(grid, np.int64).tobytes() + pixels.tobytes()).digest()
        return cls(pixels, grid, int(offset), grid[0] * grid[1] * grid[2] // merge_size**2, digest)


@dataclasses.dataclass(frozen=True, eq=False)
class MultiModalPrompt:
    """A prompt's images (in prompt order) and its RoPE positions: `positions` i32 [3, prompt length]
    (time, height, width rows: equal for text tokens), and `delta`, what a generated token at
    sequence position p adds to p (its three rows are all p + delta)."""

    images: tuple[ImagePrompt, ...]
    positions: np.ndarray
    delta: int

    @classmethod
    def of(cls, prompt_ids: Sequence[int], images: Sequence[ImagePrompt], image_token_id: int,
           merge_size: int) -> "MultiModalPrompt":
        """Checks that each image's placeholders are where it says, in order and apart."""
        ids = np.asarray(prompt_ids)
        end = 0
        for i, image in enumerate(images):
            span = ids[image.offset : image.offset + image.num_tokens]
            if image.offset < end or len(span) != image.num_tokens or np.any(span != image_token_id):
                raise ValueError(f"image {i}: its {image.num_tokens} placeholder tokens are not at prompt "
                                 f"positions {image.offset}..{image.offset + image.num_tokens - 1}")
            end = image.offset + image.num_tokens
        if int(np.sum(ids == image_token_id)) != sum(image.num_tokens for image in images):
            raise ValueError("the prompt has image placeholder tokens that belong to no image")
        grids = np.array([image.grid_thw for image in images], np.int64).reshape(-1, 3)
        positions, delta = mrope_positions(ids.tolist(), grids, image_token_id, merge_size)
        return cls(tuple(images), np.asarray(positions, np.int32), int(delta))

    def without_pixels(self) -> "MultiModalPrompt":
        """The same prompt, its images' pixels dropped (once encoded, only their placement matters)."""
        return dataclasses.replace(self, images=tuple(dataclasses.replace(i, pixel_values=None) for i in self.images))

    def block_extra(self, block: int, block_size: int) -> bytes:
        """What block `block`'s prefix-cache key adds to its tokens: the digests (and placements) of
        the images whose placeholders it holds (b"" for a block of text alone)."""
        lo, hi = block * block_size, (block + 1) * block_size
        return b"".join(image.digest + image.offset.to_bytes(8, "little") for image in self.images
                        if image.offset < hi and image.offset + image.num_tokens > lo)

    def rope_positions(self, positions: np.ndarray, num_prompt: int) -> np.ndarray:
        """i32 [3, n]: the M-RoPE rows of sequence positions `positions` (prompt ones from the table,
        later ones p + delta on all rows)."""
        inside = positions < num_prompt
        out = np.broadcast_to(positions + self.delta, (3, len(positions))).astype(np.int32)
        out[:, inside] = self.positions[:, positions[inside]]
        return out

    def image_rows(self, positions: np.ndarray, pool_starts: Sequence[int]) -> np.ndarray:
        """i32 [n]: each position's row of the image-embedding pool (-1: not an image token), the
        images' first rows at `pool_starts`."""
        rows = np.full(len(positions), -1, np.int32)
        for image, start in zip(self.images, pool_starts):
            inside = (positions >= image.offset) & (positions < image.offset + image.num_tokens)
            rows[inside] = start + positions[inside] - image.offset
        return rows
