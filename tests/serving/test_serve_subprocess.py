"""`bash recipes/deepseek/run.sh --serve` as a user runs it: listens, answers, and on SIGTERM drains and exits 0."""
import contextlib
import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from ports import free_port_run
from serving_harness import free_port, http

RUN_SH = Path(__file__).resolve().parents[2] / "recipes" / "deepseek" / "run.sh"


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            if http("GET", url + "/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{url} never answered /health"
        time.sleep(0.2)


@pytest.mark.slow
def test_serve_answers_then_sigterm_exits_0(checkpoint):
    port = free_port()
    proc = subprocess.Popen(["bash", str(RUN_SH), "--serve", "--port", str(port), "--weights", str(checkpoint),
                             "--exe-mode", "eager", "--dtype", "fp32", "--api-key", "k", "--served-model-name", "tiny",
                             "--drain-timeout", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, 120)
        client = OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=60)
        r = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
        stream = client.completions.create(model="tiny", prompt="long", max_tokens=1000, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        def read_until_cut_off():  # the server ends it after its drain timeout
            try:
                list(stream)
            except openai.APIError:
                pass
        reader = threading.Thread(target=read_until_cut_off, daemon=True)
        reader.start()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert f"Uvicorn running on http://127.0.0.1:{port}" in stderr and "Traceback" not in stderr


@pytest.mark.parametrize("args, needle", [(("--port", "70000"), "--port"),
                                          (("--weights", "/no/such/dir"), "/no/such/dir"),
                                          (("--config", "configs/atlas-a3-flash.yaml"), "moe_ep=16 does not divide"),
                                          (("--pd-role", "decode"), "--pd-bootstrap")])
def test_serve_bad_arguments_give_one_line_and_exit_2(args, needle):
    r = subprocess.run(["bash", str(RUN_SH), "--serve", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr


@contextlib.contextmanager
def several_instances(checkpoint, *mode):
    """`run.sh --serve <mode>` (--dp N, --pd P:D) on a free run of ports: yields (router url, client); SIGTERM at
    the end must stop every process with exit code 0."""
    port = free_port_run(3)  # router on port, instances on port + 1, port + 2
    proc = subprocess.Popen(["bash", str(RUN_SH), "--serve", *mode, "--port", str(port), "--weights",
                             str(checkpoint), "--exe-mode", "eager", "--dtype", "fp32", "--served-model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, 180)
        yield url, OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0


@pytest.mark.slow
def test_serve_dp_starts_instances_behind_the_router(checkpoint):
    """`run.sh --serve --dp 2`: two instances plus the router on one port; requests spread; SIGTERM stops all."""
    with several_instances(checkpoint, "--dp", "2") as (url, client):
        texts = [client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0).choices[0].text
                 for _ in range(4)]
        assert len(set(texts)) == 1  # same greedy answer from either instance
        stats = json.loads(http("GET", url + "/router/stats", timeout=5)[2])
        assert [u["served"] for u in stats["upstreams"]] == [2, 2]  # least outstanding, ties round robin


@pytest.mark.slow
def test_serve_over_dp2_ep2_ranks_equals_one_process(checkpoint, model_and_tokenizer):
    """`run.sh --serve --config configs/tiny-cpu-dp2-ep2.yaml`: torchrun, rank 0 serves, requests spread over both
    DP ranks (the experts over both); greedy answers equal the single-process engine's; SIGTERM: exit 0, no rank
    left behind."""
    import psutil
    from concurrent.futures import ThreadPoolExecutor

    from common.engine import LLM, SamplingParams
    port = free_port()
    proc = subprocess.Popen(["bash", str(RUN_SH), "--serve", "--port", str(port), "--weights", str(checkpoint),
                             "--exe-mode", "eager", "--dtype", "fp32", "--served-model-name", "tiny", "--config",
                             "configs/tiny-cpu-dp2-ep2.yaml"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    prompts = [[5, 6, 7], [40, 41, 42, 43, 44, 45], [300, 2, 9], [17, 18], [99, 98, 97, 96]]
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, 180)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "RANK" in p.environ()]
        assert len(ranks) == 2
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)

        def one(prompt):
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(one, prompts))
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=prompts[1], max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}))
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    model, tokenizer = model_and_tokenizer
    want = LLM(model, tokenizer).generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                          use_tqdm=False)
    assert texts == [o.text for o in want] and streamed == want[1].text
    assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
