"""Fixtures shared by the whole test tree."""
import pytest
import torch


@pytest.fixture(scope="module")
def single_torch_thread():
    """One intra-op torch thread for the module: tiny tensors, and on a shared 2-core CI machine
    torch's default pool oversubscribes the cores. Opt in with
    ``pytestmark = pytest.mark.usefixtures("single_torch_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
