"""The spec's RoPE facts and the patchify order asymmetry."""
import torch

from modeling_magihuman import patchify, unpatchify
from rope_magihuman import (apply_rope, audio_coords, rope_angles, rope_bands, rope_cos_sin, text_coords,
                            video_coords)

BANDS = rope_bands(16)  # head_dim 128


def test_bands_and_rotated_width():
    torch.testing.assert_close(BANDS, torch.tensor([10000 ** (-k / 16) for k in range(16)]))
    cos, _ = rope_cos_sin(video_coords(2, 2, 2), BANDS)
    assert cos.shape == (8, 96)  # 96 of 128 dims rotated


def test_v2_text_is_unrotated_and_v1_text_spans_zero_to_one():
    x = torch.randn(7, 3, 128)
    cos, sin = rope_cos_sin(text_coords(7, "v2"), BANDS)
    torch.testing.assert_close(apply_rope(x, cos, sin), x)
    theta = rope_angles(text_coords(7, "v1"), BANDS)  # p_t = j / (L - 1)
    torch.testing.assert_close(theta[:, :16], torch.arange(7)[:, None] / 6 * BANDS)
    assert theta[:, 16:].abs().max() == 0


def test_audio_runs_at_a_quarter_of_its_index():
    A = 4 * 5 + 1  # 25 s divisible by 4
    theta = rope_angles(audio_coords(A), BANDS)
    torch.testing.assert_close(theta[:, :16], torch.arange(A)[:, None] / 4 * BANDS)
    video = rope_angles(video_coords(6, 1, 1), BANDS)  # a 1x1 grid: frame f sits at p = (f, 0, 0)
    torch.testing.assert_close(theta[::4], video)  # audio token 4f lines up with latent frame f


def test_video_is_centred():
    T, H, W = 2, 3, 4
    theta = rope_angles(video_coords(T, H, W), BANDS).view(T, H, W, 3, 16)
    torch.testing.assert_close(theta[..., 1, 0][0, :, 0], torch.tensor([-1.0, 0.0, 1.0]))  # h - (H-1)/2
    torch.testing.assert_close(theta[..., 2, 0][0, 0], torch.tensor([-1.5, -0.5, 0.5, 1.5]))
    torch.testing.assert_close(theta[..., 1:, :].sum(dim=(1, 2)), torch.zeros(T, 2, 16))


def test_video_logits_invariant_to_a_shift_of_t():
    T, H, W = 3, 2, 2
    coords = video_coords(T, H, W)
    shifted = coords.clone()
    shifted[:, 0] += 5.0
    q, k = torch.randn(12, 2, 128), torch.randn(12, 2, 128)

    def logits(c):
        cos, sin = rope_cos_sin(c, BANDS)  # fp32, as the model computes it
        return torch.einsum("ihd,jhd->hij", apply_rope(q, cos, sin), apply_rope(k, cos, sin))

    torch.testing.assert_close(logits(shifted), logits(coords), atol=1e-4, rtol=1e-5)
    assert not torch.allclose(rope_cos_sin(shifted, BANDS)[0], rope_cos_sin(coords, BANDS)[0])


def test_half_rotation_formula():
    x = torch.randn(4, 1, 128)
    c = video_coords(1, 2, 2)
    cos, sin = rope_cos_sin(c, BANDS)
    th = rope_angles(c, BANDS)  # [4, 48]
    y = apply_rope(x, cos, sin)
    x1, x2 = x[:, 0, :48], x[:, 0, 48:96]
    torch.testing.assert_close(y[:, 0, :48], x1 * th.cos() - x2 * th.sin())
    torch.testing.assert_close(y[:, 0, 48:96], x2 * th.cos() + x1 * th.sin())
    torch.testing.assert_close(y[:, :, 96:], x[:, :, 96:])


def test_patchify_order_asymmetry():
    C, T, h, w = 48, 2, 4, 6
    latent = torch.randn(C, T, h, w)
    tokens = patchify(latent)  # [T * 2 * 3, 192]
    t, hh, ww, c, ph, pw = 1, 1, 2, 5, 1, 0
    row = (t * 2 + hh) * 3 + ww  # raster (t, h', w')
    assert tokens[row, c * 4 + ph * 2 + pw] == latent[c, t, 2 * hh + ph, 2 * ww + pw]  # input: channel-major
    out = torch.zeros(T * 2 * 3, 192)
    out[row, (ph * 2 + pw) * C + c] = 1.0  # output: channel-minor
    assert unpatchify(out, T, 2, 3)[c, t, 2 * hh + ph, 2 * ww + pw] == 1.0
    assert not torch.equal(unpatchify(tokens, T, 2, 3), latent)  # the two orders differ
    channel_minor = tokens.view(-1, C, 4).transpose(1, 2).flatten(1)
    torch.testing.assert_close(unpatchify(channel_minor, T, 2, 3), latent)
