"""bench.py's FLOP count of a DiT forward: the linears == what torch's FlopCounterMode counts on the running model
(the attention runs in a fused CPU kernel the counter does not see; its term is the textbook 4 N^2 Hq D)."""
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench import attention_flops, dit_flops, linear_flops
from config_magihuman import tiny_config
from modeling_magihuman import MagiHumanDiT, build_inputs


def test_dit_flops_match_the_flop_counter():
    cfg = tiny_config()  # every linear kind: experts, gelu7, swiglu7
    model = MagiHumanDiT(cfg, torch.float32)
    inp = build_inputs(cfg, (3, 2, 2), 9, 5)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randn(12, 192), torch.randn(9, 64), torch.randn(5, 32), inp)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert linear_flops(cfg, 26, 12, 9) == counts["aten.mm"] + counts["aten.addmm"]
    assert attention_flops(cfg, 26) == 4 * 4 * 26 * 26 * 4 * 16  # 4 layers x 2 GEMMs x 2 FLOP x N^2 x Hq x D
    assert dit_flops(cfg, 26, 12, 9) == linear_flops(cfg, 26, 12, 9) + attention_flops(cfg, 26)
