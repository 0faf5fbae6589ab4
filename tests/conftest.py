"""Test-wide setup: 8 forced CPU devices so sharding tests run anywhere, one XLA compilation cache,
the test tiers, and the checkpoints several modules share.

XLA reads the flags once, when jax initialises its backends, so they must be set before anything
imports jax. Subprocesses get the same flags (other than the device count) from `cpu_env.cpu_env`.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "").split()
# The tests compile hundreds of tiny step programs and run each a few times, and no test is about
# codegen speed: LLVM's -O0, XLA's older loop emitters and one codegen unit per program compile a
# step 2-3x faster on a CI core (docs/bench/ci-time.md), with the same tokens and logprobs within
# every test's tolerance. JTP_TEST_XLA_OPT=1 tests with XLA's defaults instead.
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                 "--xla_cpu_parallel_codegen_split_count=1")
if os.environ.get("JTP_TEST_XLA_OPT") != "1":
    for _flag in _FAST_COMPILE:
        if not any(f.startswith(_flag.split("=")[0] + "=") for f in _flags):
            _flags.append(_flag)
if not any(f.startswith("--xla_force_host_platform_device_count") for f in _flags):
    _flags.append("--xla_force_host_platform_device_count=8")
os.environ["XLA_FLAGS"] = " ".join(_flags)

# One XLA compilation cache for the whole test session, empty at its start: engines built by
# different tests (and the CLI subprocesses, through JTP_COMPILATION_CACHE) compile identical
# steps, and compilation is most of this suite's time on a CPU. Nothing outlives the session.
# (With pytest-xdist the controller's conftest runs first and the workers inherit the directory.)
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

if "JTP_TEST_COMPILATION_CACHE" not in os.environ:
    os.environ["JTP_TEST_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="jtp-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JTP_TEST_COMPILATION_CACHE"], ignore_errors=True)
os.environ["JTP_COMPILATION_CACHE"] = os.environ["JTP_TEST_COMPILATION_CACHE"]
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["JTP_TEST_COMPILATION_CACHE"]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
# No size bound, here and in every CLI subprocess (jtp.entrypoints.cli_support.enable_compilation_cache
# leaves this one standing): under a bound each write takes one lock shared by every process and scans
# the whole directory to evict, and this directory grows to thousands of entries (the scans were a third
# of test_moe's time). Unbounded, JAX takes no lock: a read that meets an entry still being written fails
# its zlib check and compiles instead.
os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = "-1"

import pytest  # noqa: E402

# ----------------------------------------------------------------------------- tiers
# Every test module is in exactly one tier (`pytest -m unit`, `-m "not distributed"`, ...):
#   unit         host logic, kernels and parsers; no engine, no subprocess; seconds
#   integration  real engines, servers and CLI subprocesses on tiny checkpoints, one process group
#   parity       numerical parity with HF transformers (needs the reference extra); .ci/run
#                fails if any of them is skipped
#   distributed  multi-process groups (leader + followers over gloo) and their failure handling
# A test or fixture parameter marked with a tier itself keeps that tier (test_server's
# two-process group, the pure-host tests of an engine module).
TIERS = ("unit", "integration", "parity", "distributed")
MODULE_TIERS = {
    "unit": (
        "test_attention", "test_input_batch", "test_layout", "test_page_pool", "test_sampling", "test_state_pool",
        "test_tokenizer", "test_load_integrity", "test_fused_norm", "test_moe_routing",
        "test_delta_rule_kernel",
    ),
    "parity": ("test_hf_parity", "test_qwen3_5", "test_prompt_logprobs", "test_fp8", "test_quantize_checkpoint",
               "test_int4", "test_vision", "test_multimodal_engine"),
    "distributed": ("test_launcher",),
}
_TIER_OF = {module: tier for tier, modules in MODULE_TIERS.items() for module in modules}


def tier_of(item) -> str:
    own = [m.name for m in item.iter_markers() if m.name in TIERS]
    if own:
        return own[0]  # the closest marker: the test's (or its parameter's) before its module's
    return _TIER_OF.get(item.module.__name__.rpartition(".")[2], "integration")


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = tier_of(item)
        item.add_marker(tier)
        # In the JUnit report too, so .ci/run can check the parity tier by marker, not by file name.
        item.user_properties.append(("tier", tier))


# ----------------------------------------------------------------------------- shared checkpoints


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """A complete copy of the embedded demo checkpoint that nothing else writes into (trained once
    per machine and cached, see jtp.demo; copying it is a few MB)."""
    from jtp.demo import ensure_demo_checkpoint

    return ensure_demo_checkpoint(tmp_path_factory.mktemp("demo") / "demo-qwen3")


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory):
    """A tiny Qwen3 MoE checkpoint (tests/hf_models.py): its directory."""
    pytest.importorskip("torch")
    from hf_models import make_hf_checkpoint

    return str(make_hf_checkpoint("qwen3_moe", tmp_path_factory.mktemp("tiny-moe"))[1])


@pytest.fixture(scope="session", params=["demo", "moe", "hybrid"])
def staggered_model(request):
    """The three families a staggered batch is checked on: the demo Qwen3, a tiny MoE, a tiny hybrid."""
    fixture = {"demo": "demo_dir", "moe": "tiny_moe_dir", "hybrid": "hybrid_hk4"}[request.param]
    value = request.getfixturevalue(fixture)
    return str(value[1] if request.param == "hybrid" else value)


@pytest.fixture(scope="session")
def hybrid_hk4(tmp_path_factory):
    """A tiny Qwen3.5 hybrid with 4 key heads and 4 KV heads (tp 1, 2 and 4 all split it), seed 1:
    (the HF model, its directory)."""
    pytest.importorskip("torch")
    from hf_hybrid import build_model, save

    model = build_model("qwen3_5_text_hk4", seed=1)
    return model, save(model, tmp_path_factory.mktemp("hybrid-hk4"))


@pytest.fixture(scope="session")
def hybrid_qwen3_5_dir(tmp_path_factory):
    """A tiny two-layer Qwen3.5 hybrid (dense FFN; hf_hybrid.SHALLOW), seed 1: its directory."""
    pytest.importorskip("torch")
    from hf_hybrid import SHALLOW, build_model, save

    return save(build_model("qwen3_5_text", seed=1, **SHALLOW), tmp_path_factory.mktemp("hybrid-qwen3_5"))


@pytest.fixture(scope="session")
def shallow_hybrid_hk4_dir(tmp_path_factory):
    """hybrid_hk4's config with two layers (hf_hybrid.SHALLOW), seed 1: its directory."""
    pytest.importorskip("torch")
    from hf_hybrid import SHALLOW, build_model, save

    return save(build_model("qwen3_5_text_hk4", seed=1, **SHALLOW), tmp_path_factory.mktemp("hybrid-hk4-shallow"))
