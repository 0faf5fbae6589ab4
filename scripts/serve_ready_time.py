"""Time `jtp serve` from process start to /ready, cold (empty compilation cache) and warm (the same
cache again), as a user sees it.

    python scripts/serve_ready_time.py [--starts 2] [--cache-dir DIR] [--timeout S] -- [jtp serve flags]

Each start runs `python -m jtp.entrypoints.cli serve --port 0 FLAGS` with JTP_COMPILATION_CACHE
pointing at one fresh directory (or --cache-dir, kept), waits for /ready, reads `jtp:compilations`
and the warm-up line of the log (its phases: tracing, lowering, XLA compile), then sends SIGTERM
and times the exit. `listening_s` is process start to the "serving" line: imports, device set-up
and the weights. Prints one JSON line per start as it ends (so a run cut short still reports),
then one JSON object of them all. A server that is not ready within --timeout is killed; the
child never outlives this script.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request


def _get(url: str, timeout: float = 5) -> tuple[int, str]:
    """(status, body); status 0 when the server did not answer within `timeout`."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (TimeoutError, urllib.error.URLError):
        return 0, ""


def one_start(flags: list[str], env: dict, timeout: float) -> dict:
    proc = subprocess.Popen([sys.executable, "-m", "jtp.entrypoints.cli", "serve", "--port", "0", *flags],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True)
    try:
        return _time_start(proc, timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _time_start(proc: subprocess.Popen, timeout: float) -> dict:
    t0 = time.perf_counter()
    log: list[str] = []
    url = None
    for line in proc.stderr:
        log.append(line)
        if m := re.search(r"on (http://\S+?)/v1", line):
            url = m.group(1)
            break
    if url is None:
        raise SystemExit("jtp serve did not start:\n" + "".join(log[-40:]))
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    listening = time.perf_counter() - t0
    slowest = 0.0  # the longest /ready took to answer while warming up
    while True:
        asked = time.perf_counter()
        status = _get(url + "/ready", timeout=120)[0]
        slowest = max(slowest, time.perf_counter() - asked)
        if status == 200:
            break
        if proc.poll() is not None:
            raise SystemExit("jtp serve exited:\n" + "".join(log[-40:]))
        if time.perf_counter() - t0 > timeout:
            return {"listening_s": round(listening, 2), "ready_s": None, "timed_out_s": timeout,
                    "slowest_ready_answer_s": round(slowest, 2),
                    "log_tail": [line.strip() for line in log[-5:]]}
        time.sleep(0.05)
    ready = time.perf_counter() - t0
    metrics = _get(url + "/metrics")[1]
    compilations = [float(m.group(1)) for m in re.finditer(r"^jtp:compilations_total\{[^}]*\} (\S+)", metrics, re.M)]
    t1 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    status = proc.wait(120)
    warmup_lines = [line.strip() for line in log if "warm-up" in line and "%" not in line]
    return {"listening_s": round(listening, 2), "ready_s": round(ready, 2), "exit_s": round(time.perf_counter() - t1, 2),
            "slowest_ready_answer_s": round(slowest, 2),
            "exit_status": status, "compilations": compilations[0] if compilations else None,
            "warmup_log": warmup_lines[-2:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--starts", type=int, default=2, help="starts sharing one cache (the first one cold)")
    ap.add_argument("--cache-dir", default=None, help="compilation cache to use and keep (default: a fresh temporary one)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds each start may take to be ready")
    ap.add_argument("flags", nargs=argparse.REMAINDER, help="jtp serve flags, after --")
    args = ap.parse_args(argv)
    # Killed by `timeout`: unwind (SystemExit), so one_start's finally kills the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache_dir or tmp
        env = dict(os.environ, JTP_COMPILATION_CACHE=cache)
        out = {"flags": flags, "xla_flags": env.get("XLA_FLAGS", ""), "starts": []}
        for _ in range(args.starts):
            out["starts"].append(one_start(flags, env, args.timeout))
            print(json.dumps(out["starts"][-1]), flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
