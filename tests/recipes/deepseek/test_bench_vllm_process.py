"""bench_utils.VllmProcess, the pipe by which the benches' vLLM side takes its turns: a driver process (here a few
lines of plain Python in the test's interpreter, the protocol's other end) that logs on stdout between its answers,
as vLLM does."""
import os
import sys
import textwrap

import pytest

from bench_utils import VLLM_MARK, VllmProcess

DRIVER = textwrap.dedent("""
    import json, sys
    mark = sys.argv[1]
    print("INFO a log line on stdout, as vLLM's", flush=True)
    print(mark + json.dumps({"startup_s": 0.5}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        if ask.get("die"):
            print("Traceback: the driver failed", file=sys.stderr, flush=True)
            sys.exit(3)
        print("INFO another log line", flush=True)
        print(mark + json.dumps({"sum": sum(ask["values"])}), flush=True)
""")


def start(tmp_path) -> VllmProcess:
    return VllmProcess([sys.executable, "-c", DRIVER, VLLM_MARK], dict(os.environ), tmp_path / "driver.log")


def test_answers_are_the_marked_lines_in_turn(tmp_path):
    driver = start(tmp_path)
    try:
        assert driver.ready == {"startup_s": 0.5}  # the log line before it skipped
        assert driver.ask({"values": [1, 2, 3]}) == {"sum": 6}
        assert driver.ask({"values": [10]}) == {"sum": 10}
    finally:
        driver.close()
    assert driver.proc.returncode == 0  # stdin closed: its loop ended


def test_a_driver_that_exits_without_answering_names_its_log(tmp_path):
    driver = start(tmp_path)
    try:
        with pytest.raises(RuntimeError, match=r"exited \(3\).*driver\.log"):
            driver.ask({"die": True})
        assert "the driver failed" in (tmp_path / "driver.log").read_text()
    finally:
        driver.close()  # after it died: no error, nothing left running
    assert driver.proc.poll() == 3
