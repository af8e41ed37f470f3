"""The pipeline on the tiny model set: offload, TI2V, CFG wiring, SR stage, shapes."""
import numpy as np
import pytest
import torch
from PIL import Image

from modeling_magihuman import patchify
from pipeline_magihuman import MagiHumanPipeline, latent_shape

PROMPT = "a man says hello"


@pytest.fixture(scope="module")
def pipe(tiny_weights):
    return MagiHumanPipeline(tiny_weights, "cpu")


@pytest.fixture(scope="module")
def distilled(pipe):
    return pipe(PROMPT, mode="distill", seconds=0.4, size=(64, 64), seed=3)


def test_latent_shapes_follow_the_spec():
    assert latent_shape(5, 448, 256) == (126, 32, 16, 28)
    assert latent_shape(0.4, 64, 64) == (11, 3, 4, 4)
    assert latent_shape(5, 480, 270) == (126, 32, 16, 30)  # h = H // 16 // 2 * 2


def test_distilled_output_shapes(distilled):
    assert distilled.video.shape == (3, 9, 64, 64)  # 1 + 4 (T - 1) frames
    assert distilled.video_latent.shape == (48, 3, 4, 4) and distilled.audio_latent.shape == (11, 64)
    assert distilled.audio.shape == (2, round(11 * 2048 * 441 / 512))  # 51.2 kHz -> 44.1 kHz
    assert distilled.video.abs().max() <= 1 and distilled.video.std() > 0.01 and distilled.audio.std() > 0
    assert {"text", "denoise", "vae_decode", "audio_decode", "load"} <= set(distilled.timings)


def test_offload_keeps_one_stage_resident_and_changes_nothing(tiny_weights, distilled):
    pipe = MagiHumanPipeline(tiny_weights, "cpu", offload=True)
    out = pipe(PROMPT, mode="distill", seconds=0.4, size=(64, 64), seed=3)
    assert [resident for _, resident in pipe.models.history] == [[stage] for stage, _ in pipe.models.history]
    assert [stage for stage, _ in pipe.models.history] == ["text_encoder", "distill", "vae", "audio_vae"]
    assert pipe.models.resident() == [] and all(m is None for m in pipe.models.models.values())  # all freed
    assert torch.equal(out.video_latent, distilled.video_latent) and torch.equal(out.audio, distilled.audio)
    assert torch.equal(out.video, distilled.video)


def test_without_offload_models_stay_loaded(pipe, distilled):
    assert {"text_encoder", "distill", "vae", "audio_vae"} <= set(pipe.models.resident())
    assert len(pipe.models.history[-1][1]) > 1


def test_ti2v_keeps_the_clean_image_latent_in_frame_0(pipe, distilled):
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (48, 80, 3), dtype=np.uint8))  # other aspect: resized + cropped
    out = pipe(PROMPT, mode="distill", seconds=0.4, size=(64, 64), seed=3, image=image)
    frame0 = pipe.encode_image(image, 64, 64)  # [48, 1, 4, 4]
    assert frame0.shape == (48, 1, 4, 4)
    torch.testing.assert_close(out.video_latent[:, :1], frame0)
    assert not torch.allclose(out.video_latent[:, 1:], distilled.video_latent[:, 1:])  # conditioning reached the rest


def test_cfg_with_the_prompt_as_negative_is_plain_guidance_free(pipe):
    dit = pipe.models.models.get("base") or pipe.models._bring("base")
    text, other = pipe.encode_text([PROMPT, "rain on a window"])
    gen = torch.Generator().manual_seed(0)
    video, audio = torch.randn(48, 2, 4, 4, generator=gen), torch.randn(5, 64, generator=gen)
    plain = pipe.denoise_unipc(dit, video, audio, text, 5)
    same = pipe.denoise_unipc(dit, video, audio, text, 5, negative=text)
    guided = pipe.denoise_unipc(dit, video, audio, text, 5, negative=other)
    for a, b in zip(plain, same):
        torch.testing.assert_close(a, b)
    assert not torch.allclose(plain[0], guided[0], atol=1e-3)


def test_base_mode_runs_32_steps_with_cfg(pipe):
    dit = pipe.models._bring("base")
    lengths = []
    hook = dit.register_forward_hook(lambda module, args, out: lengths.append(args[2].shape[0]))  # text tokens seen
    try:
        out = pipe(PROMPT, mode="base", seconds=0.2, size=(64, 64), seed=1, negative_prompt="blur, noise")
    finally:
        hook.remove()
    cond, uncond = (len(t) for t in pipe.encode_text([PROMPT, "blur, noise"]))
    assert cond != uncond and len(lengths) == 64  # 32 steps x (cond, uncond)
    assert lengths[0::2] == [cond] * 32 and lengths[1::2] == [uncond] * 32
    assert out.video.shape == (3, 5, 64, 64) and torch.isfinite(out.video_latent).all()


def test_sr_upsamples_and_keeps_the_base_audio(pipe, distilled):
    out = pipe(PROMPT, mode="sr540", seconds=0.4, size=(64, 64), seed=3, negative_prompt="blur")  # SR has CFG
    assert out.video.shape == (3, 9, 128, 128) and out.video_latent.shape == (48, 3, 8, 8)
    torch.testing.assert_close(out.audio_latent, distilled.audio_latent)  # the final audio is the base stage's
    hd = pipe(PROMPT, mode="sr1080", seconds=0.4, size=(64, 64), seed=3, sr_size=(96, 64),
              negative_prompt="blur")  # the local-attention model
    assert hd.video.shape == (3, 9, 64, 96) and torch.isfinite(hd.video_latent).all()
    assert patchify(hd.video_latent).shape == (3 * 2 * 3, 192)


def test_text_encoder_loads_from_the_encoder_decoder_release(tiny_weights, tmp_path):
    """The real text_encoder/ is the whole T5Gemma 9B-9B checkpoint: only its encoder is loaded, unchanged."""
    import shutil

    from transformers import T5GemmaConfig, T5GemmaForConditionalGeneration

    module = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=16)
    full = T5GemmaForConditionalGeneration(T5GemmaConfig(encoder=module, decoder=module, vocab_size=320)).eval()
    weights = tmp_path / "w"
    weights.mkdir()
    full.save_pretrained(weights / "text_encoder")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_weights / "text_encoder" / name, weights / "text_encoder" / name)
    pipe = MagiHumanPipeline(weights, "cpu", dtype=torch.float32)
    encoder = pipe.models._bring("text_encoder")
    reference = full.get_encoder().state_dict()
    loaded = encoder.encoder.state_dict()
    assert loaded.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(loaded[name], tensor), name
    ids = torch.tensor([[2, 40, 41, 42]])
    with torch.no_grad():
        torch.testing.assert_close(encoder(input_ids=ids).last_hidden_state,
                                   full.get_encoder()(input_ids=ids).last_hidden_state)
