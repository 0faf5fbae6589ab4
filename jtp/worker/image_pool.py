"""The vision encoder and the device pool its outputs live in, between a request's arrival and
its prefill.

A request's images are encoded once, when the engine admits it, into rows of one device array
`pool` [capacity, hidden] (the model's `params["image_pool"]`); the step reads an image token's
embedding from its row (`AttentionMetadata.image_rows`), so the step's programs keep one shape
whatever images come. Entries are keyed by the image's content digest and kept after their request
ends, least recently used first out: a resent image is not encoded again. An entry a live request
still needs is never evicted.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jtp.config.vision_config import VISION_MODEL_TYPES, VisionConfig
from jtp.core.multimodal import ImagePrompt
from jtp.errors import QueueFullError, RequestError
from jtp.loading.weights import SafetensorsCheckpoint, is_orbax_dir
from jtp.loading.vision_weights import load_vision_params
from jtp.models import vision
from jtp.parallel.sharding import replicated

log = logging.getLogger(__name__)


def vision_config_of(model_dir: str, model_type: str, load_format: str, num_processes: int = 1,
                     yarn: bool = False) -> VisionConfig | None:
    """The checkpoint's vision tower config, None for a text-only checkpoint (or the text model of a
    multimodal one saved without its tower). Worker groups of several processes serve text alone:
    every process would have to encode each image in lockstep, which they do not yet. So does a
    YaRN-scaled context: M-RoPE with YaRN is not implemented."""
    if model_type not in VISION_MODEL_TYPES or num_processes > 1:
        return None
    if yarn:
        log.warning("YaRN RoPE scaling with M-RoPE is not supported: this checkpoint serves text only")
        return None
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if not isinstance(raw.get("vision_config"), dict):
        return None
    cfg = VisionConfig.from_hf(raw, str(Path(model_dir) / "config.json"))
    if load_format != "dummy" and is_orbax_dir(model_dir):
        log.warning("an Orbax checkpoint (`jtp convert`) holds the language model alone: this checkpoint serves text only")
        return None
    if load_format != "dummy" and not any(name.startswith(cfg.checkpoint_prefix)
                                          for name in SafetensorsCheckpoint(model_dir).names):
        return None
    return cfg


@functools.lru_cache(maxsize=None)
def _draw(shape: tuple[int, ...], dtype, mean: float, sharding):
    """One jitted draw per distinct (shape, mean): the 27 blocks share a dozen programs."""
    return jax.jit(lambda key: (jax.random.normal(key, shape) * 0.02 + mean).astype(dtype), out_shardings=sharding)


IMAGE_POOL_TOKENS = 32768  # image tokens the encoder's output pool holds at most (fewer for a shorter context)


def image_pool_for(config, cfg, mesh, dtype) -> tuple["ImagePool | None", object]:
    """A runner's vision tower and image pool (None for a model that takes no images), and its model
    config with the tower's M-RoPE split."""
    vision_cfg = vision_config_of(config.model, cfg.model_type, config.load_format, config.num_processes,
                                  cfg.rope_yarn is not None)
    if vision_cfg is None:
        return None, cfg
    pool = ImagePool(config.model, vision_cfg, mesh, dtype, min(config.max_model_len, IMAGE_POOL_TOKENS),
                     config.load_format)
    return pool, dataclasses.replace(cfg, mrope_section=vision_cfg.mrope_section)


def random_vision_params(cfg: VisionConfig, mesh, dtype, seed: int = 1) -> dict:
    """`--load-format dummy`: the tower's tensors drawn N(0, 0.02) on the devices (norms 1 + that)."""
    flat = {}
    for path, source in vision.param_layout(cfg).items():
        (name, shape), = source.expected().items()
        mean = 1.0 if path.endswith(("norm1", "norm2", "norm")) else 0.0
        key = jax.random.key(zlib.crc32(f"{seed}:{name}".encode()))
        flat[path] = _draw(tuple(shape), jnp.dtype(dtype), mean, replicated(mesh))(key)
    return vision.unflatten(flat, cfg.depth)


class ImagePool:
    def __init__(self, model_dir: str, cfg: VisionConfig, mesh, dtype, capacity: int, load_format: str = "auto"):
        self.cfg = cfg
        self.capacity = capacity
        self.params = (random_vision_params(cfg, mesh, dtype) if load_format == "dummy"
                       else load_vision_params(model_dir, cfg, mesh, dtype))
        # The pool itself (the runner passes it to the steps as params["image_pool"]). Only `place`
        # replaces it, the old buffer donated to the write: nobody else may keep a reference.
        self.pool = jax.device_put(np.zeros((capacity, cfg.out_hidden_size), jnp.dtype(dtype)), replicated(mesh))
        self.entries: collections.OrderedDict[bytes, tuple[int, int]] = collections.OrderedDict()  # LRU first
        self.encoded = 0  # images run through the encoder (the rest were found in the pool)
        self._write = jax.jit(lambda pool, rows, out: pool.at[rows].set(out.astype(pool.dtype), mode="drop"),
                              donate_argnums=(0,))

    def place(self, images: Sequence[ImagePrompt], in_use: Callable[[], set[bytes]]) -> list[int]:
        """Each image's first row in `self.pool`, encoding those it lacks. `in_use`: the digests live
        requests hold (never evicted). All or nothing: rows are planned for every image first, and a
        failure while encoding forgets the entries this call made (their rows were not written)."""
        total = sum(image.num_tokens for image in images)
        if total > self.capacity:
            raise RequestError(f"the prompt's images make {total} image tokens; the image cache holds {self.capacity}")
        planned, starts = [], []
        try:
            for image in images:
                entry = self.entries.get(image.digest)
                if entry is None:
                    start = self._allocate(image.num_tokens, in_use, {i.digest for i in images})
                    entry = self.entries[image.digest] = (start, image.num_tokens)
                    planned.append((image, start))
                self.entries.move_to_end(image.digest)
                starts.append(entry[0])
            for image, start in planned:
                self._encode(image, start)
        except BaseException:
            for image, _ in planned:
                self.entries.pop(image.digest, None)
            raise
        return starts

    def _allocate(self, n: int, in_use: Callable[[], set[bytes]], keep: set[bytes]) -> int:
        live = None
        while True:
            start = self._first_fit(n)
            if start is not None:
                return start
            live = in_use() | keep if live is None else live
            victim = next((d for d in self.entries if d not in live), None)
            if victim is None:
                raise QueueFullError(f"the image cache ({self.capacity} tokens) is full of images that running "
                                     "requests need; retry later")
            del self.entries[victim]

    def warm(self, max_patches: int) -> int:
        """Compile the encoder (and the pool write) for every bucket of patches up to `max_patches`
        (warm-up: the first image of a size then compiles nothing); how many buckets. Writes nothing."""
        buckets = sorted({vision.patch_bucket(1 << i, self.cfg.merge_unit)
                          for i in range(max_patches.bit_length()) if 1 << i <= max_patches})
        merge = self.cfg.spatial_merge_size
        for bucket in buckets:
            rows = max(merge, 1 << ((bucket.bit_length() - 1) // 2))  # a grid of `bucket` patches
            grid = (1, rows, bucket // rows)
            out = vision.encode_patches(self.params, np.zeros((bucket, self.cfg.patch_dim), np.float32),
                                        vision.patch_layout(self.cfg, np.asarray([grid]), bucket), cfg=self.cfg)
            self.pool = self._write(self.pool, np.full(out.shape[0], self.capacity, np.int32), out)  # all dropped
        return len(buckets)

    def _first_fit(self, n: int) -> int | None:
        cursor = 0
        for start, length in sorted(self.entries.values()):
            if start - cursor >= n:
                return cursor
            cursor = max(cursor, start + length)
        return cursor if self.capacity - cursor >= n else None

    def _encode(self, image: ImagePrompt, start: int) -> None:
        patches = image.pixel_values.shape[0]
        bucket = vision.patch_bucket(patches, self.cfg.merge_unit)
        padded = np.zeros((bucket, self.cfg.patch_dim), np.float32)
        padded[:patches] = image.pixel_values
        layout = vision.patch_layout(self.cfg, np.asarray([image.grid_thw]), bucket)
        out = vision.encode_patches(self.params, padded, layout, cfg=self.cfg)  # [bucket / merge^2, hidden]
        rows = start + np.arange(out.shape[0], dtype=np.int32)
        rows[image.num_tokens:] = self.capacity  # the bucket's padding tokens: dropped
        self.pool = self._write(self.pool, rows, out)
        self.encoded += 1
