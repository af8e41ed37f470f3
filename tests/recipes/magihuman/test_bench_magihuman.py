"""bench.py's FLOP count of a DiT forward == what torch's FlopCounterMode counts on the running model."""
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench import dit_flops
from config_magihuman import tiny_config
from modeling_magihuman import MagiHumanDiT, build_inputs


def test_dit_flops_match_the_flop_counter():
    cfg = tiny_config("1080p_sr")  # every layer kind: experts, gelu7, swiglu7, local windows (counted as full)
    cfg.local_attn_layers = []
    model = MagiHumanDiT(cfg, torch.float32)
    inp = build_inputs(cfg, (3, 2, 2), 9, 5)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randn(12, 192), torch.randn(9, 64), torch.randn(5, 32), inp)
    assert dit_flops(cfg, 12 + 9 + 5, 12, 9) == counter.get_total_flops()
