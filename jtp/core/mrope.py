"""Qwen3.5's multimodal RoPE positions (M-RoPE), host-side numpy: three position rows (T, H, W)
per token instead of one.

A text token at offset i of its run gets (p, p, p) with p = start + i; an image of
(t, h, w) patches becomes t (h / merge) (w / merge) tokens in row-major order, token (k, r, c)
at (start + k, start + r, start + c); the text after it resumes at start + max(h, w) / merge.
So a prompt's positions end at max + 1 = len + delta, and every later (generated) token at
index i sits at i + delta on all three rows. Text-only prompts: three equal rows, delta 0.
(transformers' Qwen3_5Model.get_rope_index / get_vision_position_ids, for images.)

jtp.models.layers.mrope_cos_sin turns the rows into the rotary cos/sin.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def image_positions(start: int, grid_thw: Sequence[int], merge_size: int) -> np.ndarray:
    """int64 [3, tokens] of one image's tokens, its first token's offset `start`."""
    t, h, w = (int(v) for v in grid_thw)
    frames, rows, cols = np.meshgrid(np.arange(t), np.arange(h // merge_size), np.arange(w // merge_size),
                                     indexing="ij")
    return np.stack([frames, rows, cols]).reshape(3, -1).astype(np.int64) + start


def mrope_positions(token_ids: Sequence[int], image_grid_thw: np.ndarray | None, image_token_id: int,
                    merge_size: int) -> tuple[np.ndarray, int]:
    """(positions int64 [3, T], delta) of a prompt whose images (in order, grid_thw [images, 3])
    stand as runs of `image_token_id` placeholders; delta = max position + 1 - T.

    A run of placeholders takes as many images as fill it exactly (two images with nothing
    between them make one run); a count that does not match is a ValueError."""
    ids = np.asarray(token_ids)
    grids = [] if image_grid_thw is None else [tuple(int(v) for v in g) for g in np.asarray(image_grid_thw)]
    is_image = ids == image_token_id
    # Boundaries of the runs of equal kind (text / image).
    edges = np.flatnonzero(np.diff(is_image.astype(np.int8))) + 1
    starts, ends = np.concatenate([[0], edges]), np.concatenate([edges, [len(ids)]])
    parts, pos, used = [], 0, 0
    for a, b in zip(starts.tolist(), ends.tolist()):
        if a == b:
            continue
        if not is_image[a]:
            parts.append(np.broadcast_to(np.arange(pos, pos + b - a, dtype=np.int64), (3, b - a)))
            pos += b - a
            continue
        left = b - a
        while left > 0:
            if used == len(grids):
                raise ValueError(f"{int(is_image.sum())} image placeholder tokens but only {len(grids)} image(s) "
                                 "whose tokens do not cover them")
            t, h, w = grids[used]
            count = t * (h // merge_size) * (w // merge_size)
            if count > left:
                raise ValueError(f"image {used} needs {count} placeholder tokens, its run has {left} left")
            parts.append(image_positions(pos, grids[used], merge_size))
            pos += max(h, w) // merge_size
            left -= count
            used += 1
    if used != len(grids):
        raise ValueError(f"{len(grids)} image(s) but placeholder tokens for only {used}")
    positions = np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), np.int64)
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return positions, delta


def text_positions(start: int, count: int, delta: int) -> np.ndarray:
    """int64 [3, count]: tokens start .. start+count-1 after the prompt (generated ones), all rows
    index + delta."""
    return np.broadcast_to(np.arange(start, start + count, dtype=np.int64) + delta, (3, count)).copy()
