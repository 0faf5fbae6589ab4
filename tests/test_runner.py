"""ModelRunner on the demo checkpoint: `close()` gives back every byte of device memory it held; the
allocator stats the KV pool is sized from."""

import gc
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jtp.config.engine_args import EngineArgs
from jtp.core.sampling_params import pack_sampling
from jtp.core.step_input import StepInput, StepPlan
from jtp.demo import ensure_demo_checkpoint
from jtp.worker.runner import ModelRunner


def live_bytes() -> int:
    gc.collect()  # arrays nobody references any more are not live
    return sum(a.nbytes for a in jax.live_arrays())


def prefill_plan(ids: list[int], block_size: int) -> StepPlan:
    """One row prefilling ids from position 0 into pages 0, 1, ..., state slot 0."""
    n = len(ids)
    pos = np.arange(n, dtype=np.int32)
    one = lambda v: np.array([v], np.int32)  # noqa: E731
    return StepPlan(
        token_ids=np.asarray(ids, np.int32),
        positions=pos,
        slot_mapping=pos,  # pages 0, 1, ... in order
        token_rows=np.zeros(n, np.int32),
        block_tables=np.arange(-(-n // block_size), dtype=np.int32)[None],
        context_lens=one(n),
        row_starts=one(0),
        row_lens=one(n),
        seq_slots=one(0),
        state_reads=one(-1),
        state_writes=one(0),
        state_keeps=one(-1),
        logits_indices=one(n - 1),
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_close_frees_weights_cache_and_sampled_tokens(tp):
    path = ensure_demo_checkpoint()
    baseline = live_bytes()
    runner = ModelRunner.from_args(EngineArgs(
        model=path, tensor_parallel_size=tp, num_blocks=16, block_size=16, max_num_seqs=4))
    # After a step the cache and the sampled tokens are the step's outputs (the inputs were donated).
    result = jax.device_get(runner.dispatch(StepInput(prefill_plan(list(range(1, 20)), 16), pack_sampling([], 1, [], []))))
    assert result.tokens.shape == (1, 1)  # [steps, rows]
    weights = sum(a.nbytes for a in jax.tree.leaves(runner.params))
    cache = sum(a.nbytes for a in jax.tree.leaves(runner.cache))
    assert live_bytes() - baseline >= weights + cache > 0

    runner.close()
    assert live_bytes() == baseline
    assert runner.params is None and runner.cache is None and runner.sampled is None


class FakeDevice:
    def __init__(self, process_index: int, stats):
        self.process_index, self.stats = process_index, stats

    def memory_stats(self):
        return self.stats


def test_memory_stats_are_this_process_fullest_devices():
    """The KV pool must fit on every device of this process (a pipeline's stages fill theirs unevenly);
    other processes' devices and devices that keep no stats are not guessed at."""
    gib = 1 << 30
    here, there = jax.process_index(), jax.process_index() + 1
    roomy = {"bytes_limit": 80 * gib, "bytes_in_use": 10 * gib}
    full = {"bytes_limit": 80 * gib, "bytes_in_use": 50 * gib}
    fuller_elsewhere = {"bytes_limit": 80 * gib, "bytes_in_use": 70 * gib}

    def stats(*devices):
        return ModelRunner.memory_stats(type("R", (), {"all_devices": list(devices)})())

    assert stats(FakeDevice(here, roomy), FakeDevice(here, full), FakeDevice(there, fuller_elsewhere)) is full
    assert stats(FakeDevice(here, roomy), FakeDevice(here, None)) is None
    assert stats(FakeDevice(here, {"bytes_in_use": 1})) is None
    assert stats(*jax.devices()) is None  # CPU devices keep no allocator stats


def test_decode_loop_command_buffers_are_xla_defaults_plus_loops(tmp_path, monkeypatch):
    """The decode loop's command-buffer types are the installed XLA's defaults with WHILE and
    CONDITIONAL added (what `+WHILE,+CONDITIONAL` in XLA_FLAGS gives, read back from XLA's own dump),
    and XLA_FLAGS that choose the types themselves are left alone."""
    from jtp.worker.step_programs import DECODE_LOOP_COMMAND_BUFFER, decode_loop_compiler_options

    flags = f"--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_dump_to={tmp_path}"
    subprocess.run([sys.executable, "-c", "import jax, jax.numpy as jnp; jax.jit(lambda x: x + 1)(jnp.ones(2))"],
                   env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}, check=True)
    dumped = next(tmp_path.glob("*.debug_options")).read_text().splitlines()
    xla_types = {line.split(":")[1].strip() for line in dumped if line.startswith("xla_gpu_enable_command_buffer:")}
    assert {"WHILE", "CONDITIONAL", "FUSION"} <= xla_types
    assert set(DECODE_LOOP_COMMAND_BUFFER.split(",")) == xla_types

    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
    assert decode_loop_compiler_options() == {}
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    assert decode_loop_compiler_options() == {"xla_gpu_enable_command_buffer": DECODE_LOOP_COMMAND_BUFFER}
