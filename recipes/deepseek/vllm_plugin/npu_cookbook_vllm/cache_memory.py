"""How much cache one sequence holds: the recipe's engine vs vLLM with this plugin's cache specs, each counted by
its own block manager (the recipe's common.kv_cache.KVCacheManager; vLLM's KVCacheManager over the groups and
pages vLLM's own get_kv_cache_groups makes of the specs), after N tokens, at a decode step. A third column gives
every cache tensor one plain per-token spec in one group (what vLLM would hold without sliding-window and
compressed specs). Nothing is allocated: the model is built on the meta device, the managers count blocks.

Run in the vLLM environment:
  .venv-vllm/bin/python -m npu_cookbook_vllm.cache_memory --model flash --tokens 4096 65536 1048576
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config, get_kv_cache_config_from_groups,
                                         get_kv_cache_groups, resolve_kv_cache_block_sizes)
from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs
from vllm.v1.request import Request

from common.kv_cache import KVCacheManager, cache_bytes_per_block

from .cache import equal_page_specs
from .recipe_model import RECIPE_DIR  # noqa: F401  (puts the recipe folder on sys.path)

from config_deepseek_v4 import ModelArgs  # noqa: E402,I001
from modeling_deepseek_v4 import DeepseekV4  # noqa: E402
from weights_deepseek_v4 import torch_default_dtype  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def meta_model(model: str, dtype: torch.dtype) -> DeepseekV4:
    """"flash": the V4-Flash shape (ModelArgs' defaults); "tiny": the tiny checkpoint's; else a config.json path."""
    if model == "flash":
        args = ModelArgs()
    elif model == "tiny":
        from tiny_deepseek_v4 import TINY_CONFIG
        args = ModelArgs.from_config(TINY_CONFIG)
    else:
        args = ModelArgs.from_config(json.loads(Path(model).read_text()))
    with torch_default_dtype(dtype), torch.device("meta"):
        return DeepseekV4(args)


def engine_bytes(model: DeepseekV4, block_size: int, num_tokens: int) -> int:
    """Bytes the recipe's engine holds for one sequence of num_tokens at its next decode step."""
    specs = model.cache_specs(block_size)
    per_block = cache_bytes_per_block(model.cache_tensor_specs(), block_size, model.engine_contract().dtype)
    manager = KVCacheManager(specs, {s.name: num_tokens // block_size + 3 for s in specs}, False)
    tokens = [0] * (num_tokens + 1)
    assert manager.allocate("r", tokens, 0, num_tokens) and manager.allocate("r", tokens, num_tokens, 1)
    return sum(sum(b != 0 for b in blocks) * per_block[g] for g, blocks in manager.block_table("r").items())


def vllm_bytes(specs: dict, block_size: int, num_tokens: int) -> tuple[int, int]:
    """(bytes vLLM's KV cache manager holds for one sequence of num_tokens at its next decode step, its number of
    cache groups), with the groups and the page vLLM makes of `specs` (the layer-outer layout the plugin uses)."""
    config = VllmConfig()
    config.cache_config.kv_cache_layout, config.cache_config.block_size = "LBNHC", block_size
    groups = get_kv_cache_groups(config, dict(specs))
    per_block = max(g.kv_cache_spec.page_size_bytes * (1 if isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs)
                                                       else len(g.layer_names)) for g in groups)
    num_blocks = sum(-(-(num_tokens + 2) // g.kv_cache_spec.block_size) + 2 for g in groups)  # a one-step prefill
    kv_config = get_kv_cache_config_from_groups(config, groups, num_blocks * per_block)
    scheduler_block, hash_block = resolve_kv_cache_block_sizes(kv_config, config)
    manager = VllmKVCacheManager(generate_scheduler_kv_cache_config([kv_config]), max_model_len=num_tokens + 2, scheduler_block_size=scheduler_block,
                                 hash_block_size=hash_block, enable_caching=False)
    request = Request("r", [0] * num_tokens, SamplingParams(max_tokens=2), None)
    assert manager.allocate_slots(request, num_tokens) is not None
    request.num_computed_tokens = num_tokens
    request.append_output_token_ids(0)
    assert manager.allocate_slots(request, 1) is not None
    pool = manager.block_pool
    held = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # the null block is never free
    per_block = kv_config.kv_cache_tensors[0].size // kv_config.num_blocks
    return held * per_block, len(groups)


def per_token_specs(model: DeepseekV4, block_size: int, dtype: torch.dtype) -> dict:
    """Every cache tensor a plain per-token FullAttentionSpec (its bytes spread over the tokens), one group."""
    return {t.name: FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=t.width // t.tokens_per_row,
                                      head_size_v=0, dtype=dtype) for t in model.cache_tensor_specs()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="flash", help="flash (V4-Flash shape), tiny, or a config.json")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--block-size", type=int, default=256, help="vLLM's block_size (its CPU platform forces 256 "
                   "for DeepSeek-V4) and the recipe engine's")
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 65536, 1048576])
    p.add_argument("--json", type=Path, help="also write the rows here")
    a = p.parse_args(argv)
    dtype = DTYPES[a.dtype]
    model = meta_model(a.model, dtype)
    specs = equal_page_specs(model.cache_tensor_specs(), a.block_size, dtype)
    sizes = sorted({s.block_size for s in specs.values()})
    print(f"{a.model}, {a.dtype}, block_size {a.block_size}: plugin specs' block sizes {sizes} tokens")
    mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
    print("| tokens | recipe engine | vLLM + plugin (groups) | ratio | one per-token spec | ratio |")
    print("|---|---|---|---|---|---|")
    rows = []
    for n in a.tokens:
        engine = engine_bytes(model, a.block_size, n)
        plugin, groups = vllm_bytes(specs, a.block_size, n)
        flat, _ = vllm_bytes(per_token_specs(model, a.block_size, dtype), a.block_size, n)
        rows.append(dict(tokens=n, engine=engine, plugin=plugin, groups=groups, per_token=flat))
        print(f"| {n:,} | {mib(engine)} | {mib(plugin)} ({groups}) | {plugin / engine:.2f}x | {mib(flat)} | "
              f"{flat / engine:.1f}x |", flush=True)
    if a.json:
        a.json.write_text(json.dumps(dict(block_sizes=sizes, rows=rows)))


if __name__ == "__main__":
    main()
