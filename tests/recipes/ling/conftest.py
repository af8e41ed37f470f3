"""Fixtures of the Ling model tests."""
import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests: the tiny checkpoint's ops take microseconds, so one thread runs
    them faster than two, and a busy machine (another process on the second core) cannot stall every op on an
    OpenMP barrier (the engine tests: 2 s on one thread, up to 60 s on two beside another test run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
