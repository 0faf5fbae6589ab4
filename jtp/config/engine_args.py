"""EngineArgs: the one description of an engine that every surface builds from.

The CLI (`jtp serve|generate|batch`), the HTTP server, the offline batch script and the
notebook all make an `EngineArgs` and build the engine with `Engine.from_args`, so a setting means
the same thing everywhere. Field names follow vLLM's EngineArgs / command-line flags.

    from jtp import Engine, EngineArgs
    engine = Engine.from_args(EngineArgs(model="path/to/Qwen3-8B", tensor_parallel_size=2))
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from jtp.config.device_defaults import HOST, BatchDefaults
from jtp.config.generation_config import GENERATION_CONFIG_MODES
from jtp.config.hub import looks_like_repo_id, resolve_model
from jtp.config.speculative import SpeculativeConfig
from jtp.errors import ConfigError

QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names: the model's dtype, or float8 e4m3 pages (scale 1)  # vLLM's --quantization: fp8 quantizes a full-precision model's linear weights at load
LOAD_FORMATS = ("auto", "dummy")  # vLLM's names: read the checkpoint, or random weights (jtp/loading/dummy_weights.py)

DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_state_slots(max_num_seqs: int, num_state_slots: int | None = None) -> int:
    """Recurrent-state slots: as asked, else 2 x max_num_seqs + 8 (each running request's slot,
    plus as many again for checkpoints and a few for snapshots)."""
    return num_state_slots or 2 * max_num_seqs + 8


@dataclasses.dataclass
class EngineArgs:
    model: str | None = None  # HF (or `jtp convert`) model directory or HF repo id; None = the embedded demo
    revision: str | None = None  # with a repo id: the branch, tag or commit (default: main)
    served_model_name: str | None = None  # the name clients use; default: the directory's name
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # engine replicas in this process, each on its own tensor_parallel_size devices
    pipeline_parallel_size: int = 1  # stages of contiguous layers, each on its own tensor_parallel_size devices
    dtype: str = "auto"
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int | None = None  # None: sized for the device (jtp/config/device_defaults.py)
    max_num_batched_tokens: int | None = None  # None: likewise
    block_size: int = 16
    num_blocks: int | None = None  # KV blocks; None = sized from device memory
    max_waiting_requests: int = 1024  # submit past this raises QueueFullError (HTTP 429)
    seed: int | None = None  # seeds requests that bring none, so a whole run is reproducible
    warmup: bool = True  # compile the step shapes before the engine reports ready
    enable_prefix_caching: bool = True  # reuse the KV (and recurrent state) of earlier prompts' prefixes
    num_state_slots: int | None = None  # hybrid models: recurrent-state slots (None = 2 x max_num_seqs + 8)
    max_snapshots: int = 64  # explicit snapshots kept (LRU beyond it)
    snapshot_budget_bytes: int | None = None  # device bytes snapshots may pin (None = half the KV pool)
    num_scheduler_steps: int = 1  # decode steps one dispatch may run on the device (multi-step decode)
    enable_expert_parallel: bool = False  # MoE: whole experts per device instead of a slice of each
    load_format: str = "auto"  # "dummy": random weights from config.json alone (benchmarks)
    kv_cache_dtype: str = "auto"  # "fp8": K/V pages stored as float8 e4m3 (twice the tokens in the pool)
    quantization: str | None = None  # "fp8": linear weights quantized to FP8 at load (jtp/loading/quantized.py)
    speculative_config: str | dict | None = None  # JSON, as vLLM spells it: '{"method": "ngram", "num_speculative_tokens": 4}'
    skip_tokenizer_init: bool = False  # no tokenizer: token ids in and out, no text or stop strings
    # Sampling defaults for fields a request leaves unset: "auto" (the checkpoint's generation_config.json),
    # "vllm" (SamplingParams' own) or a directory holding a generation_config.json.
    generation_config: str = "auto"
    # vLLM's JSON '{"image": 4}': most images one prompt may hold (None: no limit); jtp takes no videos.
    limit_mm_per_prompt: str | dict | None = None
    # Multi-process groups (jtp/distributed/launcher.py): one JAX process per host or device group.
    num_processes: int = 1
    process_id: int | None = None  # None: spawn the followers on this host (or ask the cluster)
    coordinator_address: str | None = None  # HOST:PORT of the leader's JAX coordinator (across machines)
    secret_file: str | None = None  # the launch secret across machines (else $JTP_LAUNCH_SECRET)
    heartbeat_timeout: float = 10.0  # seconds without a follower heartbeat before the group is failed
    step_timeout: float = 300.0  # seconds one dispatched step may take (compilation included)
    digest_interval: int = 64  # compare a digest of the sampled tokens every N steps (0: never)

    @property
    def is_multiprocess(self) -> bool:
        return self.num_processes > 1

    @property
    def group_devices(self) -> int:
        """Devices one engine's worker group spans: a tensor-parallel group per pipeline stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def devices_per_process(self) -> int:
        return self.group_devices // self.num_processes

    def with_batch_defaults(self, defaults: "BatchDefaults") -> "EngineArgs":
        """These args with the batch sizes they leave out taken from `defaults` (the device's:
        jtp/worker/devices.py `with_device_defaults`)."""
        seqs, tokens = self.max_num_seqs, self.max_num_batched_tokens
        if seqs is None:  # room for prefill beside a full decode batch, as validate() asks
            seqs = defaults.max_num_seqs if tokens is None else max(1, min(defaults.max_num_seqs, tokens // 2))
        if tokens is None:
            tokens = max(defaults.max_num_batched_tokens, 2 * seqs)
        return dataclasses.replace(self, max_num_seqs=seqs, max_num_batched_tokens=tokens)

    def validate(self) -> None:
        """Raise ConfigError naming the first setting that cannot work (the batch sizes resolved:
        `with_device_defaults`)."""

        def need(ok: bool, flag: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"--{flag.replace('_', '-')} {getattr(self, flag)!r}: {why}")

        need(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be at least 1")
        need(self.data_parallel_size >= 1, "data_parallel_size", "must be at least 1")
        need(self.data_parallel_size == 1 or self.num_processes == 1, "data_parallel_size",
             f"cannot be combined with --num-processes {self.num_processes} yet (replicas share one process)")
        need(self.pipeline_parallel_size >= 1, "pipeline_parallel_size", "must be at least 1")
        if self.pipeline_parallel_size > 1:
            pp = "cannot be combined with {} yet"
            need(self.num_scheduler_steps == 1, "pipeline_parallel_size",
                 pp.format("--num-scheduler-steps > 1 (a stage cannot loop decode steps on its own)"))
            need(self.speculative_config is None, "pipeline_parallel_size", pp.format("--speculative-config"))
        need(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}")
        need(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be at least 1")
        need(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]")
        need(self.max_num_seqs is None or self.max_num_seqs >= 1, "max_num_seqs", "must be at least 1")
        need(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 2, "max_num_batched_tokens",
             "must be at least 2")
        need(
            None in (self.max_num_seqs, self.max_num_batched_tokens) or self.max_num_batched_tokens > self.max_num_seqs,
            "max_num_batched_tokens",
            f"must exceed --max-num-seqs ({self.max_num_seqs}) so prefill always gets tokens beside a full decode batch",
        )
        need(self.block_size >= 1, "block_size", "must be at least 1")
        need(self.num_blocks is None or self.num_blocks >= 1, "num_blocks", "must be at least 1 (omit it to size the pool from memory)")
        need(self.max_waiting_requests >= 1, "max_waiting_requests", "must be at least 1")
        need(
            self.num_state_slots is None or self.max_num_seqs is None or self.num_state_slots > self.max_num_seqs,
            "num_state_slots",
            f"must exceed --max-num-seqs ({self.max_num_seqs}): every running request needs a slot, and checkpoints more",
        )
        need(self.max_snapshots >= 0, "max_snapshots", "must be at least 0")
        need(self.snapshot_budget_bytes is None or self.snapshot_budget_bytes >= 0, "snapshot_budget_bytes",
             "must be at least 0")
        need(1 <= self.num_scheduler_steps <= 64, "num_scheduler_steps", "must be in 1..64")
        SpeculativeConfig.parse(self.speculative_config)  # raises ConfigError naming the bad key or value
        need(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        need(self.quantization in (None, *QUANTIZATIONS), "quantization", f"must be one of {', '.join(QUANTIZATIONS)}")
        need(self.generation_config in GENERATION_CONFIG_MODES or Path(self.generation_config).is_dir(),
             "generation_config", "must be auto, vllm or a directory holding a generation_config.json")
        self.max_images_per_prompt()  # raises ConfigError naming the flag
        need(self.num_processes >= 1, "num_processes", "must be at least 1")
        need(
            self.group_devices % self.num_processes == 0,
            "num_processes",
            f"must divide --tensor-parallel-size x --pipeline-parallel-size ({self.group_devices}): each process "
            "holds as many devices",
        )
        need(self.process_id is None or 0 <= self.process_id < self.num_processes, "process_id",
             f"must be in [0, --num-processes {self.num_processes})")
        need(self.process_id is None or self.coordinator_address is not None or self.num_processes == 1,
             "process_id", "needs --coordinator-address HOST:PORT (the leader's) on every host")
        need(self.heartbeat_timeout > 0, "heartbeat_timeout", "must be positive")
        need(self.step_timeout > 0, "step_timeout", "must be positive")
        need(self.digest_interval >= 0, "digest_interval", "must be at least 0")
        if self.model is None:
            need(self.revision is None, "revision", "applies to --model ORG/NAME (a Hugging Face repo id)")
        elif not Path(self.model).is_dir() and not looks_like_repo_id(self.model):
            raise ConfigError(f"--model {self.model}: no such directory")

    def max_images_per_prompt(self) -> int | None:
        """--limit-mm-per-prompt's image count (None: no limit)."""
        value = self.limit_mm_per_prompt
        if value is None:
            return None
        flag = f"--limit-mm-per-prompt {value!r}"
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ConfigError(f"{flag}: not JSON ({e}); e.g. '{{\"image\": 4}}'") from None
        if not isinstance(value, dict) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value.values()):
            raise ConfigError(f"{flag}: must be a JSON object of counts, e.g. '{{\"image\": 4}}'")
        other = [k for k, n in value.items() if k != "image" and n]
        if other:
            raise ConfigError(f"{flag}: jtp takes images only, not {', '.join(other)}")
        return value.get("image")

    def model_dir(self) -> str:
        """The model directory: `model` itself, a repo id's snapshot in the HF cache (fetched on first
        use, as vLLM does), or the demo checkpoint (built on first use) when `model` is None."""
        if self.model is None:
            from jtp.demo import ensure_demo_checkpoint

            return str(ensure_demo_checkpoint())
        return resolve_model(self.model, self.revision)

    @property
    def is_demo(self) -> bool:
        return self.model is None

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return "jtp-demo"
        return Path(self.model).resolve().name if Path(self.model).is_dir() else self.model  # a repo id as given

    def validate_model(self) -> None:
        """The checks that need the model's config.json (read only, nothing loaded)."""
        from jtp.config.model_config import ModelConfig

        model = ModelConfig.from_dir(self.model_dir())
        limit = model.max_position_embeddings
        if self.max_model_len is not None and self.max_model_len > limit:
            raise ConfigError(
                f"--max-model-len {self.max_model_len}: exceeds the model's max_position_embeddings ({limit})"
            )
        # --quantization fp8 quantizes full-precision weights: on weights quantized otherwise it would
        # do nothing, silently (vLLM refuses the contradiction too).
        stored = model.quantization.method if model.quantization else None
        if self.quantization is not None and stored not in (None, self.quantization):
            raise ConfigError(f"--quantization {self.quantization}: the checkpoint is already quantized ({stored}, "
                              "its config.json's quantization_config); serve it without --quantization")

    # ------------------------------------------------------------------ command line

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser, serving: bool = True) -> None:
        """The engine flags; `serving=False` leaves out those only a server uses (name, queue, warm-up)."""
        d = EngineArgs()
        p.add_argument("--model", help="Hugging Face model directory, or a repo id such as Qwen/Qwen3-0.6B resolved "
                                       "into the HF cache (HF_HUB_OFFLINE=1: the cache only); default: the embedded "
                                       "demo checkpoint")
        p.add_argument("--revision", default=None, help="with a repo id: its branch, tag or commit (default: main)")
        if serving:
            p.add_argument("--served-model-name", help="model name reported to API clients (default: the directory's name)")
        p.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                       help="devices to shard the weights over (tensor parallelism)")
        p.add_argument("--data-parallel-size", "-dp", type=int, default=d.data_parallel_size,
                       help="engine replicas, each on its own --tensor-parallel-size devices (data-parallel-size x "
                            "tensor-parallel-size devices in all), behind one endpoint: requests go to the replica "
                            "holding their prefix, else to the least loaded")
        p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=d.pipeline_parallel_size,
                       help="split the layers into this many stages, each on its own --tensor-parallel-size "
                            "devices; steps of disjoint requests keep every stage busy")
        p.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="weight/activation dtype (auto: the checkpoint's)")
        p.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + completion in tokens (default: the model's max_position_embeddings)")
        p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                       help="fraction of device memory jtp may use, weights included, when sizing the KV pool")
        p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                       help="most requests decoded in one step (default: by device: 256 on GPUs of 70 GiB or "
                            "more, 128 on smaller GPUs, 32 on CPUs)")
        p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                       help="most tokens (decode + prefill chunks) in one step (default: by device: 8192 on GPUs "
                            "of 70 GiB or more, 2048 on smaller GPUs, 512 on CPUs)")
        p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV page")
        p.add_argument("--num-blocks", type=int, default=None, help="KV pages (default: sized from device memory)")
        p.add_argument("--seed", type=int, default=None, help="seed for requests that bring none (reproducible runs)")
        p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
                       help="reuse cached KV blocks (and recurrent-state checkpoints) of earlier prompts' prefixes")
        p.add_argument("--num-state-slots", type=int, default=None,
                       help="hybrid models: recurrent-state slots, running requests' plus cached checkpoints "
                            "(default: 2 x max-num-seqs + 8)")
        p.add_argument("--max-snapshots", type=int, default=d.max_snapshots,
                       help="explicit KV snapshots kept (least recently used evicted beyond it)")
        p.add_argument("--num-scheduler-steps", type=int, default=d.num_scheduler_steps,
                       help="decode steps one dispatch runs on the device (one CUDA graph) when every row decodes, "
                            "so the host's cost per call is paid once for up to this many tokens: 8 for small "
                            "models and few concurrent requests, where the host bounds the step (1: one step per "
                            "call; docs/bench/h200-speed5.md)")
        p.add_argument("--speculative-config", default=d.speculative_config, metavar="JSON",
                       help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                            '"prompt_lookup_max": 3}\' (prompt-lookup drafts verified in one step) or '
                            '\'{"method": "mtp"}\' (the checkpoint\'s MTP head drafts; Qwen3.5 / Qwen3-Next); the '
                            'engine then runs each step to its end before the next')
        p.add_argument("--enable-expert-parallel", action="store_true", default=d.enable_expert_parallel,
                       help="MoE models: split the routed experts whole over the tensor-parallel devices (expert "
                            "parallelism) instead of splitting each expert's intermediate dim "
                            "(docs/architecture.md: which wins where)")
        p.add_argument("--generation-config", default=d.generation_config, metavar="auto|vllm|DIR",
                       help="sampling defaults for the fields a request leaves unset: auto (default): the "
                            "checkpoint's generation_config.json (temperature, top_p, top_k, min_p, "
                            "repetition_penalty, max_new_tokens), as vLLM; vllm: none (temperature 1); DIR: "
                            "that directory's generation_config.json")
        p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                       help="auto: K/V pages in the model's dtype; fp8 (fp8_e4m3): float8 e4m3 pages with scale 1, "
                            "as vLLM without calibrated scales: twice the tokens in the pool, values past +-448 clipped")
        p.add_argument("--quantization", "-q", choices=QUANTIZATIONS, default=d.quantization,
                       help="fp8: quantize the linear weights of a full-precision checkpoint to FP8 at load (e4m3, one "
                            "scale per output channel; products of 5 or more rows W8A8, x quantized per token; "
                            "expert stacks in 128 x 128 blocks); FP8 checkpoints need no flag")
        p.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                       help='most images one prompt may hold, as vLLM spells it: \'{"image": 4}\' (default: no limit; '
                            'models with a vision tower only)')
        p.add_argument("--load-format", choices=LOAD_FORMATS, default=d.load_format,
                       help="auto: read the checkpoint's weights; dummy: random weights at the model's shapes from "
                            "config.json alone, drawn on the devices (benchmarks of models not on disk)")
        g = p.add_argument_group("multi-process (one JAX process per host or device group; see the README)")
        g.add_argument("--num-processes", type=int, default=d.num_processes,
                       help="processes in the group; alone, the leader spawns the others on this host")
        g.add_argument("--process-id", type=int, default=None,
                       help="this process's rank across machines (0 = the leader; others follow it)")
        g.add_argument("--coordinator-address", default=None,
                       help="HOST:PORT of the leader's JAX coordinator across machines; the leader binds the "
                            "address HOST resolves to (127.0.0.1 stays loopback) and the control channel PORT+1")
        g.add_argument("--secret-file", default=None,
                       help="file (chmod 600) holding the launch secret shared by every host across machines; "
                            "preferred: it stays out of ps and /proc/PID/environ (default: $JTP_LAUNCH_SECRET, hex, "
                            "readable in /proc/PID/environ by your other processes). A local launch needs neither")
        g.add_argument("--heartbeat-timeout", type=float, default=d.heartbeat_timeout,
                       help="seconds without a follower heartbeat before the group is restarted")
        g.add_argument("--step-timeout", type=float, default=d.step_timeout,
                       help="seconds one step may take (first-use compilation included) before the group is restarted")
        g.add_argument("--digest-interval", type=int, default=d.digest_interval,
                       help="compare a digest of every process's sampled tokens every N steps (0: never)")
        if serving:
            p.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests,
                           help="queued requests beyond which new ones are refused (HTTP 429)")
            p.add_argument("--no-warmup", dest="warmup", action="store_false",
                           help="skip compiling the step shapes at start-up (the first requests compile them)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
