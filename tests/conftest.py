"""Settings shared by every test module."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # The tests run tiny models, often in float64: a second intra-op thread only adds hand-offs
    # (measured up to 10x slower on a busy 2-core machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def float64_seeded():
    """float64 as the default dtype and seed 0, for modules that compare engines exactly
    (``pytestmark = pytest.mark.usefixtures("float64_seeded")``)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(previous)
