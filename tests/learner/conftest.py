import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny ops: with other processes on the cores, OpenMP threads waiting for each other cost up to 100x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
