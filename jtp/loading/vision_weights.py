"""Loading Qwen3.5's vision tower (model.visual.*) from the checkpoint's safetensors.

The text model's loader (jtp/loading/weights.py) skips these tensors; this reads them, by the
`Source`s of jtp.models.vision.param_layout, into (replicated) jax arrays on the mesh.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jtp.config.vision_config import VisionConfig
from jtp.errors import CheckpointError
from jtp.loading.safetensors_header import FLOAT_DTYPES
from jtp.loading.weights import SafetensorsCheckpoint
from jtp.models import vision
from jtp.parallel.rules import logical_sharding


def load_vision_params(model_dir: str | Path, cfg: VisionConfig, mesh, dtype=jnp.float32) -> dict:
    """The vision tower's parameter tree (jtp.models.vision), every tensor checked for presence,
    shape and a float dtype first."""
    ckpt = SafetensorsCheckpoint(model_dir)
    layout = vision.param_layout(cfg)
    problems = []
    for source in layout.values():
        for name, shape in source.expected().items():
            if name not in ckpt.names:
                problems.append(f"{name!r} is missing (shape {list(shape)})")
            elif ckpt.shape(name) != shape:
                problems.append(f"{name!r} has shape {list(ckpt.shape(name))}, the vision config implies {list(shape)}")
            elif ckpt.dtype(name) not in FLOAT_DTYPES:
                problems.append(f"{name!r} is {ckpt.dtype(name)}, not floating point")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"{model_dir}: the vision tower does not match config.json: "
                              + "; ".join(problems[:3]) + more)
    host_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else np.dtype(dtype)
    flat = {}
    for path, source in layout.items():
        sharding = logical_sharding(mesh, f"visual.{path}", source.shape, source.axes)
        flat[path] = jax.make_array_from_callback(
            source.shape, sharding, lambda index, s=source: s.read(ckpt, index).astype(host_dtype, copy=False))
    return vision.unflatten(flat, cfg.depth)
