"""1080p SR local attention: per-frame key segments merged by log-sum-exp == dense attention under the mask."""
import torch

from config_magihuman import tiny_config
from modeling_magihuman import build_inputs, local_attention


def dense_masked(q, k, v, visible, scale):
    """Plain softmax attention with a boolean [Nq, Nk] mask; GQA: q head i uses kv head i // G."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)  # [N, Hq, D]
    scores = torch.einsum("ihd,jhd->hij", q, k) * scale
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hij,jhd->ihd", probs, v)


def test_local_windows_match_masked_dense_attention():
    torch.manual_seed(0)
    cfg = tiny_config("1080p_sr")  # window of 1 latent frame each side
    T, H, W, A, L = 5, 2, 3, 9, 4
    inp = build_inputs(cfg, (T, H, W), A, L)
    nv, n = T * H * W, T * H * W + A + L
    q, k, v = torch.randn(n, 4, 16), torch.randn(n, 2, 16), torch.randn(n, 2, 16)
    frame = torch.cat([torch.arange(nv) // (H * W), torch.full((A + L,), -1)])  # -1: audio / text
    is_video = frame >= 0
    near = (frame[:, None] - frame[None, :]).abs() <= cfg.local_attn_frames
    visible = ~is_video[:, None] | ~is_video[None, :] | near  # video-video pairs only within the window
    assert not visible.all()  # the window does cut something at T = 5
    out = local_attention(q, k, v, inp, 16 ** -0.5)
    torch.testing.assert_close(out, dense_masked(q, k, v, visible, 16 ** -0.5), atol=1e-5, rtol=1e-5)
    full = dense_masked(q, k, v, torch.ones(n, n, dtype=torch.bool), 16 ** -0.5)
    assert not torch.allclose(out[:nv], full[:nv], atol=1e-3)  # and differs from full attention
    torch.testing.assert_close(out[nv:], full[nv:], atol=1e-5, rtol=1e-5)  # audio / text queries see all


def test_local_layers_of_the_1080p_model():
    from config_magihuman import MagiHumanConfig

    cfg = MagiHumanConfig.for_variant("1080p_sr")
    assert [i for i in range(40) if i not in cfg.local_attn_layers] == [3, 7, 11, 15, 19, 23, 27, 31]
    assert cfg.local_attn_frames == 11 and cfg.text_rope == "v1"
    assert MagiHumanConfig.for_variant("540p_sr").local_attn_layers == []
