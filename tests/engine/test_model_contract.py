"""The model contract's own checks: a contract that could not serve is refused where it is made."""
import pytest

from common.engine.model_contract import ModelContract


class NoDrafts:
    num_draft_layers = 0


def test_contract_refuses_limits_that_cannot_serve():
    assert ModelContract(128, 512, (1, 2)).mtp is None
    with pytest.raises(ValueError, match="must be positive"):
        ModelContract(0, 512, (1,))
    with pytest.raises(ValueError, match=r"eos_token_ids \(512,\) must lie in \[0, 512\)"):
        ModelContract(128, 512, (512,))
    with pytest.raises(ValueError, match="at least one draft layer"):
        ModelContract(128, 512, (1,), mtp=NoDrafts())
