"""ModelRunner: the device side of the engine. It owns the sharded weights, the paged KV
cache and the one jitted step; it consumes packed steps (`PackedStep`: two flat numpy buffers,
laid out by the engine's `InputBatch`, or packed from an explicit `StepInput`) and returns the
sampled results.

Everything about *which* tokens run is decided on the host (scheduler); the runner only
executes. Followers in a multi-process deployment run the very same calls on their devices.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jtp.config.engine_args import EngineArgs
from jtp.config.engine_config import EngineConfig
from jtp.core.buckets import SHORT_ROW, long_rows
from jtp.core.sampling_params import pack_sampling
from jtp.core.step_input import PROMPT_CHUNK, SamplingBatch, StepInput, StepPlan
from jtp.core.multimodal import MAX_IMAGE_PATCHES
from jtp.core.packed_step import PackedStep, StepLayout
from jtp.loading.weights import load_params, resolve_dtype
from jtp.models import family_of
from jtp.models.attention import choose_attention, zeroed_layer_kv
from jtp.models.layers import fuse_projections
from jtp.models.moe import choose_experts
from jtp.parallel.rules import shapes_only
from jtp.parallel.sharding import make_mesh, replicated, tp_size
from jtp.worker import kv_cache, step_programs
from jtp.worker.compile_cache import thread_cache_hits
from jtp.worker.executable_store import ExecutableStore, StoredProgram
from jtp.worker.image_pool import image_pool_for
from jtp.worker.sampler import SampleResult
from jtp.worker.trace_count import count_traces


def fused_for_one_device(params: dict, mesh) -> dict:
    """`fuse_projections` on a one-device mesh (FP8 weights through the FP8 kernel on a GPU, or as
    JTP_FP8_KERNEL=1|0 forces: 1 interprets it off the GPU for tests); a sharded mesh keeps `params`."""
    forced = os.environ.get("JTP_FP8_KERNEL", "").strip()
    fp8_kernel = forced == "1" if forced in ("0", "1") else jax.default_backend() == "gpu"
    return fuse_projections(params, fp8_kernel) if mesh.devices.size == 1 else params


def is_ready(result) -> bool:
    """Whether a dispatched step's results are on the host's reach (the device finished it)."""
    return all(x.is_ready() for x in jax.tree.leaves(result))


class ModelRunner:
    compiles_ahead = True  # warm-up may compile its steps on a thread pool (`lower` / `install`)
    defers_cache = True  # allocate_cache(deferred=True): the pool's memory is taken at its first use
    samples_late = True  # `dispatch(step, late=True)`: the sampling program may wait for the host (token masks)
    pipeline_depth = 1  # steps of disjoint requests the engine keeps in flight (a pipeline's: one per stage)

    def __init__(self, config: EngineConfig, devices=None):
        """Load `config`'s model onto `devices` (default: the first tensor_parallel_size of this process).

        No KV cache yet: the engine sizes the pool (from the memory the weights left unless
        `config.num_blocks`) and calls `allocate_cache`, which a group's followers then repeat.
        """
        self.config = config
        self.cfg = config.model_config
        self.mesh = make_mesh(config.tensor_parallel_size, devices)
        self.dtype = resolve_dtype(self.cfg, config.dtype)
        # K/V pages: the model's dtype, or float8 e4m3 (--kv-cache-dtype fp8: written clipped, read as the model's dtype)
        self.kv_dtype = jnp.float8_e4m3fn if config.kv_cache_dtype.startswith("fp8") else self.dtype
        # mtp_drafts > 0: load the checkpoint's MTP head; every step then also drafts that many tokens per row.
        self.mtp_drafts = config.mtp_drafts
        self.params = self._load_params()
        self.load_format = config.load_format  # "dummy": no files to fingerprint (snapshots, launcher)
        # A checkpoint with a vision tower: its encoder and the pool of image-token embeddings the steps read.
        self.images, self.cfg = image_pool_for(config, self.cfg, self.embedding_mesh, self.dtype)
        if self.images is not None:
            self._use_image_pool()
        self.params = fused_for_one_device(self.params, self.mesh)
        self.block_size = block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.num_state_slots = config.num_state_slots  # recurrent-state slots (hybrid models)
        self.family = family_of(self.cfg)
        self.num_blocks = 0
        self._cache = None
        self.cache_deferred = False  # the cache holds shapes only (allocate_cache(deferred=True))
        self._unstorable: set[int] = set()  # ids of executables the store cannot take
        # Chosen once here, so tracing the step reads no globals or environment.
        self.attention = choose_attention(self.mesh)
        self.experts = choose_experts(self.mesh, config.enable_expert_parallel)
        self._step_fn = jax.jit(
            functools.partial(step_programs.step, self.family, self.cfg, self.attention, self.experts, self.mtp_drafts),
            donate_argnums=(1, 2),
            static_argnames=("layout",),
        )
        # Pure decode steps loop on the device: up to num_scheduler_steps tokens per row per dispatch,
        # so the host's cost of a call (launch, arguments, Python) is paid once for several tokens.
        self.num_scheduler_steps = num_scheduler_steps = config.num_scheduler_steps
        self._decode_fn = jax.jit(
            functools.partial(
                step_programs.decode_steps, self.family, self.cfg, self.attention, self.experts, self.mtp_drafts,
                block_size, num_scheduler_steps,
            ),
            donate_argnums=(1, 2),
            static_argnames=("layout",),
            compiler_options=step_programs.decode_loop_compiler_options(),
        )
        # Steps without the MTP head or the decode loop run as two programs: the forward program (one
        # per step shape) and a small sampling program (one per rows bucket and sampling variant), so
        # the variants of sampling never compile the model again.
        self._logits_sharding = NamedSharding(self.mesh, P(None, "tp") if self.cfg.vocab_size % self.tp == 0 else P())
        self._forward_fn = jax.jit(
            functools.partial(step_programs.forward_logits, self.family, self.cfg, self.attention, self.experts,
                              self._logits_sharding),
            donate_argnums=(1, 2),
            static_argnames=("layout",),
        )
        # The forward program leaves its hidden states here, so one prompt-logprobs program (of one
        # shape, PROMPT_CHUNK positions) scores the prompt positions of any step.
        self.hidden = jax.device_put(np.zeros((config.max_num_batched_tokens, self.cfg.hidden_size), self.dtype),
                                     replicated(self.mesh))
        self._prompt_fn = jax.jit(functools.partial(step_programs.score_prompt, self.family))
        # (a partial of its own: each runner traces, and counts, its programs, as for the others)
        self._sample_fn = jax.jit(functools.partial(step_programs.sample_rows), donate_argnums=(1,),
                                  static_argnames=("layout",))
        self.compilations = 0  # traces of the step's programs: bounded by the bucket sets
        self.compile_seconds = 0.0  # time spent in them: tracing, lowering, XLA or a persistent-cache load
        # Programs compiled ahead of time (`lower` + `install`), by (kind, layout): dispatch calls them.
        self._executables: dict[tuple[str, tuple], jax.stages.Compiled] = {}
        # The last token sampled for each state slot, kept on device: a plan can name it (token id -1)
        # before the host has seen it, so step N+1 is dispatched while step N still runs.
        self.sampled = jax.device_put(np.zeros(config.max_num_seqs, np.int32), replicated(self.mesh))

    def _load_params(self) -> dict:
        """The weights on `self.mesh` (a pipeline's runner loads each stage's on its own)."""
        config = self.config
        return load_params(config.model, self.cfg, self.mesh, self.dtype, config.enable_expert_parallel,
                           self.mtp_drafts > 0, config.load_format, config.quantization)

    @classmethod
    def from_args(cls, args: EngineArgs, devices=None) -> "ModelRunner":
        """A runner alone (tests, tools), its cache allocated when `args.num_blocks` is set."""
        runner = cls(EngineConfig.from_args(args), devices)
        if args.num_blocks is not None:
            runner.allocate_cache(args.num_blocks)
        return runner

    @property
    def uses_row_len_bound(self) -> bool:
        """Whether the step's program depends on its bound on tokens per row beyond "1: a pure decode
        step" (the GPU attention kernel tiles by it, DeltaNet layers chunk by it). Where it does not,
        the scheduler uses the loosest bound (the step's tokens, always valid): fewer step shapes."""
        return self.attention.impl == "kernel" or self.family.uses_row_len_bound

    @property
    def limit_long_rows(self) -> bool:
        """Whether a step with a row longer than SHORT_ROW holds at most `long_rows` rows of
        several tokens (the family's DeltaNet layout)."""
        return self.family.lays_out_long_rows_apart

    @property
    def all_devices(self) -> list:
        """Every device this runner's programs span, in the launcher's order (a group compares them)."""
        return list(self.mesh.devices.flat)

    @property
    def tp(self) -> int:
        return tp_size(self.mesh)

    def place_images(self, images, in_use) -> list[int]:
        """Encode the images the pool lacks; each image's first row in it (`ImagePool.place`)."""
        try:
            return self.images.place(images, in_use)
        finally:  # the pool the steps read: the new one, also when an encode failed half way
            self._use_image_pool()

    @property
    def embedding_mesh(self):
        """Where the embedding (and the image pool it reads) lives."""
        return self.mesh

    def _use_image_pool(self) -> None:
        """The steps read the image pool as it is now (the pool is replaced as images are placed)."""
        self.params = {**self.params, "image_pool": self.images.pool}

    def warm_images(self) -> int:
        """Compile the vision encoder's patch buckets (warm-up); how many (0: no tower)."""
        if self.images is None:
            return 0
        try:
            return self.images.warm(MAX_IMAGE_PATCHES)
        finally:
            self._use_image_pool()

    def allocate_cache(self, num_blocks: int, deferred: bool = False) -> None:
        """A pool of `num_blocks`; `deferred`: only its shapes for now (warm-up compiles against them,
        its autotuning free to use the pool's memory), allocated by `materialize_cache` or the first
        step, whichever comes first."""
        self._cache = None  # drop the old buffers before allocating the new ones
        self._executables.clear()  # compiled for the old cache's shapes
        self.num_blocks = num_blocks
        self.cache_deferred = deferred
        with shapes_only() if deferred else contextlib.nullcontext():
            self._cache = self._init_cache(num_blocks, self.num_state_slots)
        self.__dict__.pop("store", None)  # another pool: another store context

    @property
    def cache(self) -> list:
        """The KV pages and state slots, per layer (allocated now if deferred; the programs' builders
        read `_cache`, whose shapes are all lowering needs)."""
        self.materialize_cache()
        return self._cache

    @cache.setter
    def cache(self, value: list) -> None:
        self._cache = value

    def materialize_cache(self) -> None:
        """Allocate a deferred pool (zeroed) now."""
        if self.cache_deferred:
            self._cache = self._init_cache(self.num_blocks, self.num_state_slots)
            self.cache_deferred = False

    def release_cache(self) -> None:
        """Free the cache's device memory now (the memory plan's probe pool); `allocate_cache` makes another."""
        for leaf in jax.tree.leaves(self._cache):
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                leaf.delete()
        self._cache, self.num_blocks, self.cache_deferred = None, 0, False
        self.__dict__.pop("store", None)
        self._executables.clear()

    @functools.cached_property
    def store(self) -> ExecutableStore | None:
        """Where warm-up keeps the compiled programs of this runner's configuration and pool between
        starts (built on first use: a probe pool or a follower never needs it)."""
        return self._executable_store()

    def _executable_store(self) -> ExecutableStore | None:
        static = (self.family.__name__, self.cfg, self.attention, self.experts, self.mtp_drafts, self.block_size,
                  self.num_scheduler_steps, self._logits_sharding, step_programs.decode_loop_compiler_options())
        arrays = (self.params, self._cache, self.hidden, self.sampled)
        return ExecutableStore.beside_compilation_cache(self.mesh.devices.flat, static, arrays)

    def _init_cache(self, num_blocks: int, num_state_slots: int) -> list:
        """The family's cache; with the MTP head, its attention layer's K/V last (same pages and slots)."""
        cache = self.family.init_cache(self.cfg, self.mesh, num_blocks, self.block_size, num_state_slots, self.dtype,
                                       self.kv_dtype)
        if self.mtp_drafts:
            cache.append(zeroed_layer_kv(self.cfg, self.mesh, num_blocks, self.block_size, self.kv_dtype))
        return cache

    def _cache_bytes(self, num_blocks: int, num_state_slots: int) -> int:
        shapes = jax.eval_shape(lambda: self._init_cache(num_blocks, num_state_slots))
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))

    def bytes_per_block(self) -> int:
        """Device memory one more KV block costs on each device (shapes only, nothing allocated)."""
        return (self._cache_bytes(2, 1) - self._cache_bytes(1, 1)) // self.tp

    def bytes_per_state_slot(self) -> int:
        """Device memory one more recurrent-state slot costs on each device (0 without DeltaNet layers)."""
        return (self._cache_bytes(1, 2) - self._cache_bytes(1, 1)) // self.tp

    def memory_stats(self) -> dict | None:
        """Allocator stats of this process's device with the least memory free (None on CPU: none kept)."""
        try:
            stats = [d.memory_stats() for d in self.all_devices if d.process_index == jax.process_index()]
        except Exception:  # noqa: BLE001 - some backends raise instead of returning None
            return None
        if not stats or any(not s or "bytes_limit" not in s for s in stats):
            return None
        return min(stats, key=lambda s: s["bytes_limit"] - s.get("bytes_in_use", 0))

    def dispatch(self, step: PackedStep | StepInput, late: bool = False):
        """Enqueue one step (forward + sampling) and return at once with device-side results.

        Token id -1 in the plan means "the token last sampled for this row's state slot".
        Every result field has a leading axis of decode steps: [1, B] for a plain step,
        [num_scheduler_steps, B] for a pure decode step, whose rows sample `num_steps`
        tokens each (fewer if every row sampled a stop token; later entries are then zero).
        `jax.device_get` on the result waits for the device; only sampled results come back.

        `late` (a split step only): enqueue the forward program alone and return a function that
        enqueues the sampling program and returns the result; the host may change the step's
        sampling part (its token masks) meanwhile, while the device runs the forward.
        """
        self.materialize_cache()
        ints, floats, layout, targets = host_buffers(step, self.images is not None)
        self.check_long_rows(ints, layout)
        num_steps = ints[layout.offsets()[0]["num_steps"][0]]
        loops = self._loops(layout)
        if loops:
            if not 1 <= num_steps <= self.num_scheduler_steps:
                raise ValueError(f"num_steps {num_steps} is outside 1..{self.num_scheduler_steps} (--num-scheduler-steps)")
            if num_steps > 1 and layout.penalty_len:
                raise ValueError("penalties need the token history of every step: they run one step per dispatch")
        elif num_steps != 1:
            raise ValueError(f"a step with prompt rows runs one step, not {num_steps}")
        if self._splits(layout):
            logits, self.cache, self.hidden = self._run(*self._forward_program(ints, layout))
            prompt = None
            if targets is not None:  # before the next forward program overwrites the hidden states
                prompt = tuple(self._run(*self._prompt_program(targets[:, i : i + PROMPT_CHUNK]))
                               for i in range(0, targets.shape[1], PROMPT_CHUNK))

            def sample() -> SampleResult:
                result, self.sampled = self._run(*self._sampling_program(logits, ints, floats, layout))
                return result._replace(prompt=prompt)

            return sample if late else sample()
        if targets is not None:
            raise ValueError("prompt logprobs need a step of a forward and a sampling program (not the MTP head's)")
        if late:
            raise ValueError("only a step of a forward and a sampling program can sample late")
        result, self.cache, self.sampled = self._run(*self._fused_program(ints, floats, layout))
        return result

    def check_long_rows(self, ints, layout: StepLayout) -> None:
        """A step past `long_rows` (the scheduler keeps to it) fails here, before any process runs
        it, rather than computing rows the family's layout has no room for."""
        bound = min(layout.max_row_len or layout.num_tokens, layout.num_tokens)
        if not self.limit_long_rows or layout.verify_positions or bound <= SHORT_ROW:
            return
        limit = long_rows(layout.num_tokens, layout.num_rows, bound)
        offset, (rows,) = layout.offsets()[0]["row_lens"]
        several = int((ints[offset : offset + rows] > 1).sum())
        if several > limit:
            raise ValueError(f"a step of {layout.num_tokens} tokens with a row of more than {SHORT_ROW} (bound "
                             f"{bound}) holds at most {limit} rows of several tokens on this model (its DeltaNet "
                             f"layout), not {several}")

    def _run(self, key, fn, args, layout):
        """Call the program of `key`: its ahead-of-time executable, else `fn` (tracing it the first time)."""
        compiled = self._executables.get(key)
        if compiled is not None:
            return compiled(*args)
        start, before = time.perf_counter(), self.compilations
        with count_traces(self):
            out = fn(*args) if layout is None else fn(*args, layout=layout)
        if self.compilations != before:  # this call compiled (the step itself runs asynchronously)
            self.compile_seconds += time.perf_counter() - start
        return out

    def _splits(self, layout: StepLayout) -> bool:
        """Whether this step runs as a forward program and a sampling program (see __init__)."""
        return not self.mtp_drafts and not self._loops(layout)

    def _forward_program(self, ints, layout: StepLayout):
        """(key, jitted fn, arguments, static layout) of a split step's forward program."""
        forward = layout.forward
        return ("forward", forward), self._forward_fn, (self.params, self._cache, self.hidden, self.sampled,
                                                        ints[: forward.offsets()[2]]), forward

    def _prompt_program(self, targets):
        """The same for the prompt-logprobs program over one chunk of `targets` (i32[2, PROMPT_CHUNK])."""
        return ("prompt", PROMPT_CHUNK), self._prompt_fn, (self.params, self.hidden, targets), None

    def _sampling_program(self, logits, ints, floats, layout: StepLayout):
        """The same for its sampling program (`logits`: the forward program's, or their shape)."""
        return (("sample", layout.sampling), self._sample_fn,
                (logits, self.sampled, ints[layout.sampling_start():], floats), layout.sampling)

    def _fused_program(self, ints, floats, layout: StepLayout):
        """The same for a step that is one program (the decode loop's, or one with the MTP head)."""
        kind, fn = ("decode", self._decode_fn) if self._loops(layout) else ("step", self._step_fn)
        return (kind, layout), fn, (self.params, self._cache, self.sampled, ints, floats), layout

    def samples_separately(self, step: PackedStep | StepInput) -> bool:
        """Whether `step` samples in a program of its own (so its sampling variants are small programs)."""
        return self._splits(host_buffers(step, self.images is not None)[2])

    # Ahead-of-time compilation (warm-up): `lower` traces on the calling thread (Python, under the GIL);
    # `Lowered.compile()` can then run on any thread (XLA releases the GIL), and `install` hands the
    # executable to `dispatch`, so the first real step of that shape compiles nothing.

    def lower(self, step: PackedStep | StepInput, skip=frozenset(), again: bool = False) -> list:
        """[(key, `jax.stages.Lowered`)] of the programs `dispatch` would run for this step's shapes,
        but those installed already (unless `again`) or in `skip`. Nothing runs on the device."""
        ints, floats, layout, targets = host_buffers(step, self.images is not None)
        if self._splits(layout):
            positions = layout.num_rows * max(1, layout.verify_positions)
            logits = jax.ShapeDtypeStruct((positions, self.cfg.vocab_size), jnp.float32, sharding=self._logits_sharding)
            programs = [self._forward_program(ints, layout), self._sampling_program(logits, ints, floats, layout)]
            if targets is not None:
                programs.append(self._prompt_program(targets[:, :PROMPT_CHUNK]))
        else:
            programs = [self._fused_program(ints, floats, layout)]
        out = []
        for key, fn, args, static in programs:
            if key in skip or (key in self._executables and not again):
                continue
            if self.store is not None and not again and self.store.has(key):
                out.append((key, StoredProgram(self.store, key, functools.partial(self._lower, fn, args, static))))
                continue
            start = time.perf_counter()
            with count_traces(self):
                out.append((key, fn.lower(*args) if static is None else fn.lower(*args, layout=static)))
            self.compile_seconds += time.perf_counter() - start
        return out

    def _lower(self, fn, args, static) -> jax.stages.Lowered:
        with count_traces(self):
            return fn.lower(*args) if static is None else fn.lower(*args, layout=static)

    def compile_program(self, key, program) -> jax.stages.Compiled:
        """Compile one of `lower`'s programs (any thread): load a stored one, else compile it and store it."""
        if isinstance(program, StoredProgram):
            return program.compile()
        hits = thread_cache_hits()
        compiled = program.compile()
        # XLA:CPU cannot serialize again an executable it deserialized (the copy lacks its fusions' code)
        if thread_cache_hits() != hits and self.mesh.devices.flat[0].platform == "cpu":
            self._unstorable.add(id(compiled))
        self.store_program(key, compiled)
        return compiled

    def store_program(self, key, compiled: jax.stages.Compiled) -> None:
        """Keep `compiled` as the program of `key` for the next start (another key's program, where two share one)."""
        if self.store is not None and id(compiled) not in self._unstorable:
            self.store.save(key, compiled)

    placement = staticmethod(lambda key: None)  # where the program of `key` runs (here: all on one mesh)

    def install(self, key, compiled: jax.stages.Compiled, seconds: float) -> None:
        """Use `compiled` (from `lower(...)[i][1].compile()`, which took `seconds`) for programs of `key`."""
        self._executables[key] = compiled
        self.compile_seconds += seconds

    def _loops(self, layout: StepLayout) -> bool:
        """Whether this step runs through the decode loop (every pure decode step, when enabled)."""
        return self.num_scheduler_steps > 1 and layout.max_row_len == 1

    def compiled_text(self, plan: StepPlan, sampling: SamplingBatch | None = None, penalty_tokens=None) -> str:
        """The optimized HLO of the serving step's programs (what `dispatch` runs) for this plan's
        shapes, to inspect its collectives. Sampling defaults to greedy rows without logprobs."""
        if sampling is None:
            sampling = pack_sampling([], len(plan.context_lens), [], [])
        return "\n".join(lowered.compile().as_text()
                         for _, lowered in self.lower(StepInput(plan, sampling, penalty_tokens), again=True))

    # Snapshot pages (jtp/engine/snapshot_store.py): device work every process of a group runs in step order.

    def gather_pages(self, block_ids: np.ndarray, slot_ids: np.ndarray) -> dict:
        """Copies of KV blocks `block_ids` and state slots `slot_ids`, sharded like the cache."""
        return kv_cache.gather_pages(*kv_cache.cache_views(self.cache), block_ids, slot_ids)

    def write_pages(self, path: Path, arrays: dict, metadata: dict, overwrite: bool) -> None:
        """Write gathered pages with Orbax (each process its own shards; process 0 the metadata)."""
        kv_cache.write_pages(Path(path), arrays, metadata, overwrite)

    def read_pages(self, path: Path, meta: dict) -> dict:
        return kv_cache.read_pages(self.cache, Path(path), meta)

    def scatter_pages(self, block_ids, block_rows, slot_ids, slot_rows, arrays: dict) -> None:
        """Write pages[block_rows] into blocks `block_ids` and states[slot_rows] into slots `slot_ids`."""
        self.cache = kv_cache.scatter_pages(self.cache, block_ids, block_rows, arrays.get("kv", {}) if len(block_ids) else {},
                              slot_ids, slot_rows, arrays.get("state", {}) if len(slot_ids) else {})

    def close(self) -> None:
        """Free this runner's device memory (weights, KV cache, sampled tokens) now rather than
        whenever Python collects it, so another runner in the process gets it. Unusable afterwards."""
        for leaf in jax.tree.leaves((self.params, self._cache, self.sampled, self.hidden)):
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                leaf.delete()
        self.params = self._cache = self.sampled = self.hidden = None
        self._executables.clear()

def host_buffers(step: PackedStep | StepInput, multimodal: bool = False):
    """(ints, floats, layout, prompt targets or None): a step's host arrays as the two numpy buffers
    the jitted step takes. The jitted call's C++ path transfers them (replicated) far faster than one
    `jax.device_put` per array, and two far faster than two dozen."""
    if isinstance(step, StepInput):
        step = PackedStep.from_step_input(step, multimodal)
    return step.ints, step.floats, step.layout, step.prompt_targets
