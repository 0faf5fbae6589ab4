"""The embedded demo checkpoint: a tiny Qwen3 trained for seconds on a few KB of our own text.

It lets the engine, the CLI, the server, the notebook and the tests run end to end with no
download. The tokenizer is a genuine byte-level BPE (trained on an embedded corpus), so
tokenization, chat templating and streaming behave like a real Qwen3. The weights are trained
briefly on the English part of that corpus (plus a few chat turns in the template's format), so
generations are recognisable English words and sentences from those pages: a toy, not a model
that knows anything.

This module is the runtime side: where the demo lives and how a finished build is found or
installed. The build itself (jtp/demo/corpus.py, jtp/demo/build.py) needs the `demo` extra
(optax) and runs in a fresh CPU-only subprocess from a fixed seed and batch order, so it is
deterministic. A finished build is kept in a per-user cache keyed by the recipe (the build's
source files and the library versions), so tests that each want their own copy pay once.

    python -m jtp.demo DIR       # build into DIR (fresh, no cache) and print the training summary
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from jtp.errors import ConfigError

DEMO_LABEL = "demo checkpoint (a tiny toy model trained for seconds on a few KB of text: expect simple repetitive English)"

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parents[1]  # the source checkout, when jtp runs from one
DEMO_DIR_ENV = "JTP_DEMO_DIR"
CACHE_ENV = "JTP_DEMO_CACHE"  # where finished builds are kept; empty disables the cache
# What decides the build's bytes, with BUILD_LIBRARIES: the builder and the model layers it trains with.
BUILD_SOURCES = (PACKAGE_DIR / "corpus.py", PACKAGE_DIR / "build.py", PACKAGE_DIR.parent / "models" / "layers.py")
BUILD_LIBRARIES = ("jax", "jaxlib", "optax", "numpy", "tokenizers", "safetensors")
TRAINING_MODULES = ("optax",)  # what the build needs beyond jtp's own dependencies

DEMO_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
    "training.json",  # the training log; its "recipe" says which build this is
)


def user_cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def default_demo_dir(root: Path = REPO_ROOT) -> Path:
    """checkpoints/demo-qwen3 in a source checkout `root`; elsewhere (an installed jtp, whose
    root is site-packages) the per-user cache, never the installation itself."""
    if (root / "pyproject.toml").is_file() and (root / "jtp").is_dir():
        return root / "checkpoints" / "demo-qwen3"
    return user_cache_home() / "jtp" / "demo-qwen3"


def demo_dir() -> Path:
    return Path(os.environ.get(DEMO_DIR_ENV) or default_demo_dir())


def cache_dir() -> Path | None:
    """Where finished builds are kept (None: caching disabled)."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return Path(configured) if configured else None
    return user_cache_home() / "jtp" / "demo"


def recipe() -> str:
    """What determines the build's bytes: the build's source files and the libraries that compute it."""
    digest = hashlib.sha256()
    for path in BUILD_SOURCES:
        digest.update(path.read_bytes())
    for dist in BUILD_LIBRARIES:
        try:
            digest.update(f"{dist}=={metadata.version(dist)};".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{dist} missing;".encode())
    return digest.hexdigest()[:16]


def is_complete(directory: Path) -> bool:
    """Every file present and built by the current recipe (an older build is rebuilt)."""
    if not all((Path(directory) / name).is_file() for name in DEMO_FILES):
        return False
    try:
        return json.loads((Path(directory) / "training.json").read_text())["recipe"] == recipe()
    except (OSError, ValueError, KeyError):
        return False


def check_can_build() -> None:
    """A clear error, before any work, when the training libraries are not installed."""
    missing = [name for name in TRAINING_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(
            f"building the demo checkpoint needs {', '.join(missing)}, which is not installed: "
            "pip install 'jtp[demo]' (or pass --model DIR to use a real checkpoint)"
        )


def build_in_subprocess(directory: Path) -> None:
    """Run the build in a fresh CPU-only Python, whatever this process's jax set-up."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # e.g. the tests' forced device count
    proc = subprocess.run(
        [sys.executable, "-m", "jtp.demo", str(directory)], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building the demo checkpoint failed:\n{proc.stderr[-4000:]}")


def install(staging: Path, target: Path) -> None:
    """Atomically make the finished `staging` directory `target` (a racing builder may win)."""
    if is_complete(target):
        return
    if target.exists():  # a stale or broken build: move it aside first, then drop it
        trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
        try:
            os.replace(target, trash / target.name)
        except FileNotFoundError:  # another process moved it already
            pass
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.replace(staging, target)
    except OSError:
        # Another process installed its (byte-identical) build between our check and the rename.
        if not is_complete(target):
            raise


def build_into(target: Path, source: Path | None) -> Path:
    """Copy `source` (or train anew when None) into a staging dir beside `target`, then rename."""
    if source is None:
        check_can_build()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would leave the installed checkpoint private
    try:
        if source is not None:
            for name in DEMO_FILES:
                shutil.copyfile(source / name, staging / name)
        else:
            print(f"jtp: building the demo checkpoint in {target} (training a tiny model, ~30 s, once)", file=sys.stderr)
            build_in_subprocess(staging)
        install(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def cached_build() -> Path | None:
    """A complete build in the cache, training it there first if needed; None without a usable cache.

    A lock file makes concurrent callers wait for one training run instead of each doing their own.
    """
    cache = cache_dir()
    if cache is None:
        return None
    entry = cache / recipe()
    if is_complete(entry):
        return entry
    check_can_build()  # before the lock and the cache directory
    try:
        cache.mkdir(parents=True, exist_ok=True)
        lock = open(cache / f"{entry.name}.lock", "w")
    except OSError:  # e.g. a read-only home: build straight into the target instead
        return None
    with lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except (ImportError, OSError):  # no flock here: racing builders still end up correct
            pass
        if not is_complete(entry):
            build_into(entry, None)
            prune_cache(cache, keep=entry.name)
    return entry


def prune_cache(cache: Path, keep: str, max_age_days: float = 7) -> None:
    """Drop builds of other recipes (other checkouts or versions) made over a week ago: a few MB each."""
    cutoff = time.time() - max_age_days * 86400
    for path in cache.iterdir():
        name = path.name.removesuffix(".lock")
        if name != keep and not name.startswith(".") and path.stat().st_mtime < cutoff:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def ensure_demo_checkpoint(path: str | Path | None = None) -> Path:
    """Return the demo checkpoint directory, building it first if it is missing, incomplete or stale.

    Safe when several processes call it at once: each works in its own temporary directory and
    installs it with an atomic rename.
    """
    target = Path(path) if path is not None else demo_dir()
    if is_complete(target):
        return target
    source = cached_build()
    if source is not None and source.resolve() == target.resolve():
        return target
    return build_into(target, source)
