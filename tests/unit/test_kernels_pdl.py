"""Programmatic dependent launch (peagle.kernels.pdl): the launch options it gives, by device and switch. The kernels'
results with it off are the Triton tests' (every launcher passes USE_PDL, which the kernels require); with it on, the
GPU test tests/gpu/test_prefill_graphs_gpu.py::test_pdl_keeps_greedy_output."""

from __future__ import annotations

import os

import pytest
import torch

from peagle.kernels import pdl


def test_off_by_default_and_off_the_gpu(monkeypatch):
    if pdl.ENV not in os.environ:
        assert pdl.ENABLED is False
    monkeypatch.delenv(pdl.ENV, raising=False)
    assert pdl._from_env() is False
    assert pdl.options(torch.device("cpu")) == {"USE_PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.options(torch.device("cpu")) == {"USE_PDL": False}  # no such launch on the CPU


def test_on_for_hopper_when_enabled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    capability = {0: (9, 0), 1: (8, 0)}
    monkeypatch.setattr(pdl, "_supported", lambda index: capability[index][0] >= 9)
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert pdl.options(cuda0) == {"USE_PDL": False}  # switched off
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.options(cuda0) == {"USE_PDL": True, "launch_pdl": True}
    assert pdl.options(cuda1) == {"USE_PDL": False}  # before Hopper
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.options(cuda0) == {"USE_PDL": False}  # Triton's interpreter has no such launch


def test_the_environment_switch(monkeypatch):
    monkeypatch.setenv(pdl.ENV, "1")
    assert pdl._from_env() is True
    monkeypatch.setenv(pdl.ENV, "0")
    assert pdl._from_env() is False
    monkeypatch.setenv(pdl.ENV, "yes")
    with pytest.raises(ValueError, match="PEAGLE_PDL"):
        pdl._from_env()
