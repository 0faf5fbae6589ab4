"""Pipeline parallelism: the model's layers in P contiguous stages, each on its own tensor-parallel
mesh over a disjoint slice of the devices, behind the ModelRunner interface. Stages are balanced by
parameter count (`stage_layers`), the LM head counted on the last stage; the last stage sits on the
first devices, which in a multi-process group are the leader's (it samples).

A step's forward program becomes one program per stage: stage 0 embeds the tokens and runs its
layers; each later stage runs its layers on the hidden states the one before handed over; the last
applies the final norm and the LM head, and sampling runs on its mesh. Each stage holds only its
layers' weights and K/V pages (or recurrent states). The hand-off is a collective permute over a
(stage: 2, tp) mesh of the two stages' devices, which XLA emits (NCCL between GPUs, gloo between
CPU processes): the same program whether the stages share a process or not. Each process runs
the stages on its own devices and the hand-offs it takes part in.

The host never waits between stages: JAX dispatches asynchronously and each stage's devices run
their own queue, so while stage 1 runs step N, stage 0 already runs step N+1 -- provided step N+1
does not need step N's tokens. The engine keeps `pipeline_depth` steps of disjoint requests in
flight (micro-batch groups: Scheduler's `pipeline_depth`) so every stage has work.

`StageClock` watches each stage's outputs become ready and keeps per-stage counts for /stats:
steps, time busy, and the bubble (the share of the pipeline's active time a stage sat idle).

Images: the vision tower and the image pool live with stage 0 (its embedding reads the pool); the
later stages see the M-RoPE positions in the step's metadata. Snapshot pages are gathered and
scattered stage by stage, under the layers' global names (a pipeline's snapshot loads into an engine
of the same tp without stages, and back). Not yet: snapshots of a pipeline across processes, the
multi-step decode loop, speculative decoding.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import queue
import threading
import time
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jtp.config.engine_config import EngineConfig
from jtp.core.packed_step import PackedStep, StepLayout
from jtp.core.step_input import StepInput
from jtp.errors import ConfigError
from jtp.loading.weights import load_params
from jtp.models import family_of
from jtp.models.attention import choose_attention
from jtp.models.moe import choose_experts
from jtp.parallel.sharding import make_mesh, replicated
from jtp.worker import kv_cache
from jtp.worker.runner import ModelRunner, fused_for_one_device, host_buffers
from jtp.worker.step_programs import plan_arrays
from jtp.worker.trace_count import count_traces, note_trace


def stage_layers(layer_costs: Sequence[float], num_stages: int, head_cost: float = 0.0) -> list[range]:
    """Each stage's contiguous layers, so that the costliest stage costs least (the last stage also
    pays `head_cost`, the LM head). Costs are parameter counts: a dense decode step reads every
    weight once, so a stage's time follows its bytes (a MoE layer reads only the experts its tokens
    chose, but every layer alike, so the split between layers holds; the head weighs less there)."""
    L = len(layer_costs)
    if L < num_stages:
        raise ConfigError(f"--pipeline-parallel-size {num_stages}: the model has only {L} layers")
    prefix = [0.0, *itertools.accumulate(layer_costs)]
    # best[s][i]: the least max-stage cost of layers [0, i) in s stages (the head comes last, below).
    best = [[math.inf] * (L + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (L + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        extra = head_cost if s == num_stages else 0.0
        for i in range(s, L + 1):
            for j in range(s - 1, i):  # stage s holds layers [j, i)
                cost = max(best[s - 1][j], prefix[i] - prefix[j] + extra)
                if cost < best[s][i] - 1e-9:  # ties keep the earliest cut: even splits stay even
                    best[s][i], cut[s][i] = cost, j
    bounds, i = [L], L
    for s in range(num_stages, 0, -1):
        i = cut[s][i]
        bounds.append(i)
    bounds.reverse()
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def layer_costs(family, cfg) -> tuple[list[float], float]:
    """(each layer's parameter count, the LM head's): what `stage_layers` balances."""
    layers = [0.0] * cfg.num_layers
    head = 0.0
    for path, source in family.param_layout(cfg, 1).items():
        size = float(math.prod(source.shape))
        if path.startswith("layers."):
            layers[int(path.split(".", 2)[1])] += size
        elif path == "lm_head" or (path == "embed" and cfg.tie_word_embeddings):
            head += size
    return layers, head


def stage_keeps(layer_ids: range, first: bool, last: bool, tied: bool, path: str) -> bool:
    """Whether a stage loads parameter `path`: its layers, the embedding (first stage; the last too
    when the LM head is the embedding), the final norm and LM head (last stage)."""
    if path.startswith("layers."):
        return int(path.split(".", 2)[1]) in layer_ids
    if path == "embed":
        return first or (last and tied)
    return last


@dataclasses.dataclass
class Stage:
    index: int
    layer_ids: range
    mesh: Mesh
    params: dict
    program: object = None  # the jitted stage forward

    @property
    def first(self) -> bool:
        return self.index == 0


def runner_class(config: EngineConfig) -> type[ModelRunner]:
    return PipelineRunner if config.pipeline_parallel_size > 1 else ModelRunner


def _layers(family, cfg, attention, experts, stage: Stage, params, cache, x, ints, layout: StepLayout):
    """x [1, T, H] through the stage's layers; stage 0 (x None) embeds the step's tokens."""
    tokens, meta, logits_indices, _ = plan_arrays(layout, layout.views(ints))
    x = family.embed(params, cfg, tokens, meta) if stage.first else x[0]
    x, cache = family.decoder_layers(params, cfg, x, cache, meta, attention, experts, stage.layer_ids)
    return x, cache, logits_indices


def stage_forward(family, cfg, attention, experts, stage: Stage, params, cache, x, ints, layout: StepLayout):
    """A stage before the last: (its output hidden states [1, T, H], its updated cache)."""
    note_trace()
    x, cache, _ = _layers(family, cfg, attention, experts, stage, params, cache, x, ints, layout)
    return jax.lax.with_sharding_constraint(x[None], replicated(stage.mesh)), cache  # each device sends it whole


def last_stage_forward(family, cfg, attention, experts, logits_sharding, stage: Stage, params, cache, x, hidden_out,
                       ints, layout: StepLayout):
    """The last stage: its layers, the final norm, f32 logits at the rows' sample positions and the
    hidden states written to `hidden_out` (what the forward program of one mesh returns)."""
    note_trace()
    x, cache, logits_indices = _layers(family, cfg, attention, experts, stage, params, cache, x, ints, layout)
    hidden = family.final_norm(params, cfg, x)
    logits = family.compute_logits(params, hidden[logits_indices.reshape(-1)])
    hidden_out = jax.lax.dynamic_update_slice(hidden_out, hidden.astype(hidden_out.dtype), (0, 0))
    return jax.lax.with_sharding_constraint(logits, logits_sharding), cache, hidden_out


def _send(v):
    """The hand-off program's body: the sending stage's block [1, ...] to the receiving stage."""
    return jax.lax.ppermute(v, "stage", [(0, 1)])


class PipelineRunner(ModelRunner):
    defers_cache = False  # its stages' caches are cut from the pool as it is allocated
    def __init__(self, config: EngineConfig, devices=None):
        pp, tp = config.pipeline_parallel_size, config.tensor_parallel_size
        devices = list(jax.devices() if devices is None else devices)
        if pp * tp > len(devices):
            raise ConfigError(f"--pipeline-parallel-size {pp} x --tensor-parallel-size {tp} needs {pp * tp} devices, "
                              f"but {len(devices)} ({devices[0].platform}) are visible")
        self._devices = devices[: pp * tp]
        # The last stage on the first devices: in a group those are the leader's, and the leader samples.
        self.stage_devices = [devices[(pp - 1 - s) * tp:(pp - s) * tp] for s in range(pp)]
        me = jax.process_index()
        self.local = [any(d.process_index == me for d in stage) for stage in self.stage_devices]
        # The base runner's mesh is the last stage's: sampling, logits and prompt scores live there.
        super().__init__(config, self.stage_devices[-1])
        self.stages[-1].params = self.params  # as the base runner left them (FP8 kernel weights)
        for stage in self.stages:
            attention, experts = choose_attention(stage.mesh), choose_experts(stage.mesh, config.enable_expert_parallel)
            if stage is self.stages[-1]:
                fn = functools.partial(last_stage_forward, self.family, self.cfg, attention, experts,
                                       self._logits_sharding, stage)
                stage.program = jax.jit(fn, donate_argnums=(1, 3), static_argnames=("layout",))
            else:
                fn = functools.partial(stage_forward, self.family, self.cfg, attention, experts, stage)
                stage.program = jax.jit(fn, donate_argnums=(1,), static_argnames=("layout",))
        # Stage s -> s+1: a collective permute over a (stage: 2, tp) mesh of the two stages' devices,
        # device i of one to device i of the other.
        self._links = {}
        for src, dst in [(s, s + 1) for s in range(pp - 1)]:
            mesh = Mesh(np.array([self.stage_devices[src], self.stage_devices[dst]]), ("stage", "tp"))
            program = jax.jit(jax.shard_map(_send, mesh=mesh, in_specs=P("stage"), out_specs=P("stage")))
            self._links[src, dst] = (mesh, program)
        self._zeros: dict[tuple, jax.Array] = {}  # the receiving side's blocks, by (shape, dtype, device)
        self.clock = StageClock(self.local)

    def _load_params(self) -> dict:
        """Each local stage's weights on its own mesh; returns the last stage's (the LM head's)."""
        config, cfg = self.config, self.cfg
        costs, head = layer_costs(family_of(cfg), cfg)
        layers = stage_layers(costs, len(self.stage_devices), head)
        self.stages = []
        for s, (devices, layer_ids) in enumerate(zip(self.stage_devices, layers)):
            last = s == len(layers) - 1
            mesh = self.mesh if last else make_mesh(config.tensor_parallel_size, devices)
            params = {}
            if self.local[s]:
                keep = functools.partial(stage_keeps, layer_ids, s == 0, last, cfg.tie_word_embeddings)
                params = load_params(config.model, cfg, mesh, self.dtype, config.enable_expert_parallel, False,
                                     config.load_format, config.quantization, keep)
                if not last:  # (the base runner fuses the last stage's: __init__)
                    params = fused_for_one_device(params, mesh)
            self.stages.append(Stage(s, layer_ids, mesh, params))
        return self.stages[-1].params

    @property
    def pipeline_depth(self) -> int:
        """Steps of disjoint requests the engine keeps in flight: one per stage."""
        return len(self.stages)

    @property
    def all_devices(self) -> list:
        return list(self._devices)

    @property
    def embedding_mesh(self):
        return self.stages[0].mesh

    def _use_image_pool(self) -> None:
        first = self.stages[0]
        first.params = {**first.params, "image_pool": self.images.pool}

    # ------------------------------------------------------------------ the cache

    def _init_cache(self, num_blocks: int, num_state_slots: int) -> list:
        """Every layer's cache in layer order, each on its stage's mesh (None: another process's stage)."""
        cache = []
        for stage in self.stages:
            if self.local[stage.index]:
                cache += self.family.init_cache(self.cfg, stage.mesh, num_blocks, self.block_size, num_state_slots,
                                                self.dtype, self.kv_dtype, stage.layer_ids)
            else:
                cache += [None] * len(stage.layer_ids)
        return cache

    def _stage_bytes(self, stage: Stage, num_blocks: int, num_state_slots: int) -> int:
        shapes = jax.eval_shape(lambda: self.family.init_cache(
            self.cfg, stage.mesh, num_blocks, self.block_size, num_state_slots, self.dtype, self.kv_dtype,
            stage.layer_ids))
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))

    def bytes_per_block(self) -> int:
        """One more block on each device of the stage it costs most (each stage holds its layers' pages)."""
        return max(self._stage_bytes(s, 2, 1) - self._stage_bytes(s, 1, 1) for s in self.stages) // self.tp

    def bytes_per_state_slot(self) -> int:
        return max(self._stage_bytes(s, 1, 2) - self._stage_bytes(s, 1, 1) for s in self.stages) // self.tp

    def _stage_cache(self, stage: Stage) -> list:
        return self.cache[stage.layer_ids.start:stage.layer_ids.stop]

    # ------------------------------------------------------------------ the forward program, stage by stage

    def dispatch(self, step: PackedStep | StepInput, late: bool = False):
        """As ModelRunner.dispatch where this process holds the last stage; elsewhere (a follower)
        only its stages and hand-offs run, and there is no result."""
        if self.local[-1]:
            return super().dispatch(step, late)
        ints, _, layout, _ = host_buffers(step, self.images is not None)
        self.check_long_rows(ints, layout)
        _, self.cache, _ = self._pipeline_forward(ints[: layout.forward.offsets()[2]], layout=layout.forward)
        return None

    def _forward_program(self, ints, layout: StepLayout):
        forward = layout.forward
        return ("pipeline", forward), self._pipeline_forward, (ints[: forward.offsets()[2]],), forward

    def _stage_args(self, stage: Stage, x, ints):
        if stage is self.stages[-1]:
            return stage.params, self._stage_cache(stage), x, self.hidden, ints
        return stage.params, self._stage_cache(stage), x, ints

    def _hand_over(self, x, src: int, dst: int, shape: tuple, dtype):
        """x [1, ...] on stage `src`'s devices -> the same on stage `dst`'s, by the link's collective
        permute. This process contributes the blocks on its devices (those of x it holds, none where x
        is None, and zeros to receive into) and gets what its devices of `dst` received (None if it
        has none there)."""
        mesh, program = self._links[src, dst]
        sent = (2, *shape[1:])
        blocks = [] if x is None else [shard.data for shard in x.addressable_shards]
        for device in self.stage_devices[dst]:
            if device.process_index == jax.process_index():
                key = (shape, dtype, device)
                if key not in self._zeros:
                    self._zeros[key] = jax.device_put(np.zeros(shape, dtype), device)
                blocks.append(self._zeros[key])
        compiled = self._executables.get(("link", src, dst, sent))
        both = jax.make_array_from_single_device_arrays(sent, NamedSharding(mesh, P("stage")), blocks, dtype=dtype)
        received = [shard.data for shard in (compiled or program)(both).addressable_shards
                    if shard.device in self.stage_devices[dst]]
        if not received:
            return None
        return jax.make_array_from_single_device_arrays(shape, replicated(self.stages[dst].mesh), received)

    def _hidden_shape(self, layout: StepLayout) -> tuple[int, int, int]:
        """What a stage hands to the next: hidden states [1, T, H]."""
        return 1, layout.num_tokens, self.cfg.hidden_size

    @staticmethod
    def _refuse_tokens_in_flight(ints, layout: StepLayout) -> None:
        """Stage 0 reads every token from the step (it never waits for the last stage's sampling): the
        scheduler skips requests whose token is still in flight, so a -1 token is a bug upstream."""
        if (layout.views(ints)["token_ids"] < 0).any():
            raise ValueError("a pipeline's step named a token still in flight (token id -1): its scheduler "
                             "must not schedule a request before its last step's tokens are processed")

    def _pipeline_forward(self, ints, layout: StepLayout):
        """Each local stage's program in turn, the hidden states handed from stage to stage; returns
        what the one-mesh forward program returns: (logits, the whole cache, hidden states), logits
        None where the last stage is another process's."""
        self._refuse_tokens_in_flight(ints, layout)
        x, cache = None, []
        dispatched = time.perf_counter()
        logits = None
        for stage in self.stages:
            if not self.local[stage.index]:
                cache += self._stage_cache(stage)
                out = (None,)
            else:
                args = self._stage_args(stage, x, ints)
                compiled = self._executables.get(("stage", stage.index, layout))
                out = compiled(*args) if compiled is not None else stage.program(*args, layout=layout)
                self.clock.dispatched(stage.index, out[0], None if stage.first else x, dispatched)
                cache += out[1]
            if stage is self.stages[-1]:
                if self.local[-1]:
                    logits, self.hidden = out[0], out[2]
                return logits, cache, self.hidden
            if self.local[stage.index] or self.local[stage.index + 1]:
                x = self._hand_over(out[0], stage.index, stage.index + 1, self._hidden_shape(layout), self.dtype)

    def lower(self, step: PackedStep | StepInput, skip=frozenset(), again: bool = False) -> list:
        """As ModelRunner.lower, the forward program being each stage's program and hand-off (one
        process: warm-up compiles ahead only outside groups)."""
        ints, _, layout, _ = host_buffers(step, self.images is not None)
        forward = layout.forward
        plan, hidden = ints[: forward.offsets()[2]], self._hidden_shape(forward)
        wanted = lambda key: key not in skip and (again or key not in self._executables)  # noqa: E731
        out = []
        for stage in self.stages:
            key = ("stage", stage.index, forward)
            if wanted(key):
                x = None if stage.first else jax.ShapeDtypeStruct(hidden, self.dtype, sharding=replicated(stage.mesh))
                start = time.perf_counter()
                with count_traces(self):
                    out.append((key, stage.program.lower(*self._stage_args(stage, x, plan), layout=forward)))
                self.compile_seconds += time.perf_counter() - start
            if stage is not self.stages[-1]:
                mesh, link = self._links[stage.index, stage.index + 1]
                sent = (2, *hidden[1:])
                key = ("link", stage.index, stage.index + 1, sent)
                if wanted(key):
                    out.append((key, link.lower(jax.ShapeDtypeStruct(sent, self.dtype,
                                                                     sharding=NamedSharding(mesh, P("stage"))))))
        # The sampling (and prompt-scores) programs: the base runner's, on the last stage's mesh.
        return out + super().lower(step, frozenset(skip) | {("pipeline", forward)}, again)

    def _executable_store(self) -> None:
        return None  # stage programs run on other devices than the context names: compiled every start

    def placement(self, key) -> object:
        """A stage's program or a hand-off: its stages (the same code on two stages is two executables)."""
        return key[:3] if key[0] == "link" else key[:2] if key[0] == "stage" else "last stage"

    # ------------------------------------------------------------------ snapshot pages, stage by stage

    def gather_pages(self, block_ids: np.ndarray, slot_ids: np.ndarray) -> dict:
        """As ModelRunner.gather_pages, each stage's layers gathered on its own mesh (one process)."""
        out: dict = {}
        for stage in self.stages:
            views = kv_cache.cache_views(self._stage_cache(stage), stage.layer_ids.start)
            for kind, layers in kv_cache.gather_pages(*views, block_ids, slot_ids).items():
                out.setdefault(kind, {}).update(layers)
        return out

    def scatter_pages(self, block_ids, block_rows, slot_ids, slot_rows, arrays: dict) -> None:
        pages = arrays.get("kv", {}) if len(block_ids) else {}
        states = arrays.get("state", {}) if len(slot_ids) else {}
        cache = []
        for stage in self.stages:
            first = stage.layer_ids.start
            names = {kv_cache.layer_name(i) for i in stage.layer_ids}
            cache += kv_cache.scatter_pages(
                self._stage_cache(stage), block_ids, block_rows, {n: v for n, v in pages.items() if n in names},
                slot_ids, slot_rows, {n: v for n, v in states.items() if n in names}, first)
        self.cache = cache

    def stage_stats(self) -> list[dict]:
        """Per stage: its layers, devices, steps, busy seconds, mean step time and bubble share
        (counted by the process that runs the stage: None for another process's)."""
        return [{"stage": s.index, "layers": [s.layer_ids.start, s.layer_ids.stop],
                 "devices": [str(d) for d in s.mesh.devices.flat],
                 **(self.clock.stats(s.index) if self.local[s.index] else dict.fromkeys(StageClock.FIELDS))}
                for s in self.stages]

    def close(self) -> None:
        self.clock.close()
        for stage in self.stages:
            for leaf in jax.tree.leaves(stage.params):
                if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                    leaf.delete()
            stage.params = {}
        self._zeros.clear()
        super().close()


class StageClock:
    """Per-stage timing from when each stage's input and output become ready, one watcher thread per
    stage (a stage's programs finish in the order they were dispatched).

    Stage s's step n starts once its previous step is done and its input is ready (stage 0's input:
    the step's dispatch); it is busy from then until its output is ready. Where this process holds
    every stage, the pipeline is active while some step is between its dispatch and the last
    stage's end (the union of those spans), and a stage's bubble is the share of that time it was
    not busy; across processes the bubble is unknown here (None)."""

    FIELDS = ("steps", "busy_seconds", "active_seconds", "mean_step_ms", "bubble_fraction")

    def __init__(self, local: list[bool]):
        self._lock = threading.Lock()
        self._all_local = all(local)
        self._last = len(local) - 1
        self._steps = [0] * len(local)
        self._last_ready = [0.0] * len(local)
        self._busy = [0.0] * len(local)
        self._active = 0.0
        self._active_end = 0.0
        self._queues = [queue.SimpleQueue() for _ in local]
        for s, here in enumerate(local):
            if here:
                threading.Thread(target=self._watch, args=(s,), name=f"jtp-stage-{s}", daemon=True).start()

    def dispatched(self, stage: int, output, received, at: float) -> None:
        """Stage `stage` of a step dispatched at `at`: its output, and its input (None for stage 0)."""
        self._queues[stage].put((output, received, at))

    def _watch(self, stage: int) -> None:
        q = self._queues[stage]
        while (item := q.get()) is not None:
            output, received, dispatched = item
            input_at = dispatched
            try:
                if received is not None:
                    received.block_until_ready()
                    input_at = time.perf_counter()
                output.block_until_ready()
            except Exception:  # noqa: BLE001 - a failed step is the engine's to report; count it done
                pass
            self._done(stage, dispatched, input_at, time.perf_counter())

    def _done(self, stage: int, dispatched: float, input_at: float, now: float) -> None:
        with self._lock:
            start = max(input_at, self._last_ready[stage]) if self._steps[stage] else input_at
            start = min(start, now)
            self._steps[stage] += 1
            self._last_ready[stage] = now
            self._busy[stage] += now - start
            if stage == self._last and self._all_local:
                # (from the dispatch: until stage 0 starts it, stage 0 is busy with the step before)
                self._active += max(0.0, now - max(dispatched, self._active_end))
                self._active_end = max(self._active_end, now)

    def stats(self, stage: int) -> dict:
        with self._lock:
            steps, busy = self._steps[stage], self._busy[stage]
            active = self._active if self._all_local else None
        return {"steps": steps, "busy_seconds": round(busy, 6),
                "active_seconds": None if active is None else round(active, 6),
                "mean_step_ms": round(1e3 * busy / steps, 4) if steps else None,
                "bubble_fraction": round(max(0.0, 1 - busy / active), 4) if active else None}

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
