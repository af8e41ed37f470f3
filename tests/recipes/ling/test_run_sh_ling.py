"""`bash recipes/ling/run.sh` as a user runs it: the tiny default offline, and `--serve` answering the openai client
(completions, chat through the tokenizer's template, /v1/responses, streaming; tools refused with 400 since the
template defines none), with one-line errors and exit code 2 for bad arguments."""
import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from ports import free_port

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "ling"
RUN_SH = RECIPE / "run.sh"



def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{url} never answered /health"
        time.sleep(0.2)


def test_default_run_generates_for_every_prompt():
    r = subprocess.run(["bash", str(RUN_SH), "--max-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    prompts = [line for line in (RECIPE / "prompts.txt").read_text().splitlines() if line.strip()]
    assert all(f"> {p}" in r.stdout for p in prompts) and f"requests={len(prompts)}" in r.stdout
    assert r.stdout.count(" tokens, length]") + r.stdout.count(" tokens, stop]") == len(prompts)


def test_mtp_and_graph_mode_flags_print_the_plain_completions(tmp_path):
    """`--speculative-tokens 2 --exe-mode graph` (the MTP layer loaded, its drafts verified in compiled graphs of one
    bucket) prints the completions of the plain eager run, fp32, and says how it ran."""
    preset = tmp_path / "graph.yaml"
    preset.write_text((RECIPE / "configs" / "tiny-cpu.yaml").read_text().replace(
        "  max_num_seqs: 16\n", "  max_num_seqs: 4\n  graph_capture_sizes: [4]\n"))  # test_speculative_ling's
    #   graph (bucket 4, k = 2, the tiny config): inductor's on-disk cache compiles it once for both
    common = ["bash", str(RUN_SH), "--config", str(preset), "--dtype", "fp32", "--max-tokens", "8"]
    plain = subprocess.run(common, capture_output=True, text=True, timeout=300)
    fast = subprocess.run([*common, "--speculative-tokens", "2", "--exe-mode", "graph"], capture_output=True,
                          text=True, timeout=600)
    assert plain.returncode == 0 and fast.returncode == 0, (plain.stderr, fast.stderr)
    completions = lambda out: [line for line in out.splitlines() if line.startswith(("> ", "'", '"'))]  # noqa: E731
    assert completions(fast.stdout) == completions(plain.stdout) and len(completions(plain.stdout)) > 2
    assert "mtp_drafts=" in fast.stdout and "exe_mode=graph graph_buckets=" in fast.stdout
    assert "graph_steps=" in fast.stdout


@pytest.mark.parametrize("args, needle", [
    (("--weights", "/no/such/dir"), "/no/such/dir"),
    (("--config", "configs/atlas-a3-tp8.yaml"), "world_size 8"),
    (("--max-tokens", "0"), "max_tokens"),
    (("--dtype", "fp8"), "--dtype"),
    (("--speculative-tokens", "9"), "speculative tokens"),
    (("--exe-mode", "fast"), "--exe-mode"),
    (("--serve", "--pd-role", "decode"), "--pd-bootstrap"),
])
def test_bad_arguments_give_one_line_and_exit_2(args, needle):
    r = subprocess.run(["bash", str(RUN_SH), *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr


def test_serve_answers_the_openai_client_then_sigterm_exits_0():
    port = free_port()
    proc = subprocess.Popen(["bash", str(RUN_SH), "--serve", "--port", str(port), "--dtype", "fp32",
                             "--served-model-name", "ling", "--drain-timeout", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url)
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        done = client.completions.create(model="ling", prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 3
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chat = client.chat.completions.create(model="ling", messages=messages, max_tokens=5, temperature=0,
                                              extra_body={"ignore_eos": True})
        streamed = client.chat.completions.create(model="ling", messages=messages, max_tokens=5, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert chat.usage.completion_tokens == 5 and text == chat.choices[0].message.content
        again = client.chat.completions.create(model="ling", messages=messages, max_tokens=5, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert again.choices[0].message.content == chat.choices[0].message.content
        assert again.usage.prompt_tokens_details.cached_tokens > 0  # the state checkpoint and latent blocks hit
        response = client.responses.create(model="ling", input="What is the capital of France?",
                                           max_output_tokens=5, temperature=0)
        assert response.status in ("completed", "incomplete") and response.output_text == chat.choices[0].message.content
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="ling", messages=messages, tools=[tool], max_tokens=3)
        assert "tool" in json.dumps(refused.value.body)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
