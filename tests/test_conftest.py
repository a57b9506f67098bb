"""The suite's own set-up (tests/conftest.py): a test that changes torch's thread count gives it back."""

import torch

from conftest import torch_threads


def test_torch_threads_sets_the_count_and_restores_it():
    before = torch.get_num_threads()
    with torch_threads(before + 1):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before


def test_torch_threads_restores_the_count_after_an_error():
    before = torch.get_num_threads()
    try:
        with torch_threads(before + 1):
            raise RuntimeError("inside")
    except RuntimeError:
        pass
    assert torch.get_num_threads() == before


def test_the_one_torch_thread_fixture(one_torch_thread):
    assert torch.get_num_threads() == 1
