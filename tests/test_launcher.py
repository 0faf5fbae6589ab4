"""Multi-process groups with real OS processes on CPU (gloo): 2 processes x 2 forced devices run
one tp=4 mesh, the leader deciding every step and the follower executing it.

- the control channel: authentication, tampering, refusal messages, read deadlines (sockets, no jax);
- admission: idle, trickling, half-handshaken and flooding connections neither delay a follower
  nor outlive their deadline, and leave no thread or descriptor behind; a spawned follower's
  secret is in neither its /proc environ nor cmdline; a multi-host coordinator binds loopback
  when given 127.0.0.1;
- lockstep parity: a staggered batch through the engine's real step gives the same greedy tokens
  on 2 processes x 2 devices (tp=4) as on one process at tp=4 and at tp=1, Qwen3 and a hybrid;
- failure: kill -9 and SIGSTOP of a follower mid-generation give the caller a 503 with Retry-After
  within the heartbeat deadline, the group restarts and serves the next request; kill -9 of the
  leader ends its followers; SIGTERM drains; the process table holds nothing left behind; a
  follower killed during `jtp batch` (the caller steps) ends it with one line, its rows kept;
- start-up refusals across "machines" (a manual launch on loopback): a follower with another
  config or checkpoint, or the wrong secret, is refused with a message that says which; the right
  one joins while squatters hold the control port, and the group answers one process's text.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from jtp.distributed.control import (
    MAGIC,
    AuthenticationError,
    ChannelError,
    Kind,
    accept_handshake,
    connect_handshake,
)
from jtp.distributed.launcher import fingerprint_mismatches

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
from cpu_env import cpu_env  # noqa: E402
from loopback import closed_by_peer, open_fds  # noqa: E402
from staggered import ENGINE_ARGS, run_staggered, snapshot_roundtrip  # noqa: E402

SECRET = bytes(range(32))


def group_env(devices: int, **extra) -> dict:
    env = cpu_env(devices)
    env.pop("JTP_LAUNCH_SECRET", None)
    env.update(extra)
    return env


# ----------------------------------------------------------------------------- control channel


def handshake(server_secret: bytes, client_secret: bytes):
    a, b = socket.socketpair()
    out: dict = {}

    def serve():
        try:
            out["server"] = accept_handshake(a, server_secret)
        except Exception as e:  # noqa: BLE001 - inspected below
            out["server"] = e

    t = threading.Thread(target=serve)
    t.start()
    try:
        client = connect_handshake(b, client_secret)
    except Exception as e:  # noqa: BLE001
        client = e
    t.join(10)
    return out["server"], client


def captured_frame(channel, kind: Kind, payload: bytes = b"") -> bytearray:
    """The bytes `channel.send` would put on the wire (sent nowhere)."""

    class Recorder:
        frame = bytearray()

        def sendall(self, data):
            self.frame.extend(data)

    real, channel.sock = channel.sock, Recorder()
    try:
        channel.send(kind, payload)
        return channel.sock.frame
    finally:
        channel.sock = real


def test_channel_carries_frames_both_ways_and_rejects_tampering():
    server, client = handshake(SECRET, SECRET)
    big = os.urandom(300_000)
    client.send(Kind.HELLO, b'{"x": 1}')
    sender = threading.Thread(target=server.send, args=(Kind.STEP, big))  # larger than the socket buffer
    sender.start()
    assert server.recv() == (Kind.HELLO, b'{"x": 1}')
    assert client.recv() == (Kind.STEP, big)
    sender.join(10)
    # A frame whose payload is altered in flight fails its tag.
    frame = captured_frame(server, Kind.STEP, b"abcdef")
    frame[-1] ^= 1
    server.sock.sendall(bytes(frame))
    with pytest.raises(AuthenticationError, match="failed authentication"):
        client.recv()
    # A replayed frame (an old sequence number) fails too.
    server2, client2 = handshake(SECRET, SECRET)
    frame = captured_frame(server2, Kind.HEARTBEAT)
    server2.sock.sendall(bytes(frame))
    server2.sock.sendall(bytes(frame))
    assert client2.recv() == (Kind.HEARTBEAT, b"")
    with pytest.raises(AuthenticationError):
        client2.recv()
    server2.close()
    with pytest.raises(ChannelError, match="closed"):
        client2.recv()


def test_wrong_secret_is_refused_and_both_sides_say_so():
    server, client = handshake(SECRET, b"another secret of 32 bytes......")
    assert isinstance(server, AuthenticationError) and "wrong launch secret" in str(server)
    assert isinstance(client, AuthenticationError) and "wrong launch secret" in str(client)


def test_fingerprint_mismatches_name_each_field():
    leader = {"jtp version": "1", "dtype": "auto", "model config": {"hidden_size": 64, "num_layers": 2},
              "weights": "a" * 32, "max_num_seqs": 8}
    follower = {**leader, "dtype": "float32", "model config": {"hidden_size": 32, "num_layers": 2},
                "weights": "b" * 32}
    assert fingerprint_mismatches(leader, leader) == []
    assert fingerprint_mismatches(leader, follower) == [
        "dtype: leader 'auto', follower 'float32'",
        "model config hidden_size: leader 64, follower 32",
        "weights: leader aaaaaaaaaaaa, follower bbbbbbbbbbbb (another checkpoint)",
    ]


# ----------------------------------------------------------------------------- admission


def greeted(port: int) -> socket.socket:
    """A connection to the control port that has read the server's greeting and sends nothing."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    assert len(_recv_exactly(sock, len(MAGIC) + 32)) == len(MAGIC) + 32
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n and (chunk := sock.recv(n - len(data))):
        data += chunk
    return data


def join_as_follower(port: int, secret: bytes = SECRET):
    channel = connect_handshake(socket.create_connection(("127.0.0.1", port), timeout=5), secret, timeout=5)
    channel.send(Kind.HELLO, b'{"process_id": 1}')
    return channel


def test_idle_slow_and_half_finished_connections_neither_delay_a_follower_nor_outlive_their_deadline():
    """Serially, each of these would hold admission for its whole deadline (or forever)."""
    from jtp.distributed.admission import Admission

    fds, threads = open_fds(), threading.active_count()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    admission = Admission(listener, SECRET, handshake_timeout=6.0).start()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]  # connect, say nothing
    half = greeted(port)
    half.sendall(MAGIC + b"x" * 10)  # a third of its answer, then a stall
    trickle = greeted(port)  # one byte at a time: each read is quick, the whole never comes

    def drip():
        for _ in range(50):  # 10 s: past the deadline
            try:
                trickle.send(b"x")
            except OSError:
                return
            time.sleep(0.2)

    dripper = threading.Thread(target=drip)
    dripper.start()
    t = time.monotonic()
    follower = join_as_follower(port)
    arrival = admission.next(timeout=5)
    assert arrival is not None and arrival.hello == {"process_id": 1}
    # Serial admission would wait out at least one stalled peer's 6 s deadline first; a busy CI
    # machine gets 4 s for a concurrent one.
    assert time.monotonic() - t < 4.0
    # Each stalled connection is hung up at its deadline (6 s from connecting), the trickle too.
    for sock in [*idle, half, trickle]:
        assert closed_by_peer(sock, 8.0)
    dripper.join(12)
    assert admission.pending() == 0
    admission.close()
    for sock in [*idle, half, trickle, listener]:
        sock.close()
    arrival.channel.close()
    follower.close()
    wait_until(lambda: threading.active_count() <= threads, 5, "the handshake threads to end")
    assert open_fds() == fds


def test_a_flood_of_connections_drops_the_oldest_and_a_follower_still_joins():
    from jtp.distributed.admission import Admission

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    admission = Admission(listener, SECRET, handshake_timeout=30.0, max_pending=4).start()
    try:
        flood = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]
        dropped = [closed_by_peer(sock, 3.0) for sock in flood[:6]]
        assert dropped == [True] * 6  # long before their 30 s deadline
        assert admission.pending() <= 4
        follower = join_as_follower(port)
        assert admission.next(timeout=5).hello == {"process_id": 1}
        follower.close()
        admission.close()
        assert all(closed_by_peer(sock, 1.0) for sock in flood[6:])  # close() hangs up the rest
    finally:
        admission.close()
        listener.close()
        for sock in flood:
            sock.close()


def test_a_channel_read_waits_only_as_long_as_asked_and_a_stalled_frame_fails():
    from jtp.distributed.control import ChannelTimeout

    server, client = handshake(SECRET, SECRET)
    t = time.monotonic()
    with pytest.raises(ChannelTimeout, match="sent nothing"):
        server.recv(wait=0.3)
    assert 0.25 < time.monotonic() - t < 2
    frame = captured_frame(client, Kind.HEARTBEAT)
    client.sock.sendall(bytes(frame[:10]))  # a frame begun, never finished
    server.io_timeout = 0.3
    with pytest.raises(ChannelTimeout, match="stalled"):
        server.recv()


# ----------------------------------------------------------------------------- secrets and addresses


def test_a_spawned_follower_holds_the_secret_but_not_in_its_argv_or_environment(monkeypatch, demo_dir):
    """It proves the secret in a real handshake, yet /proc shows it nowhere; nor the leader's own
    $JTP_LAUNCH_SECRET or $JTP_API_KEY, which it does not need."""
    from jtp.config.engine_args import EngineArgs
    from jtp.distributed.admission import Admission
    from jtp.distributed.launcher import LaunchSpec, reap, spawn_followers

    monkeypatch.setenv("JTP_LAUNCH_SECRET", (b"leader's own env" * 2).hex())
    monkeypatch.setenv("JTP_API_KEY", "an api key of the leader")
    listener = socket.create_server(("127.0.0.1", 0))
    secret = os.urandom(32)
    spec = LaunchSpec(2, 0, "127.0.0.1:1", f"127.0.0.1:{listener.getsockname()[1]}", secret)
    admission = Admission(listener, secret).start()
    (proc,) = spawn_followers(spec, EngineArgs(model=str(demo_dir), num_processes=2), 1)
    try:
        arrival = admission.next(timeout=120)
        assert arrival is not None and arrival.hello["pid"] == proc.pid  # it holds the secret
        exposed = Path(f"/proc/{proc.pid}/environ").read_bytes() + Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert b"JTP_LAUNCH=" in exposed  # the right process's environment was read
        for leaked in (secret, secret.hex().encode(), secret.hex().upper().encode(), b"JTP_LAUNCH_SECRET",
                       b"JTP_API_KEY", b"an api key"):
            assert leaked not in exposed
        arrival.channel.close()
    finally:
        admission.close()
        listener.close()
        reap([proc], grace=0)
    assert not alive(proc.pid)


LISTENING_ON = """
import ipaddress, sys
from pathlib import Path
import jax
from jtp.distributed.launcher import LaunchSpec, init_distributed
port = int(sys.argv[1])
spec = LaunchSpec(1, 0, f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}", bytes(32), bind_loopback=False)  # multi-host mode
init_distributed(spec, 1, 10.0)
found = []
for table in ("tcp", "tcp6"):
    for row in Path("/proc/net/" + table).read_text().splitlines()[1:]:
        local, state = row.split()[1], row.split()[3]
        address, hex_port = local.rsplit(":", 1)
        if state == "0A" and int(hex_port, 16) == port:  # LISTEN; /proc writes each 32-bit word little-endian
            raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
            ip = ipaddress.ip_address(raw)
            found.append(str(getattr(ip, "ipv4_mapped", None) or ip))
print(found)
jax.distributed.shutdown()
"""


def test_the_coordinator_of_a_multi_host_launch_binds_the_address_it_was_given():
    """JAX's own default would listen on every interface ([::]) for 127.0.0.1:PORT."""
    port = free_port_pair()
    proc = subprocess.run([sys.executable, "-c", LISTENING_ON, str(port)], env=group_env(1), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1].replace("'", '"')) == ["127.0.0.1"]


# ----------------------------------------------------------------------------- the leader's watch


def bare_group(step_timeout: float = 60.0):
    """A leader-side WorkerGroup with one fake follower (no process, no channel)."""
    from jtp.distributed.group import WorkerGroup, _Follower
    from jtp.distributed.launcher import LaunchSpec

    group = WorkerGroup(LaunchSpec(2, 0, "127.0.0.1:1", "127.0.0.1:2", SECRET), heartbeat_timeout=60,
                        step_timeout=step_timeout, digest_interval=4)
    follower = _Follower(1, None, 4321, None)
    group.followers.append(follower)
    reasons: list[str] = []
    group.on_failure(reasons.append)
    return group, follower, reasons


def sampled(tokens):
    import jax.numpy as jnp

    from jtp.worker.sampler import SampleResult

    return SampleResult(jnp.asarray(tokens, jnp.int32), jnp.zeros(len(tokens)), None, None)


def test_a_follower_whose_sampled_tokens_differ_fails_the_group():
    from jtp.distributed.group import tokens_digest

    group, follower, reasons = bare_group()
    group.dispatched(0, sampled([5, 6, 7]))
    group.dispatched(1, sampled([1, 1, 1]))  # not a digest step (interval 4)
    group.dispatched(4, sampled([8, 9, 10]))
    group._their_digests += [(follower, 0, tokens_digest([5, 6, 7])), (follower, 8, tokens_digest([0]))]
    group._compare_digests()
    assert reasons == [] and [s for _, s, _ in group._their_digests] == [8]  # step 8: not run by the leader yet
    group._their_digests.append((follower, 4, tokens_digest([8, 9, 11])))
    group._compare_digests()
    assert len(reasons) == 1 and "follower 1 (pid 4321) diverged" in reasons[0] and "step 4" in reasons[0]
    with pytest.raises(Exception, match="diverged"):
        group.check()  # no more steps go out


def test_a_step_that_outlives_the_step_timeout_fails_the_group():
    class Never:
        def is_ready(self) -> bool:
            return False

    group, follower, reasons = bare_group(step_timeout=0.3)
    group.dispatched(7, Never())
    threading.Thread(target=group._monitor, daemon=True).start()
    assert group.failed.wait(10)
    assert reasons == ["step 7 did not finish within the 0.3 s step timeout"]


def test_a_follower_whose_digest_never_comes_fails_the_group_after_the_step_timeout():
    from jtp.distributed.group import tokens_digest

    group, follower, reasons = bare_group(step_timeout=0.5)
    group.dispatched(0, sampled([5, 6, 7]))
    group._their_digests.append((follower, 0, tokens_digest([5, 6, 7])))
    follower.last_digest = 0  # step 0 answered, as the reader thread records it
    group.dispatched(4, sampled([1, 2, 3]))  # never answered
    group._compare_digests()
    assert reasons == [] and [s for s, _ in group._awaited] == [4]
    threading.Thread(target=group._monitor, daemon=True).start()
    assert group.failed.wait(10)
    assert reasons == ["follower 1 (pid 4321) sent no digest of step 4 within the 0.5 s step timeout"]


def test_a_leader_with_more_cpu_devices_than_its_followers_is_a_one_line_error():
    """A local launch gives each follower the mesh's devices per process (1 here); a leader whose
    XLA_FLAGS force more (2) cannot form a group JAX accepts: say so, not a reshape error."""
    proc = subprocess.run([sys.executable, "-m", "jtp.entrypoints.cli", "generate", "--num-processes", "2", "-tp", "2",
                           "--max-tokens", "2", "--max-model-len", "64", "Hello"],
                          capture_output=True, text=True, env=group_env(2), timeout=180)
    assert proc.returncode == 2, proc.stderr
    assert "process 0 has 2, process 1 has 1 devices" in proc.stderr and "xla_force_host_platform_device_count=1" in proc.stderr


def test_a_cluster_environment_supplies_the_coordinator_and_process_id(monkeypatch):
    from jtp.config.engine_args import EngineArgs
    from jtp.distributed.launcher import LaunchSpec, is_follower
    from jtp.errors import ConfigError

    args = EngineArgs(num_processes=2, tensor_parallel_size=2)
    for name, value in dict(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="node7", SLURM_NTASKS="2", SLURM_PROCID="1",
                            SLURM_LOCALID="0", SLURM_STEP_NUM_NODES="2").items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("JTP_LAUNCH_SECRET", raising=False)
    with pytest.raises(ConfigError, match="shared secret"):
        LaunchSpec.resolve(args)
    monkeypatch.setenv("JTP_LAUNCH_SECRET", SECRET.hex())
    spec = LaunchSpec.resolve(args)
    host, port = spec.coordinator_address.split(":")
    assert (spec.process_id, spec.num_processes, host, spec.secret) == (1, 2, "node7", SECRET)
    assert spec.control_address == f"node7:{int(port) + 1}" and not spec.bind_loopback
    assert is_follower(args)


# ----------------------------------------------------------------------------- lockstep parity


@pytest.fixture(scope="module")
def hybrid_dir(shallow_hybrid_hk4_dir):
    return shallow_hybrid_hk4_dir


@functools.cache  # one reference run per (model, tp, args) for the whole module
def in_process(model: str, tp: int, **engine_args) -> list[list[int]]:
    from jtp.config.engine_args import EngineArgs
    from jtp.engine.engine import Engine

    with Engine.from_args(EngineArgs(model=model, tensor_parallel_size=tp, **ENGINE_ARGS, **engine_args)) as engine:
        return run_staggered(engine, engine.cfg.vocab_size)


def two_processes(model: str, tp: int = 4, num_processes: int = 2, **engine_args) -> list[list[int]]:
    args = json.dumps({"model": model, "num_processes": num_processes, "tensor_parallel_size": tp,
                       "digest_interval": 4, **engine_args})
    devices = tp * engine_args.get("pipeline_parallel_size", 1) // num_processes
    proc = subprocess.run([sys.executable, str(TESTS / "staggered.py"), args], env=group_env(devices),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_processes_give_the_tokens_of_one_process_at_tp4_and_tp1():
    """The dense demo here; a hybrid group (its state slots replayed by the followers) is compared
    with one process by the MTP-drafting and the snapshot tests below, and hybrid tp invariance in
    one process by test_hybrid_engine."""
    from jtp.demo import ensure_demo_checkpoint

    model = str(ensure_demo_checkpoint())
    group = two_processes(model)
    assert [len(t) for t in group] == [s[2] for s in __import__("staggered").SCHEDULE]
    assert group == in_process(model, 4)
    assert group == in_process(model, 1)


def test_one_process_per_device_drawing_dummy_weights_gives_the_tokens_of_one_process(tmp_path):
    """tp=2 as two processes of one device each (one per GPU, as a multi-GPU host runs it), every
    process drawing the same dummy weights from config.json alone: one process's tokens."""
    from scripts_loader import load_script

    load_script("make_random_checkpoint").write_checkpoint("qwen3-tiny", tmp_path, "float32", config_only=True)
    group = two_processes(str(tmp_path), tp=2, num_processes=2, load_format="dummy")
    assert [len(t) for t in group] == [s[2] for s in __import__("staggered").SCHEDULE]
    assert group == in_process(str(tmp_path), 1, load_format="dummy")


def test_pipeline_stages_in_two_processes_give_the_tokens_of_one_process(hybrid_dir, tmp_path):
    """--pipeline-parallel-size 2 over two processes, a stage each (its hidden states handed over by
    a collective permute through gloo), alone and with tp=2 inside each stage; the dense demo, a
    hybrid (DeltaNet and attention layers on different processes) and a MoE."""
    pytest.importorskip("torch")
    from hf_models import make_hf_checkpoint

    from jtp.demo import ensure_demo_checkpoint

    demo = str(ensure_demo_checkpoint())
    assert two_processes(demo, tp=1, pipeline_parallel_size=2) == in_process(demo, 1)
    assert two_processes(demo, tp=2, pipeline_parallel_size=2) == in_process(demo, 1)
    moe = str(make_hf_checkpoint("qwen3_moe", tmp_path / "moe")[1])
    for model in (str(hybrid_dir), moe):
        assert two_processes(model, tp=1, pipeline_parallel_size=2) == in_process(model, 1), model


def test_two_processes_drafting_with_the_mtp_head_give_the_tokens_of_one_process(tmp_path):
    """MTP speculation across a group: the followers load the head and run its K/V too (else the
    steps would differ and the digests part), and the tokens are those without speculation."""
    pytest.importorskip("torch")
    from test_mtp import MTP, MTPCheckpoint

    model = str(MTPCheckpoint("qwen3_5_text", tmp_path / "mtp").path)
    assert two_processes(model, tp=2, speculative_config=MTP) == in_process(model, 1)


@pytest.mark.parametrize("kind", ["qwen3", "hybrid"])
def test_snapshots_saved_and_loaded_by_a_group_continue_like_one_process(kind, request, tmp_path):
    """Orbax save / load through the group: each process writes and reads its own shards."""
    from jtp.config.engine_args import EngineArgs
    from jtp.demo import ensure_demo_checkpoint
    from jtp.engine.engine import Engine

    model = str(ensure_demo_checkpoint() if kind == "qwen3" else request.getfixturevalue("hybrid_dir"))
    args = json.dumps({"model": model, "num_processes": 2, "tensor_parallel_size": 4})
    proc = subprocess.run([sys.executable, str(TESTS / "staggered.py"), args, str(tmp_path / "group")],
                          env=group_env(2), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    group = json.loads(proc.stdout.strip().splitlines()[-1])
    with Engine.from_args(EngineArgs(model=model, **{**ENGINE_ARGS, "enable_prefix_caching": True})) as engine:
        solo = snapshot_roundtrip(engine, str(tmp_path / "solo"))
    assert group == solo and solo["hits"] > 0  # the continuation read the loaded pages


# ----------------------------------------------------------------------------- processes


def children(pid: int) -> list[int]:
    """Live (not zombie) child processes of `pid`, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


class GroupServer:
    """`jtp serve --num-processes 2 -tp 4` on a free loopback port, its stderr collected."""

    def __init__(self, *extra: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jtp.entrypoints.cli", "serve", "--port", "0", "--num-processes", "2", "-tp", "4",
             "--heartbeat-timeout", "2", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
             "--block-size", "32", "--num-blocks", "32", "--max-model-len", "512", *extra],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=group_env(2), text=True)
        self.log: list[str] = []
        self.url_seen = threading.Event()
        self.url = None
        threading.Thread(target=self._read, daemon=True).start()
        assert self.url_seen.wait(180), self.text()
        self.wait_ready()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            if self.url is None and (m := re.search(r"on (http://\S+?)/v1", line)):
                self.url = m.group(1)
                self.url_seen.set()

    def text(self) -> str:
        return "".join(self.log)[-6000:]

    def wait_ready(self, timeout: float = 180) -> None:
        def ready():
            assert self.proc.poll() is None, self.text()
            try:
                return httpx.get(self.url + "/ready", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, timeout, "the server to be ready")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def follower(self) -> int:
        (pid,) = children(self.proc.pid)
        return pid

    def complete(self, max_tokens: int = 8):
        return self.client().completions.create(model="jtp-demo", prompt="Once upon a time", max_tokens=max_tokens,
                                                temperature=0, extra_body={"ignore_eos": True})

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def fail_mid_generation(server: GroupServer, hurt, stream: bool) -> None:
    """Start a long request (whole or streamed), hurt the follower, and check the caller's error,
    the recovery and the process table."""
    reference = server.complete().choices[0].text
    victim = server.follower()
    outcome: dict = {}
    body = {"model": "jtp-demo", "prompt": "Once upon a time", "max_tokens": 480, "temperature": 0,
            "ignore_eos": True, "stream": stream}

    def long_request():
        t = time.monotonic()
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            outcome["status"], outcome["headers"] = r.status_code, r.headers
            outcome["lines"] = [line for line in r.iter_lines() if line]
        outcome["seconds"] = time.monotonic() - t

    caller = threading.Thread(target=long_request)
    caller.start()
    time.sleep(2.0)  # generating by now
    hurt(victim)
    caller.join(60)
    if stream:  # the stream had started (200): it ends with an error event, then [DONE]
        assert outcome["status"] == 200 and outcome["lines"][-1] == "data: [DONE]", outcome
        error = json.loads(outcome["lines"][-2][len("data: "):])["error"]
    else:
        assert outcome["status"] == 503 and outcome["headers"]["retry-after"] == "1", (outcome, server.text())
        error = json.loads(outcome["lines"][0])["error"]
    assert error["code"] == "worker_group_failed" and error["type"] == "service_unavailable_error"
    assert "worker group failed" in error["message"] and f"pid {victim}" in error["message"]
    assert outcome["seconds"] < 2.0 + 2 + 5  # within the heartbeat deadline (2 s) plus slack
    server.wait_ready()
    assert server.complete().choices[0].text == reference  # the restarted group serves the next request
    assert not alive(victim)  # killed and reaped: no zombie, no stopped process left
    assert len(children(server.proc.pid)) == 1  # exactly the new follower


def test_follower_kill_and_hang_fail_requests_retryably_then_the_group_recovers_and_sigterm_drains():
    server = GroupServer("--no-warmup")
    try:
        fail_mid_generation(server, lambda pid: os.kill(pid, signal.SIGKILL), stream=False)
        fail_mid_generation(server, lambda pid: os.kill(pid, signal.SIGSTOP), stream=True)
        assert "restart 2" in server.text()
        # SIGTERM drains: the running request finishes normally, then everything exits.
        follower = server.follower()
        result: dict = {}
        caller = threading.Thread(target=lambda: result.setdefault("r", server.complete(max_tokens=40)))
        caller.start()
        time.sleep(1.0)
        server.proc.send_signal(signal.SIGTERM)
        caller.join(60)
        assert result["r"].choices[0].finish_reason == "length" and result["r"].usage.completion_tokens == 40
        assert server.proc.wait(60) == 0, server.text()
        wait_until(lambda: not alive(follower), 10, "the follower to exit")
    finally:
        server.close()


def test_a_follower_that_dies_while_a_restarted_group_starts_brings_the_next_restart():
    """The restarted group's follower dies before the group is up: restart again (backing off) rather
    than exit, closing the port its clients wait on."""
    server = GroupServer("--no-warmup")
    try:
        first = server.follower()
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: [pid for pid in children(server.proc.pid) if pid != first], 60, "a new follower")
        os.kill(server.follower(), signal.SIGKILL)  # it is still starting up (loading, joining)
        server.wait_ready()
        assert "restart 2" in server.text() and server.complete().choices[0].finish_reason == "length"
    finally:
        server.close()


def test_a_follower_that_dies_while_the_leader_drains_ends_it_without_a_restart():
    """SIGTERM asked the server to end: a group failure during the drain must not bring it back."""
    server = GroupServer("--no-warmup")
    try:
        follower = server.follower()
        body = {"model": "jtp-demo", "prompt": "Once upon a time", "max_tokens": 480, "temperature": 0,
                "ignore_eos": True, "stream": True}
        outcome: dict = {}

        def long_request():
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                outcome["lines"] = [line for line in r.iter_lines() if line]

        caller = threading.Thread(target=long_request)
        caller.start()
        time.sleep(2.0)  # generating by now
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # draining the stream
        os.kill(follower, signal.SIGKILL)
        caller.join(60)
        assert json.loads(outcome["lines"][-2][len("data: "):])["error"]["code"] == "worker_group_failed"
        assert server.proc.wait(60) == 0, server.text()
        assert "restarting the worker group" not in server.text()
    finally:
        server.close()


def test_a_killed_pipeline_stage_fails_requests_retryably_then_the_pipeline_recovers():
    """Two stages in two processes (-pp 2 -tp 2): kill -9 the first stage's process mid-generation."""
    server = GroupServer("--no-warmup", "-tp", "2", "-pp", "2")
    try:
        fail_mid_generation(server, lambda pid: os.kill(pid, signal.SIGKILL), stream=True)
        # Each stage's steps, the follower's as it reported them (every heartbeat_timeout / 4 = 0.5 s).
        server.complete()
        time.sleep(1.5)
        stages = httpx.get(server.url + "/stats", timeout=10).json()["stages"]
        assert [s["stage"] for s in stages] == [0, 1] and stages[0]["steps"] == stages[1]["steps"] > 0, stages
    finally:
        server.close()


def test_leader_kill_ends_its_followers():
    server = GroupServer("--no-warmup")
    try:
        follower = server.follower()
        caller = threading.Thread(target=lambda: pytest.raises(Exception, server.complete, 480), daemon=True)
        caller.start()
        time.sleep(1.0)
        server.proc.kill()
        server.proc.wait(10)
        wait_until(lambda: not alive(follower), 10, "the follower to exit after its leader was killed")
    finally:
        server.close()


def test_a_follower_killed_during_jtp_batch_ends_it_with_one_line_and_keeps_the_rows(tmp_path):
    """The caller steps the engine itself (manual mode): the step that meets the dead follower raises
    WorkerGroupError naming it, not gloo's error -- or, blocked in a collective on the dead peer (gloo
    never fails that wait), is ended after a grace period with the same lines -- so the run prints one
    line and exits 1 with the rows written so far and no error rows (a rerun serves the rest)."""
    from jtp.demo import ensure_demo_checkpoint

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": n, "prompt": "Once upon a time", "max_tokens": 480, "temperature": 0,
                                       "ignore_eos": True}) + "\n" for n in range(8)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "jtp.entrypoints.cli", "batch", "--model", str(ensure_demo_checkpoint()),
         "--input", str(inp), "--output", str(out), "--num-processes", "2", "-tp", "4", "--heartbeat-timeout", "2",
         "--max-num-seqs", "2", "--block-size", "32", "--num-blocks", "64", "--max-model-len", "512"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=group_env(2), text=True)
    try:
        wait_until(lambda: out.is_file() and out.read_text().count("\n") >= 2, 180, "the first rows")
        (victim,) = children(proc.pid)
        os.kill(victim, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr and "Gloo" not in stderr, stderr
    (error,) = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert "worker group failed" in error and f"pid {victim}) killed by SIGKILL" in error, stderr
    assert "rerun the same command to resume" in stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert 2 <= len(rows) < 8 and not [r for r in rows if "error" in r], rows


# ----------------------------------------------------------------------------- manual launch


def free_port_pair() -> int:
    """A port p with p + 1 free too (the coordinator and the control channel)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def manual(process_id: int, port: int, secret: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "jtp.entrypoints.cli", "serve", "--port", "0", "--no-warmup", "--num-processes", "2",
         "--process-id", str(process_id), "--coordinator-address", f"127.0.0.1:{port}", "-tp", "2",
         "--max-num-seqs", "4", "--num-blocks", "32", "--max-model-len", "256", *extra],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env=group_env(1, JTP_LAUNCH_SECRET=secret))


class Squatters:
    """Any local user's attack on the control port: `n` idle connections and one that stops halfway
    through its handshake, each replaced as soon as the leader hangs it up, until `stop()`."""

    def __init__(self, port: int, n: int):
        self.port, self.n = port, n
        self.live: list[socket.socket] = []
        self.opened = self.hung_up = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _connect(self, half: bool) -> None:
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=2)
        except OSError:  # not listening (yet, or any more)
            return
        try:
            if half:
                _recv_exactly(sock, len(MAGIC) + 32)
                sock.sendall(MAGIC + b"x" * 20)
        except OSError:  # not greeted in time: count it as an idle one
            pass
        sock.settimeout(None)  # blocking, so MSG_DONTWAIT below polls without waiting
        self.live.append(sock)
        self.opened += 1

    def _run(self) -> None:
        for _ in range(1200):  # bounded: 10 minutes
            if self._stop.wait(0.5):
                return
            for sock in list(self.live):
                if _hung_up(sock):
                    self.live.remove(sock)
                    sock.close()
                    self.hung_up += 1
            for i in range(self.n + 1 - len(self.live)):
                self._connect(half=i == 0)

    def stop(self) -> list[socket.socket]:
        self._stop.set()
        self._thread.join(10)
        return self.live


def _hung_up(sock: socket.socket) -> bool:
    try:
        while sock.recv(4096, socket.MSG_DONTWAIT):  # the greeting, if unread
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def established(port: int) -> int:
    """Open connections whose local end is `port` (ESTABLISHED or CLOSE_WAIT: not yet closed here)."""
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for r in rows if int(r.split()[1].rsplit(":", 1)[1], 16) == port and r.split()[3] in ("01", "08"))


def test_manual_launch_admits_the_right_follower_past_a_wrong_secret_and_squatters_on_the_control_port():
    """Idle and half-handshaken connections held open against the control port the whole time: the
    follower still joins (it used to wait behind each for its full deadline and give up), the group
    answers with one process's greedy tokens, and the leader closed every connection it accepted."""
    from jtp.config.engine_args import EngineArgs
    from jtp.core.sampling_params import SamplingParams
    from jtp.demo import ensure_demo_checkpoint
    from jtp.engine.engine import Engine
    from jtp.engine.tokenizer import Tokenizer

    port, secret = free_port_pair(), SECRET.hex()
    leader = manual(0, port, secret)
    squatters = Squatters(port + 1, n=4)
    follower = None
    try:
        wait_until(lambda: len(squatters.live) == 5, 120, "the squatters to hold the control port")
        intruder = manual(1, port, (b"x" * 32).hex())
        _, err = intruder.communicate(timeout=120)
        assert intruder.returncode == 2 and "wrong launch secret" in err, err
        follower = manual(1, port, secret)
        log: list[str] = []
        threading.Thread(target=lambda: log.extend(leader.stderr), daemon=True).start()
        wait_until(lambda: any("serving" in line for line in log), 180, "the leader to serve")
        left = squatters.stop()
        assert all(closed_by_peer(sock, 2.0) for sock in left)  # hung up when admission ended
        assert squatters.opened == squatters.hung_up + len(left) >= 5
        url = re.search(r"on (http://\S+?)/v1", "".join(log)).group(1)
        wait_until(lambda: httpx.get(url + "/ready").status_code == 200, 60, "ready")
        for sock in left:
            sock.close()
        assert established(port + 1) == 1  # the follower's channel, and no squatter's socket left open
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        text = client.completions.create(model="jtp-demo", prompt="Hello", max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
        assert "wrong launch secret" in "".join(log)  # the leader logged the refusal and kept waiting
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(60) == 0
        assert follower.wait(30) == 0  # told to shut down
    finally:
        squatters.stop()
        for p in (leader, follower):
            if p is not None:
                p.kill()
    demo = ensure_demo_checkpoint()
    tok = Tokenizer.from_dir(demo)
    with Engine.from_args(EngineArgs(model=str(demo), max_num_seqs=4, num_blocks=32, max_model_len=256,
                                     warmup=False)) as engine:
        (solo,) = engine.generate([tok.encode("Hello")], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert text == tok.decode(solo.token_ids)


@pytest.mark.parametrize("mismatch", ["config", "checkpoint"])
def test_manual_launch_refuses_a_follower_with_another_config_or_checkpoint(mismatch, tmp_path):
    from jtp.demo import ensure_demo_checkpoint

    port, secret = free_port_pair(), SECRET.hex()
    if mismatch == "config":
        extra, expected = ["--max-num-seqs", "8"], "max_num_seqs: leader 4, follower 8"
    else:
        other = tmp_path / "other"
        other.mkdir()
        demo = ensure_demo_checkpoint()
        for f in demo.iterdir():
            (other / f.name).write_bytes(f.read_bytes())
        weights = other / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-8:] = bytes(8)  # another checkpoint: the same shapes, other bytes
        weights.write_bytes(bytes(data))
        extra, expected = ["--model", str(other)], "(another checkpoint)"
    leader = manual(0, port, secret)
    follower = manual(1, port, secret, *extra)
    try:
        _, follower_err = follower.communicate(timeout=180)
        _, leader_err = leader.communicate(timeout=60)
        assert follower.returncode == 2 and "refused process 1" in follower_err and expected in follower_err, follower_err
        assert leader.returncode == 2 and expected in leader_err, leader_err
    finally:
        leader.kill()
        follower.kill()


@pytest.mark.unit
def test_a_restarted_group_that_keeps_failing_to_start_ends(monkeypatch):
    """Start failures of a restarted group restart it again up to MAX_FAILED_STARTS in a row (then the
    process ends, for its supervisor to see); a configuration error, or a first start, ends at once."""
    from jtp.entrypoints.server import launch
    from jtp.errors import ConfigError

    monkeypatch.setenv(launch.RESTARTS_ENV, "1,0")
    monkeypatch.delenv(launch.FAILED_STARTS_ENV, raising=False)
    died = RuntimeError("follower 1 (pid 7) ended during start-up (killed by SIGKILL)")
    again = [launch._start_again(died) for _ in range(launch.MAX_FAILED_STARTS)]
    assert again == [True] * (launch.MAX_FAILED_STARTS - 1) + [False]
    monkeypatch.delenv(launch.FAILED_STARTS_ENV)
    assert not launch._start_again(ConfigError("the checkpoint's config.json has no hidden_size"))
    monkeypatch.delenv(launch.RESTARTS_ENV)
    assert not launch._start_again(died)
