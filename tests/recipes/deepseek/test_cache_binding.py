"""bind_caches (common/engine/model_contract.py): DeepseekV4 takes caches another block manager owns (vLLM's, through
the plugin) with every cache tensor in its own block table and block size, reads each through its own table, and
computes what it computes over the engine's caches (one block size, one table per group); DeepseekV3 reads every
tensor through its one latent table and refuses any other."""
import pytest
import torch

from common.engine.forward_batch import ForwardBatch
from common.engine.model_runner import prefill_logits
from config_deepseek_v3 import ModelArgs as V3Args
from config_deepseek_v4 import ModelArgs
from modeling_deepseek_v3 import LATENT, DeepseekV3
from modeling_deepseek_v4 import DeepseekV4
from tiny_deepseek_v3 import tiny_config
from tiny_deepseek_v4 import TINY_CONFIG


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = DeepseekV4(ModelArgs.from_config(TINY_CONFIG)).float().eval()
    for p in m.parameters():
        p.data.normal_(0, 0.2)
    return m


def per_tensor_batch(model: DeepseekV4, prompts: list[list[int]], tokens_per_block: dict[str, int]) -> ForwardBatch:
    """Whole prompts in one step, each cache tensor in blocks of its own tokens_per_block[name] tokens (fresh,
    contiguous, block 0 null), read through a table of its own named after it; the tensors bound."""
    tables, slots, tensors = {}, {}, {}
    lens = [len(p) for p in prompts]
    positions = torch.cat([torch.arange(n) for n in lens])
    seq_ids = torch.repeat_interleave(torch.arange(len(prompts)), torch.tensor(lens))
    for spec in model.cache_tensor_specs():
        bs = tokens_per_block[spec.name]
        blocks = [-(-n // bs) for n in lens]
        table = torch.zeros(len(prompts), max(blocks), dtype=torch.int32)
        start = 1
        for b, k in enumerate(blocks):
            table[b, :k] = torch.arange(start, start + k)
            start += k
        tables[spec.name] = table
        slots[spec.name] = table[seq_ids, positions // bs].long() * bs + positions % bs
        tensors[spec.name] = torch.zeros(start, spec.rows_per_block(bs), 1, spec.width)
    model.bind_caches(tensors, tables={name: name for name in tensors})
    cu = torch.zeros(len(prompts) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return ForwardBatch(input_ids=torch.tensor([t for p in prompts for t in p]), positions=positions, seq_ids=seq_ids,
                        cu_seqlens_q=cu, seq_lens=torch.tensor(lens, dtype=torch.int32), block_size=0,
                        block_tables=tables, slot_mapping=slots, max_seqlen_q=max(lens), max_seqlen_k=max(lens))


@torch.no_grad()
def test_per_tensor_block_sizes_equal_one_block_size(model):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (40, 300)]
    expected = prefill_logits(model, prompts, block_size=16)
    # the plugin's equal pages for the tiny model at vLLM's block_size 256: 256 tokens of ratio-4 entries (32 wide,
    # one per 4 tokens) = 2048 elements; window KV 64 tokens a block, ratio-4 states 16, the ratio-8 state 32,
    # ratio-4 entries 256, ratio-8 entries 512
    page = 256 * 32 // 4
    sizes = {s.name: page * s.tokens_per_row // s.width for s in model.cache_tensor_specs()}
    assert sorted(set(sizes.values())) == [16, 32, 64, 256, 512]
    got = model.compute_logits(model(per_tensor_batch(model, prompts, sizes)))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_bind_caches_refuses_missing_and_misshapen_tensors(model):
    specs = model.cache_tensor_specs()
    tensors = {s.name: torch.zeros(2, 16 // s.tokens_per_row, 1, s.width) for s in specs}
    with pytest.raises(ValueError, match="missing or unknown"):
        model.bind_caches({k: v for k, v in tensors.items() if k != specs[0].name})
    with pytest.raises(ValueError, match=r"expected \[blocks, rows, 1, "):
        model.bind_caches({**tensors, specs[0].name: torch.zeros(2, 16, 1, specs[0].width + 1)})


def test_v3_reads_every_tensor_through_the_latent_table():
    model = DeepseekV3(V3Args.from_config(tiny_config("v32")))
    specs = model.cache_tensor_specs()
    tensors = {s.name: torch.zeros(2, 16, 1, s.width) for s in specs}
    model.bind_caches(tensors, tables={s.name: LATENT for s in specs})
    assert model.model.layers[0].self_attn.kv_cache is tensors[specs[0].name]  # kept, not copied
    with pytest.raises(ValueError, match="through the 'latent' block table"):
        model.bind_caches(tensors, tables={specs[0].name: specs[0].name})
