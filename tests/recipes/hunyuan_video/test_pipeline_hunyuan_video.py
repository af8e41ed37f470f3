"""The HunyuanVideo pipeline against diffusers' HunyuanVideoPipeline on the same tiny checkpoint (fp32): text
encoders, the whole text -> latents -> video run (plain and with true CFG), and the step-cache switch."""
import pytest
import torch
from diffusers import (
    AutoencoderKLHunyuanVideo,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideoPipeline as DiffusersPipeline,
    HunyuanVideoTransformer3DModel,
)
from pipeline_hunyuan_video import MODEL_DIR, HunyuanVideoPipeline
from safetensors.torch import load_file
from sampling_hunyuan_video import SamplingConfig
from text_encoder_hunyuan_video import PROMPT_TEMPLATE
from tiny_hunyuan_video import write_tiny_checkpoint
from vae_hunyuan_video import diffusers_config as vae_diffusers_config
from weights_hunyuan_video import diffusers_config, publisher_to_diffusers

from common.loader import Checkpoint

PROMPT = "A cat walks on the grass, realistic style."


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("hv") / "hunyuan-video-tiny")


@pytest.fixture(scope="module")
def ours(root):
    return HunyuanVideoPipeline.from_pretrained(root, torch.float32)


@pytest.fixture(scope="module")
def reference(root, ours):
    """diffusers' pipeline over the same weights: DiT converted from the publisher's names, VAE as saved."""
    ckpt = Checkpoint(root / MODEL_DIR / "transformers")
    transformer = HunyuanVideoTransformer3DModel(**diffusers_config(ours.transformer.config)).eval()
    transformer.load_state_dict(publisher_to_diffusers({n: ckpt.get(n) for n in ckpt.names()}), strict=True)
    vae = AutoencoderKLHunyuanVideo(**vae_diffusers_config(ours.vae.config)).eval()
    vae.load_state_dict(load_file(root / MODEL_DIR / "vae" / "model.safetensors"), strict=True)
    te = ours.text_encoders
    return DiffusersPipeline(tokenizer=te.tokenizer, text_encoder=te.text_encoder, transformer=transformer, vae=vae,
                             scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=te.text_encoder_2,
                             tokenizer_2=te.tokenizer_2)


def template(ours):
    return {"template": PROMPT_TEMPLATE, "crop_start": ours.text_encoders.crop_start}


@torch.no_grad()
def test_text_encoders_match_diffusers(ours, reference):
    prompts = [PROMPT, "hi"]
    states, mask, pooled = ours.text_encoders.encode(prompts)
    ref_states, ref_pooled, ref_mask = reference.encode_prompt(prompts, prompt_template=template(ours),
                                                               device="cpu", dtype=torch.float32)
    assert states.shape == (2, 256, ours.transformer.config.text_states_dim)
    assert mask.sum(1).tolist()[1] < mask.sum(1).tolist()[0]  # padding is masked
    torch.testing.assert_close(states, ref_states, rtol=0, atol=0)
    torch.testing.assert_close(pooled, ref_pooled, rtol=0, atol=0)
    assert torch.equal(mask, ref_mask)


def run_reference(reference, ours, cfg: SamplingConfig, **extra):
    out = reference(prompt=PROMPT, height=cfg.height, width=cfg.width, num_frames=cfg.video_length,
                    num_inference_steps=cfg.infer_steps, guidance_scale=cfg.embedded_guidance,
                    generator=torch.Generator().manual_seed(cfg.seed), prompt_template=template(ours),
                    output_type="pt", **extra).frames  # [1, T, 3, H, W] in [0, 1]
    return out[0].permute(1, 0, 2, 3) * 2 - 1  # [3, T, H, W] in [-1, 1]


@pytest.mark.parametrize("cfg", [
    SamplingConfig(height=32, width=48, video_length=5, infer_steps=3, seed=3),
    SamplingConfig(height=32, width=32, video_length=1, infer_steps=2, seed=4, true_cfg_scale=3.5,
                   negative_prompt="blurry, low quality"),
], ids=["embedded-guidance", "true-cfg"])
def test_pipeline_matches_diffusers(ours, reference, cfg):
    got = ours(PROMPT, cfg, progress=False)
    extra = {"true_cfg_scale": cfg.true_cfg_scale, "negative_prompt": cfg.negative_prompt} if cfg.true_cfg else {}
    want = run_reference(reference, ours, cfg, **extra)
    assert got.video.shape == want.shape == (3, cfg.video_length, cfg.height, cfg.width)
    assert got.computed_steps == [True] * cfg.infer_steps
    assert want.std() > 0.01  # not a flat video
    torch.testing.assert_close(got.video, want.clamp(-1, 1), rtol=1e-4, atol=1e-4)


def test_cache_none_equals_baseline_and_teacache_skips(ours):
    """A 10-step run: cache none is bit-identical to the loop without a cache; TeaCache at 0.15 skips steps and
    stays close to the uncached latents."""
    base = SamplingConfig(height=32, width=32, video_length=1, infer_steps=10, seed=5)
    text = ours.encode_prompt(PROMPT)
    noise = ours.prepare_latents(base)
    with torch.no_grad():
        scheduler, latents = ours.make_scheduler(base), noise
        guidance = torch.full((1,), base.embedded_guidance * 1000.0)
        for t in scheduler.timesteps:  # the loop without any step cache
            pred = ours.transformer(latents, t.expand(1), **text, guidance=guidance)
            latents = scheduler.step(pred, t, latents, return_dict=False)[0]
    plain, computed = ours.denoise(text, None, base, noise, progress=False)
    assert computed == [True] * 10 and torch.equal(plain, latents)
    tea, computed = ours.denoise(text, None, SamplingConfig(**{**base.__dict__, "cache": "teacache"}), noise,
                                 progress=False)
    assert computed[0] and computed[-2:] == [True, True] and computed.count(False) >= 1
    assert not torch.equal(tea, plain) and (tea - plain).norm() < 0.5 * plain.norm()


def test_sampling_config_rejects_bad_values():
    for bad, match in [({"height": 40}, "multiples of 16"), ({"video_length": 6}, "4k \\+ 1"),
                       ({"infer_steps": 0}, "infer steps"), ({"cache": "magic"}, "cache"),
                       ({"true_cfg_scale": 0.5}, "true_cfg_scale")]:
        with pytest.raises(ValueError, match=match):
            SamplingConfig(**bad)
