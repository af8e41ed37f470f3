import pytest


@pytest.fixture(scope="session")
def tiny_weights():
    """The tiny random model set run.sh uses (weights/magihuman-tiny, written once)."""
    from generate_magihuman import ensure_tiny

    return ensure_tiny()
