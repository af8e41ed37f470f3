"""2 gloo ranks == 1 rank: CFG parallel vs the batched CFG, MoE expert parallel, attention tensor parallel."""
import pytest
import torch
from dist_helpers import run_ranks
from transformers import PreTrainedTokenizerFast

from common import parallel
from pipeline_hunyuan_image import HunyuanImage3Pipeline
from weights_hunyuan_image import load_model, special_token_ids


def _generate(model, path, cfg_group=None):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    pipe = HunyuanImage3Pipeline(model, tokenizer, special_token_ids(tokenizer), cfg_group=cfg_group)
    return pipe("a red fox in the snow", (48, 64), num_inference_steps=2, guidance_scale=4.0, seed=7,
                progress=False, decode=False).latents


def _check_all(path: str) -> None:
    """One spawn for the three checks (each costs seconds of imports): the two ranks form one group, which serves
    as the cfg, the ep and the tp group in turn (the same two ranks each layout would group)."""
    par = parallel.init_parallel(parallel.ParallelLayout(tp=2), timeout_s=60)
    try:
        pair = par.group("tp")
        single = load_model(path, with_vae=False)
        want = _generate(single, path)  # one rank, CFG batched [cond ; uncond]

        got = _generate(single, path, cfg_group=pair)  # CFG parallel: this rank runs cond or uncond
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

        ep = load_model(path, ep_group=pair, with_vae=False)  # MoE expert parallel: 2 of 4 experts per rank
        experts = ep.model.layers[0].mlp.experts
        assert experts.num_local == 2 and experts.first == 2 * par.rank
        x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0))  # 7 tokens: uneven runs of 4 / 3
        for layer, ref in zip(ep.model.layers, single.model.layers):
            torch.testing.assert_close(layer.mlp(x), ref.mlp(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(_generate(ep, path), want, rtol=1e-5, atol=1e-5)

        tp = load_model(path, tp_group=pair, with_vae=False)  # attention TP: one of the 2 kv groups per rank
        assert tp.model.layers[0].self_attn.kv_heads == 1
        torch.testing.assert_close(_generate(tp, path), want, rtol=1e-5, atol=1e-5)
    finally:
        parallel.destroy_parallel()


@pytest.mark.slow
def test_two_ranks_equal_one_cfg_ep_tp(tiny_path):
    run_ranks(_check_all, 2, str(tiny_path))
