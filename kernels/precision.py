"""Accumulation precision shared by the kernels: at least fp32, float64 stays float64 (tests)."""

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs, float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def upcast(x: torch.Tensor) -> torch.Tensor:
    return x.to(accumulation_dtype(x.dtype))


def without_autocast(device: torch.device):
    """Run a block in the precision its inputs have, even inside a bf16 autocast region: for the
    computations the spec keeps in fp32 (AttnRes scores and mix, router, balancer)."""
    return torch.autocast(device.type, enabled=False)
