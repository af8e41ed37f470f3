"""PD as a user runs it, in real processes on 127.0.0.1: `run.sh --serve --pd 1:1`, and P, D and the router started
one by one, then killed (SIGKILL) while they work: bounded errors, 503s while a side is missing, no blocks held."""
import json
import re
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
import time
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from common.engine import LLM, SamplingParams

from ports import free_port_run
from serving_harness import http
from test_serve_subprocess import RUN_SH, several_instances, wait_healthy

ROOT = Path(__file__).resolve().parents[2]


def metric(url: str, name: str) -> float:
    text = http("GET", url + "/metrics", timeout=5)[2].decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return True
        except OSError:
            pass
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_run_sh_serve_pd_1_1_equals_offline(checkpoint, model_and_tokenizer):
    """`run.sh --serve --pd 1:1`: P, D and the router; greedy answers (whole and streamed) equal the offline
    engine's; every request was prefilled on P and its KV written to D; SIGTERM stops all with exit 0."""
    with several_instances(checkpoint, "--pd", "1:1") as (url, client):
        offline = LLM(*model_and_tokenizer)
        prompts = [[5, 6, 7], list(range(2, 100))]
        expected = [o.text for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=6,
                                                                             ignore_eos=True), use_tqdm=False)]
        kw = dict(model="tiny", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        assert [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts] == expected
        assert ["".join(c.choices[0].text for c in client.completions.create(prompt=p, stream=True, **kw))
                for p in prompts] == expected
        p_url = url.rsplit(":", 1)[0] + f":{int(url.rsplit(':', 1)[1]) + 1}"
        info = json.loads(http("GET", p_url + "/pd/info", timeout=5)[2])
        assert info["role"] == "prefill" and info["transfers"]["num_transfers"] == 4


class Instance:
    def __init__(self, args: list[str], url: str):
        self.args, self.url = args, url
        self.proc = None

    def start(self, timeout: float = 180) -> "Instance":
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     cwd=ROOT, start_new_session=True)
        wait_healthy(self.proc, self.url, timeout)
        return self

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.mark.slow
def test_a_side_that_dies_ends_its_requests_and_frees_the_other_side(checkpoint, tmp_path):
    base = free_port_run(3)
    p_port, d_port, r_port = base, base + 1, base + 2
    p_url, d_url, url = (f"http://127.0.0.1:{x}" for x in (p_port, d_port, r_port))
    preset = tmp_path / "tiny-chunk16.yaml"  # P prefills a long prompt in many chunks: time to kill a side meanwhile
    preset.write_text((RUN_SH.parent / "configs" / "tiny-cpu.yaml").read_text().replace(
        "max_num_batched_tokens: 512", "max_num_batched_tokens: 16"))
    common = ["--weights", str(checkpoint), "--exe-mode", "eager", "--dtype", "fp32", "--served-model-name", "tiny",
              "--config", str(preset)]
    prefill = Instance(["bash", str(RUN_SH), "--serve", "--port", str(p_port), "--pd-role", "prefill", *common], p_url)
    decode = Instance(["bash", str(RUN_SH), "--serve", "--port", str(d_port), "--pd-role", "decode", "--pd-bootstrap",
                       p_url, *common], d_url)
    router = Instance([sys.executable, "-m", "common.serving.router", "--prefill", p_url, "--upstream", d_url,
                       "--port", str(r_port), "--health-interval", "0.3"], url)
    long_prompt = [i % 500 + 2 for i in range(998)]  # 63 chunks on P
    try:
        for x in (prefill, decode, router):
            x.start()
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert client.completions.create(model="tiny", prompt=[5, 6], max_tokens=3).usage.completion_tokens == 3

        # P dies while it works on a request: the request fails in bounded time, D holds no block for it
        result = {}

        def request():
            t0 = time.monotonic()
            try:
                client.completions.create(model="tiny", prompt=long_prompt, max_tokens=3)
                result["outcome"] = "answered"
            except openai.APIStatusError as e:
                result["outcome"], result["message"] = e.status_code, e.message
            result["seconds"] = time.monotonic() - t0

        t = threading.Thread(target=request)
        t.start()
        assert wait_for(lambda: metric(d_url, "num_requests_waiting_for_remote_kvs") == 1, 30)
        prefill.kill()
        t.join(timeout=30)
        assert result["outcome"] == 500 and "prefill instance" in result["message"] and result["seconds"] < 30
        assert metric(d_url, "kv_cache_usage") == 0 and metric(d_url, "num_requests_waiting_for_remote_kvs") == 0
        assert wait_for(lambda: http("POST", url + "/v1/completions", {"prompt": "hi"}, timeout=5)[0] == 503, 10)
        prefill.start()
        assert wait_for(lambda: http("GET", url + "/health", timeout=5)[0] == 200, 10)

        # D dies while P prefills for it: P aborts the room and frees its blocks; the router answers 503 until a
        # D is back
        t = threading.Thread(target=request)
        t.start()
        assert wait_for(lambda: metric(d_url, "num_requests_waiting_for_remote_kvs") == 1, 30)
        decode.kill()
        t.join(timeout=30)
        assert result["outcome"] in (502, 503)  # the router saw D's connection break
        assert wait_for(lambda: metric(p_url, "kv_cache_usage") == 0 and metric(p_url, "num_requests_running") == 0
                        and metric(p_url, "num_requests_sending_kvs") == 0, 30)
        status, _, body = http("POST", url + "/v1/completions", {"prompt": "hi"}, timeout=5)
        assert status == 503 and b"decode" in body
        decode.start()
        assert wait_for(lambda: http("GET", url + "/health", timeout=5)[0] == 200, 10)
        assert client.completions.create(model="tiny", prompt=[5, 6], max_tokens=3).usage.completion_tokens == 3
    finally:
        for x in (router, decode, prefill):
            x.stop()


@pytest.mark.slow
def test_pd_over_multi_rank_instances_equals_one_process(checkpoint, model_and_tokenizer):
    """P on two attention-TP ranks, D on two DP ranks with expert parallelism (torchrun, gloo): requests spread over
    D's DP ranks, each prefilled by P's ranks and written into the D rank that holds it; greedy answers equal the
    single-process engine's, and the pools rank 0 reports are full afterwards."""
    base = free_port_run(3)
    p_port, d_port, r_port = base, base + 1, base + 2
    p_url, d_url, url = (f"http://127.0.0.1:{x}" for x in (p_port, d_port, r_port))
    common = ["--weights", str(checkpoint), "--exe-mode", "eager", "--dtype", "fp32", "--served-model-name", "tiny"]
    instances = [
        Instance(["bash", str(RUN_SH), "--serve", "--port", str(p_port), "--pd-role", "prefill", "--config",
                  "configs/tiny-cpu-tp2.yaml", *common], p_url),
        Instance(["bash", str(RUN_SH), "--serve", "--port", str(d_port), "--pd-role", "decode", "--pd-bootstrap",
                  p_url, "--config", "configs/tiny-cpu-dp2-ep2.yaml", *common], d_url),
        Instance([sys.executable, "-m", "common.serving.router", "--prefill", p_url, "--upstream", d_url,
                  "--port", str(r_port), "--health-interval", "0.3"], url)]
    try:
        for x in instances:
            x.start()
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        prompts = [[5, 6, 7], [i % 500 + 2 for i in range(40)], [9] * 17, [i % 300 + 3 for i in range(70)]]
        expected = [o.text for o in LLM(*model_and_tokenizer).generate(
            prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)]
        kw = dict(model="tiny", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        with ThreadPoolExecutor(4) as pool:  # at once: both of D's DP ranks take some
            got = list(pool.map(lambda p: client.completions.create(prompt=p, **kw).choices[0].text, prompts))
        assert got == expected
        streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=prompts[1], stream=True, **kw))
        assert streamed == expected[1]
        info = json.loads(http("GET", p_url + "/pd/info", timeout=5)[2])  # rank 0 writes for P's one DP rank
        assert info["transfers"]["num_transfers"] == 5 and info["transfers"]["num_failed"] == 0
        assert wait_for(lambda: metric(d_url, "kv_cache_usage") == 0 and metric(p_url, "kv_cache_usage") == 0, 10)
    finally:
        for x in reversed(instances):
            x.stop()
