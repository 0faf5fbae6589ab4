"""Multi-controller launch: who is which process, spawning local followers, and JAX's runtime.

Every process of a group controls its own devices and runs the same jitted calls over one global
mesh; XLA emits the collectives (NCCL on GPUs, gloo on CPUs) over JAX's distributed runtime.
Process 0, the leader, runs the scheduler (and the HTTP app) and decides every step; the others
follow (jtp/distributed/follower.py) over an authenticated control channel (jtp/distributed/control.py).

Three ways to form a group (`LaunchSpec.resolve`):
- local: `--num-processes N` alone. The leader spawns N-1 followers on this host, binds the JAX
  coordinator and the control channel to loopback, and hands each child a fresh secret on its
  stdin (a pipe: never in argv or the environment, which other processes of the user can read
  in /proc/PID/cmdline and /proc/PID/environ).
- across machines: `--num-processes N --process-id i --coordinator-address HOST:PORT` on every
  host, the same command. The JAX coordinator binds HOST:PORT and the control channel HOST:PORT+1
  at the leader (the address HOST resolves to, so 127.0.0.1 stays loopback); every process reads
  the shared secret from `--secret-file` (mode 0600) or JTP_LAUNCH_SECRET (hex).
- a cluster JAX detects (SLURM, Open MPI, ...): `--num-processes N` (or nothing but the secret)
  inside the job; the coordinator and process id come from the cluster's environment.

Start-up order matters: the control handshake (authentication, then a fingerprint of the model,
config, dtype and jtp version) comes before `jax.distributed.initialize`, so a process with the
wrong secret or checkpoint never joins JAX's group; a sanity all-reduce over every device follows.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

from jtp.errors import ConfigError

if TYPE_CHECKING:
    from jtp.config.engine_args import EngineArgs

log = logging.getLogger(__name__)

SECRET_ENV = "JTP_LAUNCH_SECRET"  # hex; how every process of a launch proves it belongs
LAUNCH_ENV = "JTP_LAUNCH"  # JSON: a spawned follower's LaunchSpec and engine args


@dataclasses.dataclass
class LaunchSpec:
    num_processes: int
    process_id: int
    coordinator_address: str  # host:port of JAX's coordination service (at the leader)
    control_address: str  # host:port of the leader's control channel
    secret: bytes
    spawned: bool = False  # a child of a local leader (exits with it)
    bind_loopback: bool = True

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @classmethod
    def resolve(cls, args: "EngineArgs") -> "LaunchSpec":
        """The launch these engine args describe (args.num_processes > 1 or a detected cluster)."""
        n, pid, coord = args.num_processes, args.process_id, args.coordinator_address
        if pid is None and coord is None and not _in_cluster():  # spawn the followers on this host
            host = "127.0.0.1"
            return cls(n, 0, f"{host}:{free_port(host)}", f"{host}:{free_port(host)}", os.urandom(32))
        if pid is None or coord is None or n is None:
            coord, n, pid = _detect_cluster(coord, n, pid)
        host, port = split_address(coord)
        if not 0 <= pid < n:
            raise ConfigError(f"--process-id {pid}: must be in [0, --num-processes {n})")
        return cls(n, pid, coord, f"{host}:{port + 1}", read_secret(args.secret_file), bind_loopback=False)


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"--coordinator-address {address!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def read_secret(path: str | None) -> bytes:
    """The launch secret shared by every host: --secret-file, else $JTP_LAUNCH_SECRET (hex)."""
    if path is not None:
        if Path(path).stat().st_mode & 0o077:
            log.warning("--secret-file %s is readable by other users; `chmod 600` it", path)
        data = Path(path).read_bytes().strip()
        if len(data) < 16:
            raise ConfigError(f"--secret-file {path}: the secret must be at least 16 bytes")
        return data
    text = os.environ.get(SECRET_ENV, "")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"${SECRET_ENV} must be hex (e.g. `openssl rand -hex 32`)") from None
    if len(secret) < 16:
        raise ConfigError(
            f"a launch across machines needs a shared secret of at least 16 bytes: set ${SECRET_ENV} "
            "(hex, e.g. `export JTP_LAUNCH_SECRET=$(openssl rand -hex 32)`) or --secret-file on every host"
        )
    return secret


def is_follower(args: EngineArgs) -> bool:
    """A process other than the leader (given --process-id, or the id a cluster such as SLURM gives)."""
    if not args.is_multiprocess:
        return False
    if args.process_id is None and args.coordinator_address is None:
        return (cluster_process_id() or 0) != 0
    return args.process_id not in (None, 0)


def cluster_process_id() -> int | None:
    """This process's id in a cluster JAX detects (SLURM, Open MPI, ...); None outside one."""
    if not _in_cluster():
        return None
    try:
        return _detect_cluster(None, None, None)[2]
    except ConfigError:
        return None


def _in_cluster() -> bool:
    return any(v in os.environ for v in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"))


def _detect_cluster(coord: str | None, n: int | None, pid: int | None) -> tuple[str, int, int]:
    """Fill what the cluster's environment knows (JAX's own detection: SLURM, Open MPI, ...)."""
    try:
        import inspect

        from jax._src import (
            clusters,  # the detection jax.distributed.initialize() itself runs
        )

        detect = clusters.ClusterEnv.auto_detect_unset_distributed_params
        kwargs = dict(coordinator_address=coord, num_processes=n, process_id=pid, local_device_ids=None,
                      cluster_detection_method=None, initialization_timeout=300)
        accepted = inspect.signature(detect).parameters  # its arguments vary between jax releases
        coord, n, pid, _ = detect(**{k: v for k, v in kwargs.items() if k in accepted})
    except Exception as e:  # noqa: BLE001 - reported as what is missing
        log.debug("cluster auto-detection failed: %s", e)
    if coord is None or n is None or pid is None:
        raise ConfigError(
            "a multi-process launch across machines needs --coordinator-address HOST:PORT and --process-id "
            "on every host (no cluster environment such as SLURM was detected to supply them)"
        )
    return coord, n, pid


# ----------------------------------------------------------------------------- identity


def jtp_version() -> str:
    try:
        return version("jtp")
    except PackageNotFoundError:
        return "unknown"


def fingerprint(args: "EngineArgs") -> dict:
    """What must be equal on every process for their jitted steps to be the same program."""
    from jtp.config.model_config import ModelConfig
    from jtp.loading.fingerprint import weights_identity

    model_dir = args.model_dir()
    cfg = ModelConfig.from_dir(model_dir)
    return {
        "jtp version": jtp_version(),
        "model config": json.loads(json.dumps(dataclasses.asdict(cfg))),
        "weights": weights_identity(model_dir, args.load_format),
        "dtype": args.dtype,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "num_state_slots": args.num_state_slots,
        "num_scheduler_steps": args.num_scheduler_steps,
        "enable_expert_parallel": args.enable_expert_parallel,
        "num_processes": args.num_processes,
        "digest_interval": args.digest_interval,  # the leader waits for the followers' digests
    }


def fingerprint_mismatches(leader: dict, follower: dict) -> list[str]:
    """One phrase per differing field, naming both values (config fields one by one)."""
    out = []
    for key in leader.keys() | follower.keys():
        a, b = leader.get(key), follower.get(key)
        if a == b:
            continue
        if key == "model config" and isinstance(a, dict) and isinstance(b, dict):
            fields = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            out += [f"model config {k}: leader {a.get(k)!r}, follower {b.get(k)!r}" for k in fields[:4]]
        elif key == "weights":
            out.append(f"weights: leader {str(a)[:12]}, follower {str(b)[:12]} (another checkpoint)")
        else:
            out.append(f"{key}: leader {a!r}, follower {b!r}")
    return sorted(out)


# ----------------------------------------------------------------------------- JAX's runtime


def init_distributed(spec: LaunchSpec, devices_per_process: int, heartbeat_timeout: float) -> None:
    """Join JAX's distributed runtime. Recoverability on: a follower's death fails the collectives
    that need it instead of terminating the leader (which then tears the group down itself)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.config.update("jax_enable_recoverability", True)
    except AttributeError:  # older jax: a dead follower ends the group after JAX's own heartbeat timeout
        pass
    first = spec.process_id * devices_per_process
    jax.distributed.initialize(
        spec.coordinator_address, spec.num_processes, spec.process_id,
        # GPUs: each local process takes its own slice; CPUs ignore it (their count is XLA_FLAGS').
        local_device_ids=list(range(first, first + devices_per_process)) if spec.bind_loopback else None,
        # JAX's default binds every interface, whatever address it was given.
        coordinator_bind_address=coordinator_bind_address(spec.coordinator_address) if spec.is_leader else None,
        # Ours detects a dead follower first; JAX's is the backstop.
        heartbeat_timeout_seconds=int(max(100, 4 * heartbeat_timeout)),
    )


def coordinator_bind_address(address: str) -> str:
    """Where the leader's JAX coordinator listens: the address HOST resolves to, as the control
    channel binds it (so `127.0.0.1:7000` stays loopback and a host name binds its interface)."""
    host, port = split_address(address)
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        raise ConfigError(f"--coordinator-address {address}: cannot resolve {host!r}: {e.strerror or e}") from None
    ip = sockaddr[0]
    return f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"


def join_group(spec: LaunchSpec, devices_per_process: int, heartbeat_timeout: float) -> list:
    """Join JAX's runtime and check every device answers (leader and followers alike, in this
    order); returns the mesh's devices."""
    init_distributed(spec, devices_per_process, heartbeat_timeout)
    devices = mesh_devices(spec.num_processes, devices_per_process)
    sanity_check(devices)
    return devices


def mesh_devices(num_processes: int, devices_per_process: int) -> list:
    """The mesh's devices: the first `devices_per_process` of each process, in process order."""
    import jax

    counts = [sum(d.process_index == p for d in jax.devices()) for p in range(num_processes)]
    if len(set(counts)) > 1:  # JAX moves host data to a group's devices assuming equal counts
        raise ConfigError(
            "every process needs the same number of devices, but " + ", ".join(
                f"process {p} has {n}" for p, n in enumerate(counts)) + " devices; on a CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={devices_per_process} (the mesh's devices per process)"
        )
    out = []
    for p in range(num_processes):
        mine = sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
        if len(mine) < devices_per_process:
            raise ConfigError(
                f"process {p} has {len(mine)} device(s) but the mesh needs {devices_per_process} from each of "
                f"{num_processes} processes (--tensor-parallel-size x --pipeline-parallel-size / --num-processes)"
            )
        out += mine[:devices_per_process]
    return out


def sanity_check(devices: list) -> None:
    """Every device contributes 1 to one all-reduce; the sum must be the device count."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(devices), ("all",), axis_types=(jax.sharding.AxisType.Auto,))
    ones = jax.make_array_from_callback((len(devices),), NamedSharding(mesh, P("all")),
                                        lambda idx: np.ones(len(devices), np.int32)[idx])
    total = int(jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, P()))(ones))
    if total != len(devices):
        raise RuntimeError(f"start-up sanity all-reduce over {len(devices)} devices gave {total}")


def describe_mesh(devices: list) -> dict:
    return {
        "platform": devices[0].platform,
        "devices": [[d.process_index, d.id] for d in devices],
    }


# ----------------------------------------------------------------------------- local followers


# Secrets a follower does not need; its environment is readable in /proc/PID/environ for its life.
_NOT_INHERITED = (SECRET_ENV, "JTP_API_KEY")


def spawn_followers(spec: LaunchSpec, args: "EngineArgs", devices_per_process: int) -> list[subprocess.Popen]:
    """Start followers 1..N-1 on this host (`python -m jtp.entrypoints.follower`), each told its place
    through its environment and the secret on its stdin; their output goes to ours."""
    procs = []
    engine_args = dataclasses.asdict(args)
    engine_args["model"] = args.model_dir()
    for pid in range(1, spec.num_processes):
        child = dataclasses.replace(spec, process_id=pid, spawned=True)
        env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
        env[LAUNCH_ENV] = json.dumps({
            "spec": {k: v for k, v in dataclasses.asdict(child).items() if k != "secret"},
            "engine_args": engine_args,
            "parent_pid": os.getpid(),
        })
        env["XLA_FLAGS"] = _with_cpu_devices(env.get("XLA_FLAGS", ""), devices_per_process)
        proc = subprocess.Popen([sys.executable, "-m", "jtp.entrypoints.follower"], env=env, stdin=subprocess.PIPE)
        procs.append(proc)
        _hand_over_secret(proc, spec.secret)
        log.info("spawned follower %d (pid %d)", pid, proc.pid)
    return procs


def _hand_over_secret(proc: subprocess.Popen, secret: bytes) -> None:
    """One line on the child's stdin, then EOF (a pipe buffer holds it: this never blocks)."""
    try:
        proc.stdin.write(secret.hex().encode() + b"\n")
        proc.stdin.close()
    except BrokenPipeError:  # the child died at once; start-up reports how it ended
        pass


def receive_secret(stream) -> bytes:
    """A spawned follower's side of `_hand_over_secret`."""
    return bytes.fromhex(stream.readline().decode().strip())


def _with_cpu_devices(flags: str, n: int) -> str:
    kept = [f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join(kept + [f"--xla_force_host_platform_device_count={n}"])


def exit_with_parent(parent_pid: int) -> None:
    """Linux: get SIGKILL when the parent dies (even by kill -9), so a follower is never orphaned."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the control channel's EOF still ends the follower
        pass
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)


def describe_exit(proc: subprocess.Popen) -> str:
    """How a child ended: "killed by SIGKILL", "exited with status 2" (or "still running")."""
    code = proc.poll()
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def reap(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    """Wait for children to exit (up to `grace` seconds in all; 0 kills at once), then SIGKILL and
    wait for the rest."""
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            log.error("follower %d did not exit after SIGKILL", proc.pid)
