"""Test-wide setup: 8 forced CPU devices so sharding tests run anywhere.

XLA reads the flag once, when jax initialises its backends, so it must be set
before anything imports jax.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# One XLA compilation cache for the whole test session, empty at its start: engines built by
# different tests (and the CLI subprocesses, through JTP_COMPILATION_CACHE) compile identical
# steps, and compilation is most of this suite's time on a CPU. Nothing outlives the session.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

if "JTP_TEST_COMPILATION_CACHE" not in os.environ:
    os.environ["JTP_TEST_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="jtp-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JTP_TEST_COMPILATION_CACHE"], ignore_errors=True)
os.environ["JTP_COMPILATION_CACHE"] = os.environ["JTP_TEST_COMPILATION_CACHE"]
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["JTP_TEST_COMPILATION_CACHE"]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
