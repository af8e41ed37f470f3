"""The model contract's own checks: a contract that could not serve is refused where it is made."""
import pytest
import torch

from common.engine.model_contract import ModelContract


class NoDrafts:
    num_draft_layers = 0


def test_contract_refuses_limits_that_cannot_serve():
    shape = dict(hidden_size=8, dtype=torch.float32, device=torch.device("cpu"))
    assert ModelContract(128, 512, (1, 2), **shape).mtp is None
    with pytest.raises(ValueError, match="must be positive"):
        ModelContract(0, 512, (1,), **shape)
    with pytest.raises(ValueError, match="must be positive"):
        ModelContract(128, 512, (1,), **{**shape, "hidden_size": 0})
    with pytest.raises(ValueError, match=r"eos_token_ids \(512,\) must lie in \[0, 512\)"):
        ModelContract(128, 512, (512,), **shape)
    with pytest.raises(ValueError, match="at least one draft layer"):
        ModelContract(128, 512, (1,), mtp=NoDrafts(), **shape)
