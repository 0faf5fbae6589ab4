"""Defaults sized from the device, the KV pool sized from a measured memory plan, and device memory
running out at each stage: one line naming the flag to change, a warm-up that compiles on, a server
that keeps serving."""

import os
import resource
import subprocess
import sys
import threading

import jax
import pytest

from cpu_env import cpu_env
from jtp import Engine, EngineArgs
from jtp.config.device_defaults import HOST, LARGE_GPU, SMALL_GPU, batch_defaults
from jtp.core.sampling_params import SamplingParams
from jtp.engine import memory, warmup
from jtp.worker.devices import with_device_defaults
from jtp.worker.runner import ModelRunner

GIB = 2**30


def test_batch_defaults_follow_the_device_class():
    # vLLM's line: cards of 70 GiB or more (H100, H200) get the large defaults.
    assert batch_defaults("gpu", 80 * GIB) == LARGE_GPU == batch_defaults("gpu", 141 * GIB)
    assert batch_defaults("gpu", 40 * GIB) == SMALL_GPU == batch_defaults("gpu", None)
    assert batch_defaults("cpu", None) == HOST
    assert LARGE_GPU.max_num_batched_tokens == 8192  # vLLM's server default on such cards


def test_args_left_out_take_the_device_defaults_and_given_ones_stand():
    on_cpu = with_device_defaults(EngineArgs())
    assert (on_cpu.max_num_seqs, on_cpu.max_num_batched_tokens) == (HOST.max_num_seqs, HOST.max_num_batched_tokens)
    many = with_device_defaults(EngineArgs(max_num_seqs=600))
    assert many.max_num_seqs == 600 and many.max_num_batched_tokens > 600  # prefill keeps room beside decode
    few_tokens = with_device_defaults(EngineArgs(max_num_batched_tokens=40))
    assert few_tokens.max_num_batched_tokens == 40 and few_tokens.max_num_seqs < 40
    few_tokens.validate()


def test_the_allocator_is_handed_the_utilization_before_the_backend_starts():
    code = ("import os; from jtp import EngineArgs; from jtp.worker.devices import with_device_defaults; "
            "with_device_defaults(EngineArgs(gpu_memory_utilization=0.8)); "
            "print(os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])")
    env = cpu_env()
    env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "0.8000", out.stderr[-2000:]
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.5"  # the user's own choice stands
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "0.5", out.stderr[-2000:]


@pytest.fixture
def device_of(monkeypatch):
    """The runner reports allocator stats as a GPU's would: `limit` bytes, the weights in use."""

    def make(limit: int):
        def stats(runner):
            weights = sum(x.nbytes for x in jax.tree.leaves(runner.params) if hasattr(x, "nbytes"))
            cache = sum(x.nbytes for x in jax.tree.leaves(runner.cache)) if runner.cache is not None else 0
            return {"bytes_limit": limit, "bytes_in_use": weights + cache}

        monkeypatch.setattr(ModelRunner, "memory_stats", stats)

    return make


def test_the_pool_is_what_the_measured_plan_leaves(device_of):
    device_of(GIB)
    args = EngineArgs(gpu_memory_utilization=0.9, max_num_seqs=8, max_num_batched_tokens=256, warmup=False)
    with Engine.from_args(args) as engine:
        plan, runner = engine.runner.memory_plan, engine.runner
        assert plan.budget == int(GIB * 0.9 / memory.allocator_fraction()) or plan.budget == GIB
        assert plan.workspace > 0
        assert engine.pool.total_blocks == plan.kv_bytes // runner.bytes_per_block()
        # The workspace measured against a pool of one request is the largest step's against the real
        # pool: XLA's accounting of the same programs compiled for the engine's own cache.
        step = memory.largest_step(engine.config, runner)
        assert memory.step_workspace_bytes(runner, step) == plan.workspace
        assert plan.in_use == sum(x.nbytes for x in jax.tree.leaves(runner.params) if hasattr(x, "nbytes"))


def test_a_budget_the_weights_fill_is_refused_naming_the_flags(device_of):
    device_of(64 << 20)  # less than the workspace and margin beside the demo's weights
    with pytest.raises(Exception, match="no device memory left for the KV cache.*--gpu-memory-utilization"):
        Engine.from_args(EngineArgs(max_num_seqs=8, max_num_batched_tokens=256, warmup=False))


def test_compile_threads_fit_the_room_left(device_of, monkeypatch):
    device_of(GIB)
    with Engine.from_args(EngineArgs(max_num_seqs=8, max_num_batched_tokens=256, warmup=False)) as engine:
        runner = engine.runner
        free = runner.memory_plan.budget - runner.memory_stats()["bytes_in_use"]
        monkeypatch.setattr(runner, "memory_plan", runner.memory_plan.__class__(
            **{**runner.memory_plan.__dict__, "compile_scratch": free // 3}))
        assert memory.compile_threads_for_memory(runner, 8) == 2  # 1.25 scratches each: two fit, not three
        assert memory.compile_threads_for_memory(runner, 1) == 1


def test_warmup_that_runs_out_of_memory_in_a_compile_thread_finishes_on_one(monkeypatch, caplog):
    """XLA's RESOURCE_EXHAUSTED from one compile thread (as GPU autotuning beside a full pool raised
    it): the warm-up compiles the rest in order and the engine is ready, having compiled every shape."""
    real = jax.stages.Lowered.compile
    failed = []

    def compile_once_out_of_memory(self, *a, **kw):
        if not failed and threading.current_thread().name.startswith("jtp-compile"):
            failed.append(True)
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.17GiB")
        return real(self, *a, **kw)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_once_out_of_memory)
    monkeypatch.setenv(warmup.WORKERS_ENV, "2")
    with Engine.from_args(EngineArgs(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=64)) as engine:
        engine.warmup()
        assert failed and engine.ready.is_set()
        assert "compiling the rest on one" in caplog.text
        before = engine.runner.compilations
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
        assert engine.runner.compilations == before, "every shape was compiled before ready"


def _limit_address_space():
    resource.setrlimit(resource.RLIMIT_AS, (10 * GIB, 10 * GIB))


def test_a_pool_the_host_cannot_allocate_is_one_line_naming_the_flag(tmp_path):
    """A real out-of-memory (the process's address space capped below the pool asked for): exit 2,
    one line that names --num-blocks, no traceback, no crash."""
    blocks = (12 * GIB) // 16384  # the demo's 16 KiB blocks: 12 GiB of pages
    out = subprocess.run([sys.executable, "-m", "jtp.entrypoints.cli", "generate", "hi", "--max-tokens", "2",
                          "--num-blocks", str(blocks)], env=cpu_env(), capture_output=True, text=True, timeout=300,
                         preexec_fn=_limit_address_space, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "out of device memory allocating the KV cache" in errors[0], out.stderr[-3000:]
    assert "--num-blocks" in errors[0] and "Traceback" not in out.stderr
