"""A model that implements only the model contract (contract_toy_model.py: no recipe import) runs through the engine
with chunked prefill and prefix caching, and greedily generates what a plain full-recompute loop of the same model
does; the engine's runner owns its cache tensors, allocated and sized by common/kv_cache from the model's specs.
Where the vLLM environment exists (tests/recipes/deepseek/test_vllm_plugin.py's), vLLM runs the same toy model
through the plugin's adapter (RecipeForCausalLM: the model contract alone, the adapter's default cache specs and
tables), with chunked prefill and a prefix-cache hit, to the same tokens."""
import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from common.engine import LLM, SamplingParams
from common.engine.model_runner import blocks_that_fit, prefill_logits
from common.kv_cache import CacheTensorSpec, allocate_cache_tensors, cache_bytes_per_block, tensors_by_group
from contract_toy_model import GROUP, K, V, ToyCausalLM, greedy_full_recompute

MAX_TOKENS = 10


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer of the toy's 96 ids ("t0" .. "t95", "t0" its EOS), built offline."""
    vocab = {f"t{i}": i for i in range(96)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")), eos_token="t0")


def prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (n,), generator=g).tolist() for n in lengths]


def test_engine_runs_a_contract_only_model_as_a_full_recompute_loop():
    model = ToyCausalLM().eval()
    llm = LLM(model, tokenizer(), block_size=4, max_num_seqs=3, max_num_batched_tokens=8, enable_prefix_caching=True,
              kv_cache_memory_bytes=1 << 20)
    prefix, *others = prompts(0, (13, 2, 19, 3))
    first = [prefix + others[0], others[1], others[2]]  # 8 tokens a step: the 15 and 19 token prompts in chunks
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(first, params, use_tqdm=False)
    second = [prefix + [5, 6, 7]]  # the prefix's 3 full blocks come from the prefix cache
    outs += llm.generate(second, params, use_tqdm=False)
    assert outs[-1].num_cached_tokens == 12
    for prompt, out in zip(first + second, outs):
        assert out.finish_reason == "length" and out.token_ids == greedy_full_recompute(model, prompt, MAX_TOKENS)
    assert llm.engine.kv_cache.all_blocks_free()

    caches = llm.engine.runner.cache_tensors  # the runner owns them; the model holds the same tensors
    assert list(caches) == [GROUP] and caches[GROUP][0] is model.k_cache and caches[GROUP][1] is model.v_cache
    assert caches[GROUP][0].shape[1:] == (4, 1, 8)  # [blocks, block_size, 1, head_dim]


def test_prefill_logits_rebinds_and_an_engine_over_other_caches_refuses_to_run():
    model = ToyCausalLM().eval()
    llm = LLM(model, tokenizer(), block_size=4, max_num_seqs=2, kv_cache_memory_bytes=1 << 20)
    ps = prompts(1, (7, 20))
    torch.testing.assert_close(prefill_logits(model, ps, block_size=4),
                               torch.cat([model.full_logits(p) for p in ps]), atol=1e-5, rtol=1e-5)
    out = llm.generate([ps[0]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert out.finish_reason == "error" and "reallocated by another engine" in out.error


def test_bind_caches_refuses_what_the_model_cannot_read():
    model = ToyCausalLM()
    tensors = allocate_cache_tensors(model.cache_tensor_specs(), {GROUP: 3}, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="one block table"):
        model.bind_caches(tensors, tables={K: K})
    with pytest.raises(ValueError, match="missing or unknown"):
        model.bind_caches({K: tensors[K]})
    model.bind_caches(tensors, tables={K: "page", V: "page"})  # any one table: it reads "page"
    assert model.table == "page" and model.k_cache is tensors[K]


def test_cache_tensors_are_allocated_sized_and_listed_from_the_specs():
    specs = [CacheTensorSpec("a", "full", 8), CacheTensorSpec("b", "win", 6, window=4),
             CacheTensorSpec("c", "full", 4, tokens_per_row=4)]
    tensors = allocate_cache_tensors(specs, {"full": 3, "win": 2}, 16, torch.bfloat16, "cpu")
    assert {n: tuple(t.shape) for n, t in tensors.items()} == {"a": (3, 16, 1, 8), "b": (2, 16, 1, 6),
                                                               "c": (3, 4, 1, 4)}
    assert all(t.dtype == torch.bfloat16 and not t.any() for t in tensors.values())
    by_group = tensors_by_group(specs, tensors)
    assert list(by_group) == ["full", "win"] and by_group["full"][1] is tensors["c"]
    per_block = cache_bytes_per_block(specs, 16, torch.bfloat16)  # arithmetic, equal to the allocation's
    assert per_block == {g: sum(t[:1].nbytes for t in ts) for g, ts in by_group.items()} == {"full": 288, "win": 192}
    with pytest.raises(ValueError, match=r"groups without a block count: \['win'\]"):
        allocate_cache_tensors(specs, {"full": 3}, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="whole rows"):
        cache_bytes_per_block(specs, 6, torch.float32)


def test_the_engine_sizes_the_cache_from_the_specs_without_allocating():
    from common.engine import EngineConfig

    model = ToyCausalLM()
    config = EngineConfig(block_size=4, max_num_seqs=2, kv_cache_memory_bytes=4096, max_model_len=256)
    per_block = 2 * 4 * 8 * 4  # K and V: 4 rows of 8 fp32 each
    assert blocks_that_fit(model, config) == {GROUP: 4096 // per_block} and model.k_cache is None


ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("NPU_COOKBOOK_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
VLLM_DRIVER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[3])  # tests/engine: the toy model
    from vllm import LLM, ModelRegistry, SamplingParams
    from npu_cookbook_vllm.recipe_model import RecipeForCausalLM
    from contract_toy_model import ToyCausalLM

    class ToyForCausalLM(RecipeForCausalLM):
        family = "toy"

        def build_model(self, config):
            return ToyCausalLM(config["vocab_size"], config["hidden_size"], config["num_attention_heads"],
                               config["max_position_embeddings"])

        def load_into(self):
            pass  # the toy's weights come from its seed

    ModelRegistry.register_model("ToyForCausalLM", ToyForCausalLM)
    batches, checkpoint, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[4]
    llm = LLM(model=checkpoint, dtype="float32", enforce_eager=True, skip_tokenizer_init=True, max_num_seqs=4,
              block_size=16, max_num_batched_tokens=32, enable_chunked_prefill=True, enable_prefix_caching=True,
              kv_cache_memory_bytes=16 << 20, disable_log_stats=False)
    params = SamplingParams(temperature=0, max_tokens=%(new)d, ignore_eos=True, detokenize=False)
    tokens = [list(o.outputs[0].token_ids) for batch in batches  # a batch after the last one's requests
              for o in llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)]
    hits = [m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits"]
    json.dump({"tokens": tokens, "prefix_cache_hits": hits}, open(out, "w"))
    llm.llm_engine.engine_core.shutdown()
""") % {"new": MAX_TOKENS}


def vllm_missing() -> str | None:
    if not VLLM_PYTHON.exists():
        return f"no vLLM environment at {VLLM_PYTHON}"
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import npu_cookbook_vllm.recipe_model"], capture_output=True,
                           timeout=120)
    return None if probe.returncode == 0 else f"{VLLM_PYTHON} lacks vLLM or the plugin (recipes/deepseek/vllm_plugin)"


@pytest.mark.slow
def test_vllm_runs_a_contract_only_model_through_the_plugin_adapter(tmp_path):
    if reason := vllm_missing():
        pytest.skip(reason)
    model = ToyCausalLM().eval()
    config = {"architectures": ["ToyForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": 32,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 8, "num_hidden_layers": 1,
              "intermediate_size": 64, "max_position_embeddings": 256,
              "torch_dtype": "float32"}  # model_type llama: a config vLLM parses
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "config.json").write_text(json.dumps(config))
    (tmp_path / "driver.py").write_text(VLLM_DRIVER)
    long, short = prompts(2, (40, 3))  # 40 tokens over a 32-token step budget: a chunked prefill
    batches = [[long, short], [long[:35] + [50, 51, 52]]]  # the second hits the first's two full 16-token blocks
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "VLLM_CPU_KVCACHE_SPACE")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_USE_USAGE_LIB="0",
               VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")  # in process: the toy is registered here only
    run = subprocess.run([str(VLLM_PYTHON), str(tmp_path / "driver.py"), json.dumps(batches), str(tmp_path / "toy"),
                          str(Path(__file__).parent), str(tmp_path / "out.json")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["prefix_cache_hits"] == [32]
    want = [greedy_full_recompute(model, p, MAX_TOKENS) for batch in batches for p in batch]
    assert report["tokens"] == want
