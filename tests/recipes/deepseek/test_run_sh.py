"""`bash recipes/deepseek/run.sh` as a user runs it: real files, real tokenizer, a subprocess."""
import subprocess
from pathlib import Path

import pytest

from tiny_deepseek_v4 import write_tiny_checkpoint

RUN_SH = Path(__file__).resolve().parents[3] / "recipes" / "deepseek" / "run.sh"


def run(*args, timeout=300):
    return subprocess.run(["bash", str(RUN_SH), *map(str, args)], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def plain_fp32():
    """`run.sh --max-tokens 6 --dtype fp32`, one process: the run the speculative and the multi-rank tests compare
    against (deterministic: started once for the module)."""
    return run("--max-tokens", 6, "--dtype", "fp32")


def test_default_run_writes_the_tiny_checkpoint_and_generates():
    r = run("--max-tokens", 3)
    assert r.returncode == 0, r.stderr
    completions = [line for line in r.stdout.splitlines() if line.startswith("> ")]
    assert len(completions) == 4  # the bundled prompts file
    stats = dict(kv.split("=") for kv in r.stdout.strip().splitlines()[-1].split())
    assert stats["requests"] == "4" and int(stats["generated_tokens"]) == 4 * 3
    assert float(stats["prefill_tok/s"]) > 0 and float(stats["decode_tok/s"]) > 0 and "peak_memory" in stats
    assert (RUN_SH.parents[2] / "weights" / "deepseek-v4-tiny" / "config.json").is_file()


def test_speculative_tokens_give_the_same_greedy_completions(plain_fp32):
    """fp32: in bf16 a verify forward (1 + K rows a sequence) rounds unlike a one-row decode, so near-ties can
    pick other tokens, as a chunked prefill against a whole one can."""
    plain = plain_fp32
    spec = run("--max-tokens", 6, "--dtype", "fp32", "--speculative-tokens", 2)
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    lines = [r.stdout.strip().splitlines() for r in (plain, spec)]
    assert lines[0][:-1] == lines[1][:-1]  # the completions; then the stats lines
    stats = dict(kv.split("=") for kv in lines[1][-1].split())
    assert int(stats["mtp_drafts"]) > 0 and 0 <= float(stats["acceptance"]) <= 1


@pytest.mark.parametrize("args, needle", [
    (("--max-tokens", "0"), "max_tokens"),
    (("--weights", "/no/such/dir"), "/no/such/dir"),
    (("--prompts", "/no/such/file"), "/no/such/file"),
    (("--dtype", "fp64"), "--dtype"),
    (("--temperature", "-1"), "temperature"),
    (("--top-p", "0"), "top_p"),
    (("--config", "configs/atlas-a3-flash.yaml"), "moe_ep=16 does not divide the model's 8 routed experts"),
    (("--speculative-tokens", "9"), "speculative tokens must be an int in [0, 7]"),
    (("--exe-mode", "jit"), "--exe-mode"),
])
def test_bad_arguments_give_one_line_and_exit_2(args, needle):
    r = run(*args)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr


@pytest.mark.parametrize("engine, needle", [
    ("{enable_chunked_prefill: false, max_num_batched_tokens: 64}", "enable_chunked_prefill"),  # at engine build
    ("{enable_chunked_prefill: false, max_num_batched_tokens: 64, max_model_len: 128}", "max_num_batched_tokens"),
    ("{block_size: 6}", "block_size"),  # not a multiple of the compress ratios
    ("{max_num_seqs: 0}", "max_num_seqs"),
    ("{graph_capture_sizes: [4, 2]}", "graph_capture_sizes must be increasing"),
    ("{max_num_seqs: 4, graph_capture_sizes: [1, 8]}", "past max_num_seqs"),
    ("{exe_mode: graph}", "top level of the preset"),
])
def test_settings_that_can_never_run_are_refused_at_start(tmp_path, engine, needle):
    preset = tmp_path / "preset.yaml"
    preset.write_text(f"engine: {engine}\n")
    r = run("--config", preset, "--max-tokens", 2)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr and "Traceback" not in r.stderr


def test_corrupt_checkpoint_gives_one_line_and_exit_2(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    shard = sorted(ckpt.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:100])
    r = run("--weights", ckpt)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and shard.name in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-cpu-tp2.yaml", "tiny-cpu-dp2-ep2.yaml"])
def test_multi_rank_presets_launch_torchrun_and_equal_one_rank(preset, plain_fp32):
    """run.sh starts torchrun itself for a preset of 2 ranks; fp32: the same completions as one process."""
    one = plain_fp32
    ranks = run("--max-tokens", 6, "--dtype", "fp32", "--config", f"configs/{preset}")
    assert one.returncode == 0 and ranks.returncode == 0, ranks.stderr
    completions = lambda out: [line for line in out.splitlines() if not line.startswith(("requests=", "dtype:"))]  # noqa: E731
    assert completions(ranks.stdout) == completions(one.stdout) and len(completions(one.stdout)) == 8
    assert "ranks=2" in ranks.stdout.splitlines()[-1] and ranks.stdout.count("dtype: fp32") == 1


def _rank_pids(parent: int) -> dict[int, int]:
    import psutil
    ranks = {}
    for child in psutil.Process(parent).children(recursive=True):
        try:
            if "RANK" in child.environ():
                ranks[int(child.environ()["RANK"])] = child.pid
        except psutil.Error:
            pass
    return ranks


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_with_a_message_naming_it():
    import os
    import signal
    import time

    import psutil
    proc = subprocess.Popen(["bash", str(RUN_SH), "--config", "configs/tiny-cpu-dp2-ep2.yaml", "--max-tokens", "4000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(ranks := _rank_pids(proc.pid)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.2)
        time.sleep(3)  # mid-run: the ranks are generating
        descendants = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        os.kill(ranks[1], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=90)  # bounded: the others end, the job exits
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "error: rank 1 of 2 failed first (killed by signal 9); torchrun stopped the others" in stderr, stderr[-2000:]
    assert not [pid for pid in descendants if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
