"""Prefix-KV reuse == full recompute, image_size="auto", CFG batch, the VAE round trip shapes."""
import torch

from pipeline_hunyuan_image import HunyuanImage3Pipeline, ImageDenoiser
from scheduler_hunyuan_image import make_scheduler
from sequence_hunyuan_image import build_sequence, resolution_buckets


def test_kv_reuse_step_equals_full_recompute(model, tokenizer, special):
    seq = build_sequence(tokenizer, special, "a cat on a red mat", ratio_index=16, h=3, w=4, cfg=True)
    g = torch.Generator().manual_seed(0)
    x0, x1 = torch.randn(2, 16, 3, 4, generator=g), torch.randn(2, 16, 3, 4, generator=g)
    t0, t1 = torch.full((2,), 1000.0), torch.full((2,), 612.5)
    cached = ImageDenoiser(model, seq, block_size=8)
    cached.velocity(x0, t0)  # step 0: the full sequence fills the cache
    prefix = [k[:, :].clone() for k, _ in cached.cache.layers]
    reused = cached.velocity(x1, t1)  # only <timestep> + 12 image tokens
    full = ImageDenoiser(model, seq, block_size=8).velocity(x1, t1)  # full recompute of that step
    torch.testing.assert_close(reused, full, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(reused, cached.velocity(x0, t0))  # the step depends on its latents / timestep
    bt, bs = cached.cache.block_tables, cached.cache.block_size
    for (k, _), before in zip(cached.cache.layers, prefix):  # the text prefix K never changed
        for b in range(2):
            rows = bt[b, torch.arange(seq.timestep_pos) // bs].long() * bs + torch.arange(seq.timestep_pos) % bs
            torch.testing.assert_close(k.flatten(0, 1)[rows], before.flatten(0, 1)[rows], rtol=0, atol=0)


def test_loop_with_reuse_equals_loop_without(model, tokenizer, special):
    pipe = HunyuanImage3Pipeline(model, tokenizer, special)
    a = pipe("a cat", (48, 32), num_inference_steps=3, guidance_scale=4.0, seed=3, progress=False, decode=False)
    b = pipe("a cat", (48, 32), num_inference_steps=3, guidance_scale=4.0, seed=3, progress=False, decode=False,
             kv_reuse=False)
    assert a.latents.shape == (1, 16, 3, 2)
    torch.testing.assert_close(a.latents, b.latents, rtol=1e-5, atol=1e-5)


def test_cfg_combines_cond_and_uncond(model, tokenizer, special):
    """guidance 1 (no CFG, cond only) differs from guidance 4; the CFG batch's cond row is the no-CFG run."""
    pipe = HunyuanImage3Pipeline(model, tokenizer, special)
    seq = build_sequence(tokenizer, special, "a dog", 16, 2, 2, cfg=True)
    x, t = torch.randn(1, 16, 2, 2, generator=torch.Generator().manual_seed(2)), make_scheduler(2).timesteps[:1]
    v = ImageDenoiser(model, seq).velocity(x.expand(2, -1, -1, -1), t.expand(2))
    cond_only = ImageDenoiser(model, build_sequence(tokenizer, special, "a dog", 16, 2, 2, cfg=False)).velocity(x, t)
    torch.testing.assert_close(v[:1], cond_only, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(v[0], v[1])  # the <cfg> row is a different prediction
    one = pipe("a dog", (32, 32), 2, guidance_scale=1.0, seed=1, progress=False, decode=False).latents
    four = pipe("a dog", (32, 32), 2, guidance_scale=4.0, seed=1, progress=False, decode=False).latents
    assert not torch.allclose(one, four)


def test_auto_image_size_reads_the_ratio_token(model, tokenizer, special):
    pipe = HunyuanImage3Pipeline(model, tokenizer, special)
    assert pipe.predict_ratio("a cat") == 16  # the random head does not pick a ratio token: falls back to 1:1
    r = torch.randn(64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():  # only two live rows: <img_ratio_3> = r, <img_ratio_4> = -r; one of them wins
        model.lm_head.weight.zero_()
        model.lm_head.weight[special["ratio_3"]], model.lm_head.weight[special["ratio_4"]] = r, -r
    first = pipe.predict_ratio("a cat")
    assert first in (3, 4)
    with torch.no_grad():
        model.lm_head.weight[special["ratio_3"]], model.lm_head.weight[special["ratio_4"]] = -r, r
    assert pipe.predict_ratio("a cat") == 7 - first  # flipping the rows flips the choice
    if first == 3:  # back to the rows that pick <img_ratio_3>
        with torch.no_grad():
            model.lm_head.weight[special["ratio_3"]], model.lm_head.weight[special["ratio_4"]] = r, -r
    k, (H, W) = pipe.resolve_size("a cat", "auto")
    bh, bw = resolution_buckets(64, 4)[3]
    assert k == 3 and H % 16 == 0 and W % 16 == 0 and abs(H / W - bh / bw) < 0.35 and H < W


def test_vae_encode_decode_shapes(model):
    image = torch.rand(1, 3, 64, 48) * 2 - 1
    z = model.vae.encode(image)
    assert z.shape == (1, 16, 4, 3)
    out = model.vae.decode(z)
    assert out.shape == (1, 3, 64, 48) and out.abs().max() <= 1
    sampled = model.vae.encode(image, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == z.shape and not torch.equal(sampled, z)
