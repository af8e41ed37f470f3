"""common.cpu_threads: a serial thread starts no OpenMP team; release_team ends the calling thread's team.

Teams are counted as OS threads (/proc/self/task) in a fresh interpreter (threads of other tests would come and go
meanwhile here): a thread that runs a parallel torch op gets torch.get_num_threads() - 1 new workers unless it was
made serial."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from common import cpu_threads

pytestmark = [
    pytest.mark.skipif(cpu_threads._libgomp() is None, reason="torch's OpenMP here is not libgomp"),
    pytest.mark.skipif(torch.get_num_threads() < 2, reason="one torch thread: no OpenMP team to start"),
]

PRELUDE = """
import json, os, threading, time
import torch
from common import cpu_threads
torch.set_num_threads(2)

def os_threads():
    return len(os.listdir("/proc/self/task"))

def settled_threads(timeout=2.0):  # once exiting workers are gone (a released team's workers exit on their own)
    deadline, n = time.monotonic() + timeout, os_threads()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        n, last = os_threads(), n
        if n == last:
            break
    return n

def parallel_op():
    (torch.ones(8_000_000) * 2).sum()  # large enough for ATen to run it on every thread

def in_thread(fn):  # fn's result, run on a new thread (alive while fn runs)
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]
"""


def run(body: str) -> dict:
    """What the script (PRELUDE, then body) prints as JSON on its last line, run in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_thread_starts_a_team_unless_serial():
    got = run("""
        def new_threads(serial):
            def body():
                if serial:
                    assert cpu_threads.serial_thread()
                before = settled_threads()  # the previous thread's workers gone
                parallel_op()
                return os_threads() - before
            return in_thread(body)
        print(json.dumps({"plain": new_threads(False), "serial": new_threads(True)}))
    """)
    assert got == {"plain": 1, "serial": 0}  # 2 torch threads: one worker; the mechanism the module guards against


def test_serial_thread_leaves_other_threads_count():
    got = run("""
        serial = in_thread(lambda: (cpu_threads.serial_thread(), torch.get_num_threads())[1])
        print(json.dumps({"serial": serial, "main": torch.get_num_threads(), "new": in_thread(torch.get_num_threads)}))
    """)
    assert got == {"serial": 1, "main": 2, "new": 2}  # a new thread is not serial


def test_release_team_ends_the_callers_workers():
    got = run("""
        parallel_op()
        with_team = os_threads()
        assert cpu_threads.release_team()
        released = settled_threads()
        parallel_op()  # parallel work again: a new team
        print(json.dumps({"ended": with_team - released, "started": os_threads() - released}))
    """)
    assert got == {"ended": 1, "started": 1}
