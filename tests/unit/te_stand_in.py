"""A CPU stand-in for Transformer Engine's PyTorch API, for the tests of kernels/te.py.

It has what k3train's adapters touch, with TE's names and signatures: `Linear(in, out, bias,
params_dtype, device)` with a `weight [out, in]` parameter (and no bias parameter when
`bias=False`, as TE), `GroupedLinear(num_gemms, in, out, ...)` with `weight0..weight{n-1}` that
its forward reads through `getattr`, Megatron's TP marks on the weights, `fp8_autocast` /
`FP8GlobalStateManager`, the recipes, and the delayed recipe's `fp8_meta["scaling_fwd"/"scaling_bwd"]`
(`scale`, `amax_history`) created on the first FP8 forward, `Float8BlockScaling`, the forwards'
`is_first_microbatch` (FP8 weight casts cached between micro-batches) and `checkpoint` (TE's
activation recompute: the recompute re-enters the forward's FP8 region and reuses the scales the
forward used). Each call checks its arguments as TE's does (the checks are named where they sit).

The GEMMs are plain fp32/fp64 matmuls. Under "FP8" the module records the amax of its input in
the history and counts the call, so tests can see which modules ran in FP8. With
`make_stand_in(quantize=True)` the operands are also rounded to E4M3 (`torch.float8_e4m3fn`, 3
mantissa bits) by the active recipe's scaling: delayed, the input's scale from the amax history
before this call (TE's delayed scaling), the weight's from itself; current, per tensor from the
tensor; mxfp8, power-of-two scales per 32 elements along the last dimension; blockwise, power-of-two
scales per 1 × 128 input block and 128 × 128 weight block. Gradients pass the rounding straight
through and are not rounded to E5M2 (the backward GEMMs use the rounded operands, as TE's do).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import warnings
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


E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


class FP8GlobalStateManager:
    """TE's global FP8 switch, as a stack of (enabled, recipe) (per stand-in namespace), and the
    activation-recompute phase `checkpoint` is in: "forward" (a checkpointed forward, whose
    delayed-scaling modules keep the scales they used), "recompute" (its rerun in backward,
    which takes them back) or None."""

    def __init__(self) -> None:
        self.stack: list[tuple[bool, object]] = []
        self.recompute_phase: str | None = None

    def is_fp8_enabled(self) -> bool:
        return bool(self.stack and self.stack[-1][0])

    def get_fp8_recipe(self):
        return self.stack[-1][1] if self.stack else None


class Format:
    HYBRID = "HYBRID"
    E4M3 = "E4M3"
    E5M2 = "E5M2"


class NotModelled(RuntimeError):
    """A Transformer Engine argument the stand-in does not model (k3train never passes it): the
    stand-in refuses it rather than silently behaving unlike TE."""


def no_pure_e5m2(fp8_format) -> None:
    """TE's recipes: `assert fp8_format != Format.E5M2, "Pure E5M2 training is not supported."`"""
    if fp8_format == Format.E5M2:
        raise AssertionError("Pure E5M2 training is not supported.")


class DelayedScaling:
    def __init__(
        self, fp8_format=Format.HYBRID, amax_history_len: int = 1024, amax_compute_algo: str = "max", margin: int = 0
    ):
        no_pure_e5m2(fp8_format)
        if not (callable(amax_compute_algo) or amax_compute_algo in ("max", "most_recent")):
            raise AssertionError(f"Unsupported amax_compute_algo: {amax_compute_algo}")  # TE's check
        self.fp8_format, self.amax_history_len, self.amax_compute_algo = fp8_format, amax_history_len, amax_compute_algo


class Float8CurrentScaling:
    def __init__(self, fp8_format=Format.HYBRID):
        no_pure_e5m2(fp8_format)
        self.fp8_format = fp8_format


class MXFP8BlockScaling:
    def __init__(self, fp8_format=Format.E4M3):
        no_pure_e5m2(fp8_format)
        self.fp8_format = fp8_format


@dataclasses.dataclass
class Float8BlockScaling:
    """TE 2.x's blockwise FP8 (DeepSeek-V3's): 1-D blocks of 128 for inputs and gradients, 2-D
    128 × 128 for weights, power-of-two scales; `__post_init__` checks what TE's does."""

    fp8_format: str = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        dims = (self.x_block_scaling_dim, self.w_block_scaling_dim, self.grad_block_scaling_dim)
        if any(dim not in (1, 2) for dim in dims):
            raise AssertionError("Only 1D or 2D blocks supported")
        if sum(dim == 2 for dim in dims) > 1:
            raise AssertionError("2D by 2D block gemm not supported.")
        if self.fp8_dpa or self.fp8_mha:
            raise AssertionError("FP8 attention is not supported for Float8BlockScaling.")
        no_pure_e5m2(self.fp8_format)


BLOCK = 128  # Float8BlockScaling's block edge
MX_BLOCK = 32  # MXFP8's block along the last dimension


def round_e4m3(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`t` through E4M3 at `scale` (broadcast), back in `t`'s dtype."""
    scaled = (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX)
    return (scaled.to(torch.float8_e4m3fn).float() / scale).to(t.dtype)


def power_of_two(scale: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(scale)))


def amax_scale(amax: torch.Tensor) -> torch.Tensor:
    return E4M3_MAX / amax.float().clamp(min=1e-12)


def round_blocks(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Power-of-two scales per `rows × cols` block of the last two dimensions (`t` 2-D)."""
    height, width = t.shape
    padded = torch.nn.functional.pad(t.float(), (0, -width % cols, 0, -height % rows))
    blocks = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
    scale = power_of_two(amax_scale(blocks.abs().amax(dim=(1, 3), keepdim=True)))
    rounded = round_e4m3(blocks, scale).reshape(padded.shape)
    return rounded[:height, :width].to(t.dtype)


def quantize_operand(t: torch.Tensor, recipe, role: str, delayed_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`t` rounded as `recipe` rounds an operand of `role` ("input" or "weight"); the rounding is
    passed straight through to the gradient."""
    flat = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    if isinstance(recipe, Float8BlockScaling):
        rows = BLOCK if role == "weight" and recipe.w_block_scaling_dim == 2 else 1
        rounded = round_blocks(flat.detach(), rows, BLOCK)
    elif isinstance(recipe, MXFP8BlockScaling):
        rounded = round_blocks(flat.detach(), 1, MX_BLOCK)
    elif isinstance(recipe, DelayedScaling) and role == "input" and delayed_scale is not None:
        rounded = round_e4m3(flat.detach(), delayed_scale)
    else:  # current scaling, and the delayed recipe's weights: the tensor's own amax
        rounded = round_e4m3(flat.detach(), amax_scale(flat.detach().abs().max()))
    return t + (rounded.reshape(t.shape) - t).detach()


def check_fp8_shape(inp: torch.Tensor, weight: torch.Tensor) -> None:
    """TE's `assert_dim_for_fp8_exec` (te.Linear's forward under FP8): the product of all but
    the last dimension divisible by 8 and the last divisible by 16, for the input and the weight."""
    for t in (inp, weight):
        leading = math.prod(t.shape[:-1])
        if leading % 8 or t.shape[-1] % 16:
            raise ValueError(
                "FP8 execution requires the product of all dimensions except the last to be divisible by 8 and "
                f"the last dimension to be divisible by 16, but got tensor with dims={list(t.shape)} (product of "
                f"leading dims = {leading}, last dim = {t.shape[-1]})"
            )


class ScalingMeta:
    def __init__(self, tensors: int, history: int, device) -> None:
        self.scale = torch.ones(tensors, device=device)
        self.amax_history = torch.zeros(history, tensors, device=device)


def make_stand_in(history: int = 4, quantize: bool = False):
    """A fresh namespace (`pytorch`, `recipe`) like `kernels.te.TENamespace`; `quantize`: round
    the FP8 GEMMs' operands to E4M3 (the module docstring says how)."""
    manager = FP8GlobalStateManager()

    @contextlib.contextmanager
    def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe=None, fp8_group=None):
        manager.stack.append((enabled, fp8_recipe))
        try:
            yield
        finally:
            manager.stack.pop()

    @contextlib.contextmanager
    def recompute_phase(phase: str):
        previous, manager.recompute_phase = manager.recompute_phase, phase
        try:
            yield
        finally:
            manager.recompute_phase = previous

    def checkpoint(function, *args, **kwargs):
        """TE's `transformer_engine.pytorch.checkpoint(function, *args, distribute_saved_activations=False,
        get_rng_state_tracker=None, tp_group=None, use_reentrant=True, **kwargs)`: its argument
        handling, and its non-reentrant path (the one k3train calls): the recompute runs in the
        forward's FP8 region (torch's checkpoint restores the autocast state), without early
        stopping, and the modules take back the scales their checkpointed forward used.
        `use_reentrant=True` is refused here, not modelled."""
        use_reentrant = kwargs.pop("use_reentrant", True)
        distribute = kwargs.pop("distribute_saved_activations", False)
        kwargs.pop("tp_group", None)
        tracker = kwargs.pop("get_rng_state_tracker", None)
        if tracker is not None and not callable(tracker):
            raise TypeError("get_rng_state_tracker must be a callable returning a CudaRNGStatesTracker")
        if use_reentrant:
            if distribute and not torch.distributed.is_initialized():
                raise RuntimeError(
                    "torch.distributed is not initialized. Call torch.distributed.init_process_group() before "
                    "using distribute_saved_activations=True."
                )
            raise NotModelled("the TE stand-in models checkpoint(..., use_reentrant=False) only")
        if distribute:
            warnings.warn("`distribute_saved_activations=True` has no effect when `use_reentrant=False`.", stacklevel=2)
        enabled, recipe = manager.is_fp8_enabled(), manager.get_fp8_recipe()

        @contextlib.contextmanager
        def recompute_context():
            with recompute_phase("recompute"), fp8_autocast(enabled=enabled, fp8_recipe=recipe):
                yield

        def contexts():
            return recompute_phase("forward"), recompute_context()

        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            return torch.utils.checkpoint.checkpoint(
                function, *args, use_reentrant=False, context_fn=contexts, **kwargs
            )

    class BaseModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fp8_meta: dict = {}
            self.fp8_calls = 0
            self.bf16_calls = 0
            self.recompute_calls = 0  # FP8 forwards rerun by `checkpoint`
            self.weight_casts = 0  # FP8 casts of a weight (not counted: those `is_first_microbatch=False` reuses)
            self.weight_cache: dict[int, torch.Tensor] = {}
            self.saved_scales: collections.deque = collections.deque()

        def _all_weights(self) -> list[nn.Parameter]:
            return list(self.parameters())  # the subclasses name their GEMM weights in order

        def init_fp8_metadata(self, num_gemms: int = 1) -> None:
            if "scaling_fwd" not in self.fp8_meta:
                device = next(iter(self._all_weights())).device
                self.fp8_meta["scaling_fwd"] = ScalingMeta(3 * num_gemms, history, device)
                self.fp8_meta["scaling_bwd"] = ScalingMeta(2 * num_gemms, history, device)

        def record(self, x: torch.Tensor, num_gemms: int) -> torch.Tensor | None:
            """Count the call; under FP8, the delayed recipe's input scale for it (the history's
            before this call; in a recompute, the one the checkpointed forward used), then the
            history and scale updated with this input's amax (not in a recompute)."""
            if not manager.is_fp8_enabled():
                self.bf16_calls += 1
                return None
            self.init_fp8_metadata(num_gemms)
            if manager.recompute_phase == "recompute":
                self.recompute_calls += 1
                return self.saved_scales.popleft()
            meta = self.fp8_meta["scaling_fwd"]
            scale = meta.scale[0].clone()
            if manager.recompute_phase == "forward":
                self.saved_scales.append(scale)
            with torch.no_grad():
                meta.amax_history.copy_(meta.amax_history.roll(1, 0))
                meta.amax_history[0].fill_(x.detach().abs().max().float().item() if x.numel() else 0.0)
                meta.scale.copy_(E4M3_MAX / meta.amax_history.max(0).values.clamp(min=1e-12))
            self.fp8_calls += 1
            return scale

        def fp8_operands(self, x, weight, index, scale, is_first_microbatch):
            """The input and weight an FP8 GEMM multiplies: the weight cast once and reused while
            `is_first_microbatch` is False (TE's weight workspace), cast every call when it is None."""
            recipe = manager.get_fp8_recipe()
            cached = self.weight_cache.get(index)
            if is_first_microbatch is False and cached is not None:
                w = weight + (cached.to(weight.dtype) - weight).detach()
            else:
                w = quantize_operand(weight, recipe, "weight") if quantize_operands else weight
                self.weight_casts += 1
                if is_first_microbatch is not None:
                    self.weight_cache[index] = w.detach().clone()
            return (quantize_operand(x, recipe, "input", scale) if quantize_operands else x), w

    quantize_operands = quantize

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

        def forward(
            self,
            inp: torch.Tensor,
            is_first_microbatch: bool | None = None,
            fp8_output: bool | None = False,
            fp8_grad: bool | None = False,
        ) -> torch.Tensor:
            if fp8_output or fp8_grad:
                raise NotModelled("the TE stand-in returns high-precision outputs and gradients only")
            if is_first_microbatch not in (None, True, False):
                raise TypeError(f"is_first_microbatch must be True, False or None, got {is_first_microbatch!r}")
            scale = self.record(inp, 1)
            if not manager.is_fp8_enabled():
                return F.linear(inp, self.weight.to(inp.dtype))
            check_fp8_shape(inp, self.weight)
            x, w = self.fp8_operands(inp, self.weight, 0, scale, is_first_microbatch)
            return F.linear(x, w.to(x.dtype))

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

        def forward(
            self,
            inp: torch.Tensor,
            m_splits: list[int],
            is_first_microbatch: bool | None = None,
            out: torch.Tensor | None = None,
            dgrad_out: torch.Tensor | None = None,
        ) -> torch.Tensor:
            assert len(m_splits) == self.num_gemms and sum(m_splits) == inp.shape[0], (m_splits, inp.shape)
            if out is not None or dgrad_out is not None:
                raise NotModelled("the TE stand-in allocates its outputs (out, dgrad_out: None)")
            fp8 = manager.is_fp8_enabled()
            if fp8:
                assert all(m % 16 == 0 for m in m_splits), m_splits  # TE's FP8 GEMM row alignment
            scale = self.record(inp, self.num_gemms)
            weights = [getattr(self, f"weight{index}") for index in range(self.num_gemms)]
            pieces = []
            for index, (part, weight) in enumerate(zip(inp.split(m_splits), weights)):
                if fp8:
                    part, weight = self.fp8_operands(part, weight, index, scale, is_first_microbatch)
                pieces.append(part @ weight.to(part.dtype).t())
            return torch.cat(pieces) if pieces else inp.new_zeros(0, self.out_features)

    pytorch = SimpleNamespace(
        Linear=Linear,
        GroupedLinear=GroupedLinear,
        fp8_autocast=fp8_autocast,
        checkpoint=checkpoint,
        FP8GlobalStateManager=manager,
    )
    recipe = SimpleNamespace(
        DelayedScaling=DelayedScaling,
        Float8CurrentScaling=Float8CurrentScaling,
        MXFP8BlockScaling=MXFP8BlockScaling,
        Float8BlockScaling=Float8BlockScaling,
        Format=Format,
    )
    from k3train.kernels.te import TENamespace

    return TENamespace(pytorch, recipe)
