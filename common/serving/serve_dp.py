"""Several server instances on one machine behind the router, one OpenAI endpoint: data parallel (--dp N) or
prefill/decode disaggregated (--pd P:D).

    python -m common.serving.serve_dp --command "bash recipes/X/run.sh --serve" --dp N [--host 127.0.0.1]
        [--port 8000] [--devices 0,1,...] [run.sh serve options...]
    python -m common.serving.serve_dp --command "..." --pd P:D [same options]

--dp N starts `<command> --port P_i <options>` for i = 1..N (P_i = port + i). --pd P:D starts P prefill
instances (`--pd-role prefill`, ports port+1 .. port+P) and D decode instances (`--pd-role decode --pd-bootstrap`
every prefill instance, the next D ports). It waits until each answers `/health`, then starts
`python -m common.serving.router` on --host:--port in front of them (with --pd: `--prefill` the P instances,
`--upstream` the D instances). SIGTERM or SIGINT
goes to every child; it exits when they have exited, and if any child dies on its own it stops the others and
exits with that child's code. Options it does not know (--weights, --config, ...) go to every instance.

Each instance gets OMP_NUM_THREADS = cores / instances unless it is set, and with --devices 0,1,... instance i
sees only device i (ASCEND_RT_VISIBLE_DEVICES; with --pd the P instances come first).

A recipe's `bash run.sh --serve --dp N ...` and `bash run.sh --serve --pd P:D ...` come here with --command naming
that run.sh (a --serve it is given is dropped; the rest is passed on).
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: the router runs `python -m common.serving.router` there


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="run.sh --serve", description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--dp", type=int, help="number of server instances")
    mode.add_argument("--pd", help="P:D, numbers of prefill and decode instances (PD disaggregation)")
    p.add_argument("--host", default="127.0.0.1", help="the router's address")
    p.add_argument("--port", type=int, default=8000, help="the router's port; instances use port+1 .. port+N")
    p.add_argument("--devices", help="comma-separated device ids, one per instance")
    p.add_argument("--health-interval", type=float, default=1.0)
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for every /health")
    p.add_argument("--command", required=True, help="how to start one instance, e.g. 'bash recipes/X/run.sh "
                   "--serve' (--port P and the other options are appended)")
    a, rest = p.parse_known_args(argv)
    if a.pd is not None:
        try:
            a.num_prefill, a.num_decode = (int(x) for x in a.pd.split(":"))
        except ValueError:
            p.error(f"--pd {a.pd!r}: expected P:D, e.g. 1:1")
        if a.num_prefill < 1 or a.num_decode < 1:
            p.error(f"--pd {a.pd}: at least one prefill and one decode instance")
        a.roles = ["prefill"] * a.num_prefill + ["decode"] * a.num_decode
    elif a.dp < 1:
        p.error("--dp must be >= 1")
    else:
        a.roles = [None] * a.dp
    a.devices = a.devices.split(",") if a.devices else None
    if a.devices and len(a.devices) != len(a.roles):
        p.error(f"--devices lists {len(a.devices)} ids for {len(a.roles)} instances")
    if any(x.startswith("--pd-") for x in rest):
        p.error("--pd-role / --pd-bootstrap are set by --pd P:D itself")
    return a, [x for x in rest if x != "--serve"]


def main(argv=None) -> int:
    a, passthrough = parse_args(argv)
    children: list[subprocess.Popen] = []
    stopping = False

    def stop(signum=signal.SIGTERM, frame=None):
        nonlocal stopping
        stopping = True
        for c in children:
            if c.poll() is None:
                try:
                    os.killpg(c.pid, signum)
                except ProcessLookupError:
                    pass

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    threads = max(1, (os.cpu_count() or 1) // len(a.roles))
    urls = [f"http://127.0.0.1:{a.port + 1 + i}" for i in range(len(a.roles))]
    prefills = [u for u, role in zip(urls, a.roles) if role == "prefill"]
    for i, (url, role) in enumerate(zip(urls, a.roles)):
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))}
        if a.devices:
            env["ASCEND_RT_VISIBLE_DEVICES"] = a.devices[i]
        cmd = shlex.split(a.command) + ["--port", url.rsplit(":", 1)[1], *passthrough]
        if role is not None:
            cmd += ["--pd-role", role] + [x for u in prefills for x in ("--pd-bootstrap", u)] * (role == "decode")
        print(f"[serve_dp] instance {i}{f' ({role})' if role else ''}: {shlex.join(cmd)}", flush=True)
        children.append(subprocess.Popen(cmd, env=env, start_new_session=True))

    code = 0
    deadline = time.monotonic() + a.startup_timeout
    waiting = set(urls)
    while waiting and not stopping:
        if dead := [c for c in children if c.poll() is not None]:
            print(f"[serve_dp] an instance exited with code {dead[0].returncode} during startup", flush=True)
            code = dead[0].returncode or 1
            stop()
            break
        if time.monotonic() > deadline:
            print(f"[serve_dp] no /health after {a.startup_timeout:.0f}s: {sorted(waiting)}", flush=True)
            code = 1
            stop()
            break
        waiting = {u for u in waiting if not healthy(u)}
        time.sleep(0.5)
    if not stopping:
        router = [sys.executable, "-m", "common.serving.router", "--host", a.host, "--port", str(a.port),
                  "--health-interval", str(a.health_interval)]
        for u, role in zip(urls, a.roles):
            router += ["--prefill" if role == "prefill" else "--upstream", u]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        children.append(subprocess.Popen(router, env=env, cwd=ROOT, start_new_session=True))
        print(f"[serve_dp] router on http://{a.host}:{a.port} -> {', '.join(urls)}", flush=True)

    stopped_at = None
    while any(c.poll() is None for c in children):
        for c in children:
            if c.poll() is not None and not stopping:
                print(f"[serve_dp] {shlex.join(map(str, c.args[:4]))} exited with code {c.returncode}; stopping",
                      flush=True)
                code = c.returncode or 1
                stop()
        if stopping:
            stopped_at = stopped_at or time.monotonic()
            if time.monotonic() - stopped_at > 60:  # drained long enough
                stop(signal.SIGKILL)
        time.sleep(0.2)
    return code


if __name__ == "__main__":
    sys.exit(main())
