"""The recipe's DeepSeek-V4 against transformers.DeepseekV4ForCausalLM on the same tiny checkpoint, fp32.

The tiny config has every layer kind (sliding, CSA, HCA) and both MoE kinds (hash, top-k), with compress
rates 4 / 8 and a window of 8, so the prompts below span several compressed groups. index_topk (64) is at
least the number of compressed entries of every prompt here, so the indexer's top-k keeps every visible
entry and exact score ties cannot change the selection between the two implementations.
"""
import pytest
import torch
from transformers import DeepseekV4ForCausalLM

from common.engine.model_runner import prefill_logits
from common.loader import Checkpoint, save_checkpoint
from tiny_deepseek_v4 import write_tiny_checkpoint
from weights_deepseek_v4 import load_model

PROMPT_LENGTHS = (5, 13, 37)  # shorter than the window, a few groups, several windows


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The publisher's layout (written by the recipe; transformers converts it on load), the transformers
    layout (its module names, as in its state_dict) and what transformers' save_pretrained writes back."""
    root = tmp_path_factory.mktemp("dsv4")
    publisher = write_tiny_checkpoint(root / "publisher", seed=3, quantized=False, index_topk=64,
                                      vision=False)  # transformers has no vision tower

    reference = DeepseekV4ForCausalLM.from_pretrained(publisher, dtype=torch.float32).eval()
    save_checkpoint(root / "transformers", dict(reference.state_dict()), Checkpoint(publisher).config)
    reference.save_pretrained(root / "save_pretrained")
    return {name: root / name for name in ("publisher", "transformers", "save_pretrained")}, reference


def _prompts(n_vocab):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, n_vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("layout", ["publisher", "transformers", "save_pretrained"])
def test_full_sequence_logits_match_transformers(checkpoints, layout):
    paths, reference = checkpoints
    model = load_model(paths[layout], dtype=torch.float32)
    assert model.args.sliding_window < max(PROMPT_LENGTHS)
    with torch.no_grad():
        for ids in _prompts(model.args.vocab_size):
            expected = reference(torch.tensor([ids])).logits[0]  # [L, V]
            got = prefill_logits(model, [ids])
            assert (got - expected).abs().max().item() < 1e-4, f"{layout}, prompt length {len(ids)}"


def test_transformers_layout_is_really_the_other_naming(checkpoints):
    paths, _ = checkpoints
    names = Checkpoint(paths["transformers"]).names()
    assert all(n.startswith(("model.", "lm_head.")) for n in names)
    assert any(".mlp.experts.gate_up_proj" in n for n in names)
    assert "embed.weight" in Checkpoint(paths["publisher"]).names()


def test_packed_batch_equals_one_sequence_at_a_time(checkpoints):
    paths, _ = checkpoints
    model = load_model(paths["publisher"], dtype=torch.float32)
    prompts = _prompts(model.args.vocab_size)
    with torch.no_grad():
        packed = prefill_logits(model, prompts)
        alone = torch.cat([prefill_logits(model, [p]) for p in prompts])
    torch.testing.assert_close(packed, alone, atol=1e-4, rtol=1e-5)  # fp32 GEMM blocking differs with T
