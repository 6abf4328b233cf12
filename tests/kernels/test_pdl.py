"""Programmatic dependent launch (kernels.pdl): where it is switched on, and, compiled for sm90
on any machine (no GPU needed), that every PDL kernel waits for its predecessor in every program
before it touches anything but its constant weights."""

import types

import pytest
import torch
from kernel_testing import run_ptx_check

from tandem.kernels import pdl
from tandem.kernels import switches


@pytest.fixture
def capability(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def set_major(major):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (major, 0))
        pdl._enabled.cache_clear()

    yield set_major
    pdl._enabled.cache_clear()


def _cuda_tensor():
    return types.SimpleNamespace(is_cuda=True, device=types.SimpleNamespace(index=0))


def test_no_pdl_off_the_gpu():
    assert pdl.launch_options(torch.zeros(2)) == {}


@pytest.mark.skipif(pdl.gdc_wait is None, reason="this Triton has no grid dependency control")
def test_on_from_sm90_unless_turned_off(capability, monkeypatch):
    monkeypatch.delenv("TANDEM_PDL", raising=False)
    switches.reload()
    capability(9)
    assert pdl.launch_options(_cuda_tensor()) == {"USE_PDL": True, "launch_pdl": True}
    capability(8)
    assert pdl.launch_options(_cuda_tensor()) == {}
    monkeypatch.setenv("TANDEM_PDL", "0")
    switches.reload()
    capability(9)
    assert pdl.launch_options(_cuda_tensor()) == {}


@pytest.mark.skipif(pdl.gdc_wait is None, reason="this Triton has no grid dependency control")
def test_every_program_waits_before_touching_activations():
    """pdl_ptx_check.py compiles each PDL kernel for sm90 (outside the interpreter) and reads its PTX."""
    assert "ok: 39 kernels wait first" in run_ptx_check("pdl_ptx_check.py")
