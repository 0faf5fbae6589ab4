"""EngineConfig: `EngineArgs` resolved once, the one value every layer below the CLI reads.

    config = EngineConfig.from_args(EngineArgs(model="path/to/Qwen3-8B", tensor_parallel_size=2))
    engine = Engine(config)               # builds ModelRunner(config, devices), the pools, the scheduler
    runner = ModelRunner(config)          # the same value on a follower (jtp/distributed/follower.py)

The field names are EngineArgs' (vLLM's), so a setting keeps its name from the command line to the
runner. Resolution happens here and nowhere else: the model directory (the demo checkpoint built on
first use), the checkpoint's dtype for "auto", max_model_len capped by the model, the recurrent-state
slots, the parsed speculative config, the checkpoint's `ModelConfig` and sampling defaults. What only
the loaded model can tell (the KV pool size from device memory, the snapshot byte budget) is left None and sized by the
engine once the weights are on the devices.
"""

from __future__ import annotations

import dataclasses

from jtp.config.device_defaults import HOST
from jtp.config.engine_args import EngineArgs, resolve_state_slots
from jtp.config.generation_config import sampling_defaults
from jtp.config.model_config import ModelConfig
from jtp.config.speculative import SpeculativeConfig


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str  # the model directory (resolved: the demo checkpoint when EngineArgs.model is None)
    served_model_name: str
    model_config: ModelConfig
    tensor_parallel_size: int
    pipeline_parallel_size: int
    dtype: str  # a name from DTYPES, never "auto" (the checkpoint's declared dtype then)
    max_model_len: int  # never past the model's max_position_embeddings
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_blocks: int | None  # None: the engine sizes the pool from device memory
    max_waiting_requests: int | None
    seed: int | None
    warmup: bool
    enable_prefix_caching: bool
    num_state_slots: int
    max_snapshots: int
    snapshot_budget_bytes: int | None  # None: half the KV pool's bytes
    num_scheduler_steps: int
    enable_expert_parallel: bool
    load_format: str
    kv_cache_dtype: str  # "auto" or "fp8" / "fp8_e4m3"
    quantization: str | None  # "fp8": quantize at load (an FP8 checkpoint's own format is in model_config)
    speculative_config: SpeculativeConfig | None
    skip_tokenizer_init: bool
    sampling_defaults: dict  # SamplingParams fields for what a request leaves unset (--generation-config)
    # Multi-process groups: the args themselves cross to the followers, which resolve them here too.
    args: EngineArgs = dataclasses.field(repr=False, compare=False)

    @classmethod
    def from_args(cls, args: EngineArgs) -> "EngineConfig":
        """Validate `args` (ConfigError naming the first bad setting) and resolve them."""
        args = args.with_batch_defaults(HOST)  # a no-op where the engine asked the device first (Engine.from_args)
        args.validate()
        args.validate_model()
        model_dir = args.model_dir()
        model_config = ModelConfig.from_dir(model_dir)
        limit = model_config.max_position_embeddings
        return cls(
            model=str(model_dir),
            served_model_name=args.model_name(),
            model_config=model_config,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            dtype=model_config.dtype if args.dtype == "auto" else args.dtype,
            max_model_len=min(args.max_model_len or limit, limit),
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_waiting_requests=args.max_waiting_requests,
            seed=args.seed,
            warmup=args.warmup,
            enable_prefix_caching=args.enable_prefix_caching,
            num_state_slots=resolve_state_slots(args.max_num_seqs, args.num_state_slots),
            max_snapshots=args.max_snapshots,
            snapshot_budget_bytes=args.snapshot_budget_bytes,
            num_scheduler_steps=args.num_scheduler_steps,
            enable_expert_parallel=args.enable_expert_parallel,
            load_format=args.load_format,
            kv_cache_dtype=args.kv_cache_dtype,
            quantization=args.quantization,
            speculative_config=SpeculativeConfig.parse(args.speculative_config),
            skip_tokenizer_init=args.skip_tokenizer_init,
            sampling_defaults=sampling_defaults(model_dir, args.generation_config),
            args=args,
        )

    @property
    def num_processes(self) -> int:
        return self.args.num_processes

    @property
    def is_multiprocess(self) -> bool:
        return self.args.is_multiprocess

    @property
    def mtp_drafts(self) -> int:
        """Drafts the MTP head makes per row and step (0 without MTP speculation): the runner loads the head when > 0."""
        return self.speculative_config.mtp_drafts if self.speculative_config else 0
