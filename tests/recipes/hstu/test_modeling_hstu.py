"""The HSTU model: config invariants, the layer formula, the candidate mask end to end, checkpoint round trip."""
import pytest
import torch
import torch.nn.functional as F

from common.loader import CheckpointError
from modeling_hstu import HSTUConfig, HSTUModel, load_model, make_batch, user_tokens, write_tiny_checkpoint

CFG = HSTUConfig()
HISTORY = [(3, 1), (50, 0), (7, 255), (9, 2)]


def model(seed=0):
    torch.manual_seed(seed)
    return HSTUModel(CFG).eval()


@pytest.mark.parametrize("bad", [dict(num_heads=0), dict(max_seq_len=6), dict(contextual_vocab_sizes=(4, 0)),
                                 dict(alpha=0.0)])
def test_config_invariants(bad):
    with pytest.raises(AssertionError):
        HSTUConfig(**bad)


def test_batch_layout_and_shared_candidate_position():
    tokens = user_tokens(CFG, [1, 2, 3, 4, 5], HISTORY)
    assert [k for k, _ in tokens[5:9]] == [CFG.item_kind, CFG.action_kind] * 2
    b = make_batch(CFG, [(tokens, 0, [11, 12, 13]), (tokens[7:], 7, [4])])
    assert b.positions[13:16].tolist() == [13, 13, 13] and b.positions[16:].tolist() == list(range(7, 13)) + [13]
    assert b.cu_seqlens.tolist() == [0, 16, 23] and b.num_candidates.tolist() == [3, 1]
    with pytest.raises(ValueError, match="max_seq_len"):
        make_batch(CFG, [(tokens * 20, 0, [1])])


def test_layer_matches_the_formula_on_one_full_sequence():
    m = model()
    layer, c = m.layers[0], CFG
    b = make_batch(c, [(user_tokens(c, [0, 1, 2, 3, 4], HISTORY), 0, [5, 6])])
    x = torch.randn(b.kinds.numel(), c.hidden_size)
    n, H = x.shape[0], c.num_heads
    h = F.silu(F.linear(F.layer_norm(x, (c.hidden_size,), layer.norm_in.weight, layer.norm_in.bias, c.layer_norm_eps),
                        layer.uvqk.weight, layer.uvqk.bias))
    u, v, q, k = h.split([H * c.linear_dim] * 2 + [H * c.attention_dim] * 2, -1)
    q, k, v = q.view(n, H, -1), k.view(n, H, -1), v.view(n, H, -1)
    mask = torch.ones(n, n).tril().bool()
    mask[-2:, -2:] = torch.eye(2, dtype=torch.bool)  # candidates: not each other
    a = F.silu(c.alpha * torch.einsum("qhd,khd->hqk", q, k)) / c.max_seq_len * mask
    o = torch.einsum("hqk,khd->qhd", a, v).reshape(n, -1)
    want = x + layer.out(u * layer.norm_attn(o))
    torch.testing.assert_close(layer(x, b), want, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_a_candidate_score_does_not_depend_on_the_other_candidates():
    m = model()
    tokens = user_tokens(CFG, [0, 1, 2, 3, 4], HISTORY)
    both = m(make_batch(CFG, [(tokens, 0, [21, 22])]))
    alone = m(make_batch(CFG, [(tokens, 0, [22])]))
    batched = m(make_batch(CFG, [(tokens[:9], 0, [8]), (tokens, 0, [21, 22])]))
    assert both.shape == (2, 8)
    torch.testing.assert_close(both[1:], alone, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(batched[1:], both, rtol=1e-5, atol=1e-6)


@torch.inference_mode()
def test_tiny_checkpoint_round_trip(tmp_path):
    a, b = write_tiny_checkpoint(tmp_path / "a"), write_tiny_checkpoint(tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    loaded = load_model(a)
    torch.manual_seed(0)
    fresh = HSTUModel(CFG).eval()
    batch = make_batch(CFG, [(user_tokens(CFG, [0, 1, 2, 3, 4], HISTORY), 0, [1, 2])])
    torch.testing.assert_close(loaded(batch), fresh(batch), rtol=0, atol=0)
    (a / "config.json").write_text((a / "config.json").read_text().replace('"num_heads": 2', '"num_heads": 0'))
    with pytest.raises(CheckpointError, match="num_heads"):
        load_model(a)
