import torch

from kernels import pdl


def test_no_pdl_launch_options_off_the_gpu(monkeypatch):
    assert pdl.launch_options(torch.zeros(2)) == {}


def test_pdl_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("TANDEM_PDL", "0")
    pdl._enabled.cache_clear()
    try:
        assert pdl._enabled(0) is False
    finally:
        pdl._enabled.cache_clear()
