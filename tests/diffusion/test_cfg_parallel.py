"""CFG: the batched combination is the formula; 2-rank CFG parallel equals the batched result on every rank."""
import pytest
import torch

from common.diffusion.cfg_parallel import guided_prediction
from dist_helpers import run_ranks


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))


def _predict(model):
    return lambda x, text, t, gain=1.0: gain * model(x + text) * t[:, None]


def _inputs():
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(3, 8, generator=g), torch.rand(3, generator=g)
    return x, t, torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)


def test_batched_cfg_is_the_formula():
    model = _model()
    x, t, text, neg = _inputs()
    with torch.no_grad():
        out = guided_prediction(_predict(model), {"text": text}, {"text": neg}, 4.5, shared={"x": x, "t": t},
                                gain=2.0)
        cond, uncond = 2.0 * model(x + text) * t[:, None], 2.0 * model(x + neg) * t[:, None]
    torch.testing.assert_close(out, uncond + 4.5 * (cond - uncond), rtol=1e-5, atol=1e-6)


def test_branches_must_take_the_same_inputs():
    with pytest.raises(ValueError, match="different inputs"):
        guided_prediction(lambda **kw: None, {"text": torch.zeros(1)}, {"neg": torch.zeros(1)}, 1.0)


def _cfg_parallel_rank(expected):
    from common.parallel import ParallelLayout, destroy_parallel, init_parallel

    par = init_parallel(ParallelLayout(cfg=2))
    try:
        x, t, text, neg = _inputs()
        with torch.no_grad():
            out = guided_prediction(_predict(_model()), {"text": text}, {"text": neg}, 4.5, group=par.group("cfg"),
                                    shared={"x": x, "t": t}, gain=2.0)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    finally:
        destroy_parallel()


@pytest.mark.slow
def test_two_rank_cfg_parallel_equals_batched():
    x, t, text, neg = _inputs()
    with torch.no_grad():
        expected = guided_prediction(_predict(_model()), {"text": text}, {"text": neg}, 4.5, shared={"x": x, "t": t},
                                     gain=2.0)
    run_ranks(_cfg_parallel_rank, 2, expected)
