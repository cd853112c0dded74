"""A CPU stand-in for Transformer Engine's PyTorch API, for the tests of kernels/te.py.

It has what k3train's adapters touch, with TE's names and signatures: `Linear(in, out, bias,
params_dtype, device)` with a `weight [out, in]` parameter (and no bias parameter when
`bias=False`, as TE), `GroupedLinear(num_gemms, in, out, ...)` with `weight0..weight{n-1}` that
its forward reads through `getattr`, Megatron's TP marks on the weights, `fp8_autocast` /
`FP8GlobalStateManager`, the recipes, and the delayed recipe's `fp8_meta["scaling_fwd"/"scaling_bwd"]`
(`scale`, `amax_history`) created on the first FP8 forward. The GEMMs are plain fp32/fp64
matmuls; under "FP8" the module records the amax of its input in the history and counts the call,
so tests can see which modules ran in FP8.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn


class MegatronMarks(Protocol):
    """Megatron's TP marks, which TE sets on its weights (attributes torch does not declare)."""

    tensor_model_parallel: bool
    partition_dim: int
    partition_stride: int


class FP8GlobalStateManager:
    """TE's global FP8 switch, as a stack of enabled flags (per stand-in namespace)."""

    def __init__(self) -> None:
        self.stack: list[bool] = []

    def is_fp8_enabled(self) -> bool:
        return bool(self.stack and self.stack[-1])


class Format:
    HYBRID = "HYBRID"
    E4M3 = "E4M3"


class DelayedScaling:
    def __init__(
        self, fp8_format=Format.HYBRID, amax_history_len: int = 1024, amax_compute_algo: str = "max", margin: int = 0
    ):
        self.fp8_format, self.amax_history_len, self.amax_compute_algo = fp8_format, amax_history_len, amax_compute_algo


class Float8CurrentScaling:
    def __init__(self, fp8_format=Format.HYBRID):
        self.fp8_format = fp8_format


class MXFP8BlockScaling:
    def __init__(self, fp8_format=Format.E4M3):
        self.fp8_format = fp8_format


class ScalingMeta:
    def __init__(self, tensors: int, history: int, device) -> None:
        self.scale = torch.ones(tensors, device=device)
        self.amax_history = torch.zeros(history, tensors, device=device)


def make_stand_in(history: int = 4):
    """A fresh namespace (`pytorch`, `recipe`) like `kernels.te.TENamespace`."""
    manager = FP8GlobalStateManager()

    @contextlib.contextmanager
    def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe=None, fp8_group=None):
        manager.stack.append(enabled)
        try:
            yield
        finally:
            manager.stack.pop()

    class BaseModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fp8_meta: dict = {}
            self.fp8_calls = 0
            self.bf16_calls = 0

        def _all_weights(self) -> list[nn.Parameter]:
            return list(self.parameters())  # the subclasses name their GEMM weights in order

        def init_fp8_metadata(self, num_gemms: int = 1) -> None:
            if "scaling_fwd" not in self.fp8_meta:
                device = next(iter(self._all_weights())).device
                self.fp8_meta["scaling_fwd"] = ScalingMeta(3 * num_gemms, history, device)
                self.fp8_meta["scaling_bwd"] = ScalingMeta(2 * num_gemms, history, device)

        def record(self, x: torch.Tensor, num_gemms: int) -> None:
            if manager.is_fp8_enabled():
                self.init_fp8_metadata(num_gemms)
                meta = self.fp8_meta["scaling_fwd"]
                with torch.no_grad():
                    meta.amax_history.copy_(meta.amax_history.roll(1, 0))
                    meta.amax_history[0].fill_(x.detach().abs().max().float().item() if x.numel() else 0.0)
                    meta.scale.copy_(448.0 / meta.amax_history.max(0).values.clamp(min=1e-12))
                self.fp8_calls += 1
            else:
                self.bf16_calls += 1

    def te_marks(weight: nn.Parameter, dim: int) -> None:
        marks = cast(MegatronMarks, weight)
        marks.tensor_model_parallel = True
        marks.partition_dim = dim
        marks.partition_stride = 1

    class Linear(BaseModule):
        def __init__(
            self,
            in_features: int,
            out_features: int,
            bias: bool = True,
            *,
            params_dtype: torch.dtype | None = None,
            device="cuda",
            parallel_mode=None,
            **kwargs,
        ):
            super().__init__()
            self.in_features, self.out_features = in_features, out_features
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype, device=device))
            if bias:
                self.bias: torch.Tensor = nn.Parameter(torch.zeros(out_features, dtype=params_dtype, device=device))
            else:
                self.bias = torch.Tensor()  # TE keeps an empty tensor, not a parameter
            if not self.weight.is_meta:
                nn.init.normal_(self.weight, std=0.023)
            te_marks(self.weight, 0)

        def _all_weights(self) -> list[nn.Parameter]:
            return [self.weight]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.record(x, 1)
            return F.linear(x, self.weight.to(x.dtype))

    class GroupedLinear(BaseModule):
        def __init__(
            self,
            num_gemms: int,
            in_features: int,
            out_features: int,
            bias: bool = True,
            *,
            params_dtype: torch.dtype | None = None,
            device="cuda",
            **kwargs,
        ):
            super().__init__()
            self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
            for index in range(num_gemms):
                weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype, device=device))
                te_marks(weight, 0)
                self.register_parameter(f"weight{index}", weight)
                setattr(self, f"bias{index}", torch.Tensor())

        def _all_weights(self) -> list[nn.Parameter]:
            return [getattr(self, f"weight{index}") for index in range(self.num_gemms)]

        def forward(self, inp: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
            assert len(m_splits) == self.num_gemms and sum(m_splits) == inp.shape[0], (m_splits, inp.shape)
            if manager.is_fp8_enabled():
                assert all(m % 16 == 0 for m in m_splits), m_splits  # TE's FP8 GEMM row alignment
            self.record(inp, self.num_gemms)
            weights = [getattr(self, f"weight{index}") for index in range(self.num_gemms)]
            pieces = [part @ weight.to(inp.dtype).t() for part, weight in zip(inp.split(m_splits), weights)]
            return torch.cat(pieces) if pieces else inp.new_zeros(0, self.out_features)

    pytorch = SimpleNamespace(
        Linear=Linear, GroupedLinear=GroupedLinear, fp8_autocast=fp8_autocast, FP8GlobalStateManager=manager
    )
    recipe = SimpleNamespace(
        DelayedScaling=DelayedScaling,
        Float8CurrentScaling=Float8CurrentScaling,
        MXFP8BlockScaling=MXFP8BlockScaling,
        Format=Format,
    )
    from k3train.kernels.te import TENamespace

    return TENamespace(pytorch, recipe)
