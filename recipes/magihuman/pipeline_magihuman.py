"""daVinci-MagiHuman text(+image)-to-video+audio pipeline, read top to bottom in `__call__`:

    text (T5Gemma encoder) -> noise (audio first, then video) -> denoise with the base (32 UniPC steps, CFG) or
    distilled DiT (8 DDIM-style steps) -> optional latent super-resolution (upsample, re-noise, 5 UniPC steps with
    the SR DiT) -> decode video (Wan2.2 VAE) and audio (Oobleck VAE, 51.2 -> 44.1 kHz) -> frames at 25 fps + audio.

TI2V: the image's clean latent overwrites latent frame 0 before every step and after the last. Models live in
`StageModels`; with offload only the running stage's model is on the device.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from scipy.signal import resample_poly

from common import backend
from modeling_magihuman import build_inputs
from offload_magihuman import StageModels
from scheduler_magihuman import (AUDIO_CFG, BASE_STEPS, DISTILL_STEPS, SR_STEPS, cfg, distill_step, flow_sigmas,
                                 make_unipc, renoise, sr_video_guidance, video_guidance)
from weights_magihuman import load_dit

MODES = ("base", "distill", "sr540", "sr1080")
FPS, LATENT_RATE, AUDIO_HOP, SAMPLE_RATE = 25, 25, 2048, 44100  # 25 audio latents / s, 2048 samples each (51.2 kHz)
MAX_TEXT_TOKENS = 640
SR_MIX_NOISE = 0.7  # SR audio input: 0.7 eps + 0.3 base audio, held fixed
# Our short wording of the publisher's three groups (picture, sound, speech delivery); theirs is in
# inference/pipeline/video_generate.py and can be passed with --negative-prompt.
NEGATIVE_PROMPT = (
    "overexposed, blurred details, subtitles, static picture, worst quality, low quality, JPEG artifacts, deformed, "
    "extra fingers, poorly drawn hands and faces, messy background, many people in the background; noise, hiss, "
    "hum, clipping, distortion, muffled, echo, music, crowd noise; monotone, robotic, mumbling, slurred speech, "
    "stuttering, unnatural pauses, multiple speakers")


@dataclass
class Generation:
    video: torch.Tensor  # [3, F, H, W] in [-1, 1]
    audio: torch.Tensor  # [2, samples] in [-1, 1] at sample_rate
    video_latent: torch.Tensor  # [48, T, h, w] final (normalised) latent
    audio_latent: torch.Tensor  # [A, 64]
    timings: dict[str, float] = field(default_factory=dict)
    fps: int = FPS
    sample_rate: int = SAMPLE_RATE


def latent_shape(seconds: float, width: int, height: int) -> tuple[int, int, int, int]:
    """(A audio latents, T latent frames, h, w): A = 25 s + 1, T = (A-1)//4 + 1, h = H//16//2*2, w = W//16//2*2."""
    A = round(LATENT_RATE * seconds) + 1
    return A, (A - 1) // 4 + 1, height // 16 // 2 * 2, width // 16 // 2 * 2


def dit_name(mode: str) -> str:
    return "base" if mode == "base" else "distill"  # SR modes run the distilled model as base stage (Ascend configs)


class MagiHumanPipeline:
    def __init__(self, weights, device=None, offload: bool = False, dtype=None, vae_dtype=None):
        """dtype: default backend.default_dtype() (bf16 on NPU, as upstream, and where the CPU's oneDNN runs bf16;
        fp32 on AVX2-only CPUs). vae_dtype: default fp32 on the CPU, else `dtype`."""
        from transformers import AutoTokenizer

        dtype = dtype or backend.default_dtype()
        self.device = torch.device(device or backend.device())
        self.weights, self.dtype = Path(weights), dtype
        self.vae_dtype = vae_dtype or (torch.float32 if self.device.type == "cpu" else dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(self.weights / "text_encoder")
        loaders = {"text_encoder": self._load_text_encoder, "vae": self._load_vae, "audio_vae": self._load_audio_vae}
        for name in ("base", "distill", "540p_sr", "1080p_sr"):
            loaders[name] = lambda device, name=name: load_dit(self.weights / name, device, dtype)
        self.models = StageModels(loaders, self.device, offload)

    def _load_text_encoder(self, device):
        from transformers import T5GemmaEncoderModel

        return T5GemmaEncoderModel.from_pretrained(self.weights / "text_encoder", is_encoder_decoder=False,
                                                   dtype=self.dtype).to(device).eval()

    def _load_vae(self, device):
        from diffusers import AutoencoderKLWan

        return AutoencoderKLWan.from_pretrained(self.weights / "vae", torch_dtype=self.vae_dtype).to(device).eval()

    def _load_audio_vae(self, device):
        from diffusers import AutoencoderOobleck

        return AutoencoderOobleck.from_pretrained(self.weights / "audio_vae",
                                                  torch_dtype=self.vae_dtype).to(device).eval()

    # -- stages ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_text(self, prompts: list[str]) -> list[torch.Tensor]:
        """-> one [L, text_in] fp32 per prompt (unpadded T5Gemma states, at most 640 tokens, via fp16)."""
        out = []
        with self.models.use("text_encoder") as encoder:
            for prompt in prompts:
                ids = self.tokenizer(prompt, truncation=True, max_length=MAX_TEXT_TOKENS, return_tensors="pt")
                h = encoder(input_ids=ids.input_ids.to(self.device),
                            attention_mask=ids.attention_mask.to(self.device)).last_hidden_state[0]  # [L, C]
                out.append(h.half().float())
        return out

    def _vae_norm(self, vae) -> tuple[torch.Tensor, torch.Tensor]:
        mean = torch.tensor(vae.config.latents_mean, device=self.device).view(-1, 1, 1, 1)  # [48, 1, 1, 1]
        std = torch.tensor(vae.config.latents_std, device=self.device).view(-1, 1, 1, 1)
        return mean, std

    @torch.no_grad()
    def encode_image(self, image, height: int, width: int) -> torch.Tensor:
        """PIL image -> clean normalised latent of frame 0 [48, 1, h, w]: cover-resize, centre crop, [-1, 1]."""
        from PIL import Image

        image = image.convert("RGB")
        scale = max(width / image.width, height / image.height)
        size = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
        image = image.resize(size, Image.Resampling.BICUBIC)
        left, top = (size[0] - width) // 2, (size[1] - height) // 2
        image = image.crop((left, top, left + width, top + height))
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 127.5 - 1  # [3, H, W]
        with self.models.use("vae") as vae:
            x = pixels[None, :, None].to(self.device, self.vae_dtype)  # [1, 3, 1, H, W]
            mu = vae.encode(x).latent_dist.mode()[0].float()  # [48, 1, h, w]
            mean, std = self._vae_norm(vae)
        return (mu - mean) / std

    @torch.no_grad()
    def decode_video(self, latent: torch.Tensor) -> torch.Tensor:
        with self.models.use("vae") as vae:
            mean, std = self._vae_norm(vae)
            z = (latent * std + mean)[None].to(self.vae_dtype)  # [1, 48, T, h, w]
            return vae.decode(z).sample[0].float().clamp(-1, 1)  # [3, F, H, W]

    @torch.no_grad()
    def decode_audio(self, latent: torch.Tensor) -> torch.Tensor:
        """[A, 64] -> stereo [2, S] at 44.1 kHz: Oobleck decodes 2048 samples per latent (51.2 kHz), 441/512."""
        with self.models.use("audio_vae") as vae:
            wave = vae.decode(latent.T[None].to(self.vae_dtype)).sample[0].float()  # [2, A * 2048]
        wave = resample_poly(wave.cpu().numpy(), 441, 512, axis=-1)
        return torch.from_numpy(np.ascontiguousarray(wave)).float().clamp(-1, 1)

    @torch.no_grad()
    def denoise_distill(self, dit, video, audio, text, gen, frame0=None):
        """8 DDIM-style steps, no CFG: x0 = x - sigma v; x = sigma' eps_fresh + (1 - sigma') x0."""
        inp = build_inputs(dit.config, grid_of(video), audio.shape[0], text.shape[0], self.device)
        sigmas = [*flow_sigmas(DISTILL_STEPS).tolist(), 0.0]
        for sigma, sigma_next in zip(sigmas, sigmas[1:]):
            video = impose(video, frame0)
            v_video, v_audio = dit.velocity(video, audio, text, inp)
            video = distill_step(video, v_video, sigma, sigma_next, self.noise(video.shape, gen))
            audio = distill_step(audio, v_audio, sigma, sigma_next, self.noise(audio.shape, gen))
        return impose(video, frame0), audio

    @torch.no_grad()
    def denoise_unipc(self, dit, video, audio, text, steps, negative=None, video_scale=video_guidance, frame0=None,
                      audio_fixed=False):
        """Flow UniPC over `steps`; with `negative` text, CFG: video scale video_scale(timestep) (a float or a
        per-frame tensor), audio 5.0. audio_fixed: the audio input is held (SR)."""
        grid = grid_of(video)
        inp = build_inputs(dit.config, grid, audio.shape[0], text.shape[0], self.device)
        neg_inp = None if negative is None else build_inputs(dit.config, grid, audio.shape[0], negative.shape[0],
                                                             self.device)
        video_sched, audio_sched = make_unipc(steps, self.device), make_unipc(steps, self.device)
        for t in video_sched.timesteps:
            video = impose(video, frame0)
            v_video, v_audio = dit.velocity(video, audio, text, inp)
            if negative is not None:  # uncond: the same latents with the negative prompt
                u_video, u_audio = dit.velocity(video, audio, negative, neg_inp)
                v_video, v_audio = cfg(v_video, u_video, video_scale(int(t))), cfg(v_audio, u_audio, AUDIO_CFG)
            video = video_sched.step(v_video, t, video).prev_sample
            if not audio_fixed:
                audio = audio_sched.step(v_audio, t, audio).prev_sample
        return impose(video, frame0), audio

    def noise(self, shape, gen) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(self.device)  # drawn on the CPU: same numbers on any device

    # -- the whole pipeline -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, prompt: str, mode: str = "distill", seconds: float = 5.0, size=(448, 256), seed: int = 0,
                 image=None, sr_size=None, negative_prompt: str = NEGATIVE_PROMPT) -> Generation:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {MODES}")
        timings: dict[str, float] = {}
        start = time.perf_counter()
        self.models.load_seconds = 0.0

        def lap(name):
            nonlocal start
            backend.synchronize()
            now = time.perf_counter()
            timings[name] = timings.get(name, 0.0) + now - start
            start = now

        texts = self.encode_text([prompt] if mode == "distill" else [prompt, negative_prompt])  # SR stage has CFG
        text, negative = texts[0], (texts[1] if len(texts) > 1 else None)
        lap("text")
        A, T, h, w = latent_shape(seconds, *size)
        if h < 2 or w < 2:
            raise ValueError(f"size {size[0]}x{size[1]} is too small: need at least 32x32 pixels")
        gen = torch.Generator().manual_seed(seed)
        audio = self.noise((A, 64), gen)  # [A, 64], drawn first
        video = self.noise((48, T, h, w), gen)  # [48, T, h, w]
        frame0 = None
        if image is not None:
            frame0 = self.encode_image(image, 16 * h, 16 * w)
            lap("image_encode")
        with self.models.use(dit_name(mode)) as dit:
            if mode == "base":
                video, audio = self.denoise_unipc(dit, video, audio, text, BASE_STEPS, negative, frame0=frame0)
            else:
                video, audio = self.denoise_distill(dit, video, audio, text, gen, frame0)
        lap("denoise")
        if mode.startswith("sr"):
            sw, sh = sr_size or (size[0] * (2 if mode == "sr540" else 4), size[1] * (2 if mode == "sr540" else 4))
            _, _, h2, w2 = latent_shape(seconds, sw, sh)
            video = F.interpolate(video[None], size=(T, h2, w2), mode="trilinear", align_corners=True)[0]
            video = renoise(video, self.noise(video.shape, gen))
            audio_in = SR_MIX_NOISE * self.noise(audio.shape, gen) + (1 - SR_MIX_NOISE) * audio
            frame0 = None if image is None else self.encode_image(image, 16 * h2, 16 * w2)
            scale = sr_video_guidance(T).to(self.device)  # [1, T, 1, 1], constant over steps
            with self.models.use("540p_sr" if mode == "sr540" else "1080p_sr") as sr_dit:
                video, _ = self.denoise_unipc(sr_dit, video, audio_in, text, SR_STEPS, negative, lambda t: scale,
                                              frame0, audio_fixed=True)
            lap("sr")  # the final audio is the base stage's
        pixels = self.decode_video(video)
        lap("vae_decode")
        wave = self.decode_audio(audio)
        lap("audio_decode")
        timings["load"] = self.models.load_seconds  # model loads / moves / frees, included in the stage times above
        return Generation(pixels, wave, video, audio, timings)


def grid_of(video: torch.Tensor) -> tuple[int, int, int]:
    _, T, h, w = video.shape
    return T, h // 2, w // 2


def impose(video: torch.Tensor, frame0: torch.Tensor | None) -> torch.Tensor:
    """TI2V: latent frame 0 replaced by the image's clean latent (no flag: the model sees a clean frame)."""
    if frame0 is None:
        return video
    return torch.cat([frame0.to(video.dtype), video[:, 1:]], 1)
