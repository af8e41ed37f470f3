"""`bash recipes/hstu/run.sh` as a user runs it: real files, a subprocess."""
import subprocess
from pathlib import Path

import pytest

import simulate_hstu

RUN_SH = Path(__file__).resolve().parents[3] / "recipes" / "hstu" / "run.sh"


def run(*args, timeout=120):
    return subprocess.run(["bash", str(RUN_SH), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def test_default_run_scores_through_the_cache():
    r = run()
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len([line for line in lines if line.startswith("auc ")]) == 8
    stats = dict(kv.split("=") for kv in lines[-1].split())
    assert stats["mode"] == "simulate" and int(stats["candidates"]) > 0 and float(stats["candidates/s"]) > 0
    assert 0 < float(stats["cache_hit_ratio"]) < 1 and int(stats["evicted_users"]) > 0
    root = RUN_SH.parents[2]
    assert (root / "weights" / "hstu-tiny" / "config.json").is_file()
    assert (root / "outputs" / "hstu" / "kuairand-synthetic" / "log_standard_1k.csv").is_file()
    e = run("--mode", "eval")
    assert e.returncode == 0, e.stderr
    assert [line for line in e.stdout.splitlines() if line.startswith("auc ")] == lines[:8]  # same scores


@pytest.mark.parametrize("args, needle", [
    (("--data", "/no/such/dir"), "/no/such/dir"),
    (("--weights", "/no/such/dir"), "/no/such/dir"),
    (("--config", "/no/such.yaml"), "/no/such.yaml"),
    (("--mode", "train"), "--mode"),
    (("--batch-users", "0"), "--batch-users"),
    (("--num-pages", "3"), "cannot hold"),
])
def test_bad_arguments_give_one_line_and_exit_2(args, needle, capsys):
    with pytest.raises(SystemExit) as e:  # in-process: the same main() run.sh executes
        simulate_hstu.main(list(args))
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and needle in err


def test_bad_argument_through_run_sh():
    r = run("--mode", "train")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--mode" in r.stderr
