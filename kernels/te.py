"""Transformer Engine (TE) linears behind a guarded import: BF16 and FP8 GEMMs for the dense
projections and the routed experts.

Nothing here imports Transformer Engine at module level. `import_transformer_engine()` tries once,
on request, and catches every exception: the `transformer-engine` meta package without its
framework part raises RuntimeError on import, a build for another CUDA raises OSError. On a CPU
machine (`resolve_linear_backend` sees no CUDA) the import is never even attempted.

What the model gets from this module is a *linear factory*: a callable
`factory(in_features, out_features, device=None, dtype=None) -> nn.Module` whose module has a
`weight [out, in]` parameter and nothing else. `torch_linear` is today's `nn.Linear(bias=False)`;
`TELinearFactory` builds `te.Linear(bias=False)` (k3train's own tensor parallelism decides the
shard, TE runs with `tp_size=1` on it) and `te.GroupedLinear` adapters for the routed experts.
Parameter names and shapes are the same under both, so Per-Head Muon, ZeRO-1 and checkpoints see
the same tensors.

FP8 state (TE's delayed-scaling amax histories and scales) travels in each TE module's
`_extra_state` as a flat fp32 tensor (`fp8_state_tensor`), not TE's own pickled blob, so the
safe checkpoint loader reads it like any tensor. Recipes without persistent state (current
scaling, MXFP8) and modules that never ran in FP8 save an empty tensor; loading an empty tensor
keeps the fresh state, so checkpoints move between bf16 and fp8 runs in both directions.

The `te` argument of the functions below is a namespace with `pytorch` (transformer_engine.pytorch)
and `recipe` (transformer_engine.common.recipe); tests pass a CPU stand-in with the same
constructor signatures and parameter names.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from .grouped_gemm import GroupPadding

INSTALL_HINT = "pip install transformer-engine[pytorch]"
FP8_RECIPES = ("delayed", "current", "mxfp8", "blockwise")
FP8_STATE_VERSION = 1.0
# FP8 GEMMs need both matrix dimensions divisible by 16 (cuBLASLt); TE refuses others.
FP8_DIM_MULTIPLE = 16
# Rows per expert group are padded to this under FP8 (MXFP8 scales blocks of 32 rows).
FP8_GROUP_ROWS = {"delayed": 16, "current": 16, "mxfp8": 32, "blockwise": 16}


# ---------------------------------------------------------------------------------- import
class TENamespace:
    """`pytorch` (transformer_engine.pytorch) and `recipe` (transformer_engine.common.recipe);
    hashed by identity, so the adapter classes below are built once per namespace."""

    def __init__(self, pytorch: Any, recipe: Any, fp8_state_manager: Any = None):
        self.pytorch = pytorch
        self.recipe = recipe
        # FP8GlobalStateManager (not exported at the top of transformer_engine.pytorch)
        self.fp8_state_manager = fp8_state_manager or getattr(pytorch, "FP8GlobalStateManager", None)


@functools.cache
def import_transformer_engine() -> tuple[TENamespace | None, str]:
    """(namespace with `pytorch` and `recipe`, "") or (None, why it does not import). Tried once."""
    try:
        import transformer_engine.pytorch as te_pytorch
        from transformer_engine.common import recipe as te_recipe

        try:  # TE >= 2.8 keeps its FP8 state in .quantization, earlier releases in .fp8
            from transformer_engine.pytorch.quantization import FP8GlobalStateManager
        except ImportError:
            from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    except Exception as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return None, f"{type(error).__name__}: {message}"[:200]
    return TENamespace(te_pytorch, te_recipe, FP8GlobalStateManager), ""


def te_missing(device: torch.device) -> str | None:
    """Why TE linears cannot run on `device` (one line with the fix), or None when they can.
    Never imports Transformer Engine unless CUDA is there."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return (
            f"needs a CUDA GPU (device is {device.type}, torch.cuda.is_available() is "
            f"{torch.cuda.is_available()}) and Transformer Engine ({INSTALL_HINT})"
        )
    te, why = import_transformer_engine()
    if te is None:
        return f"needs Transformer Engine, which does not import ({why}); install it with {INSTALL_HINT}"
    return None


def resolve_linear_backend(choice: str, device: torch.device) -> str:
    """`torch` or `te` for `model.linear_backend` (`auto`: TE on CUDA when it imports). The meta
    device (planning) always gets `torch`: parameter names and shapes are the same."""
    if choice not in ("auto", "torch", "te"):
        raise ValueError(f"model.linear_backend must be 'auto', 'torch' or 'te', got {choice!r}")
    if choice == "torch" or device.type == "meta":
        return "torch"
    if choice == "te":
        return "te"
    return "te" if te_missing(device) is None else "torch"


# ---------------------------------------------------------------------------------- torch path
def torch_linear(in_features: int, out_features: int, device=None, dtype=None) -> nn.Linear:
    """Today's projection: `nn.Linear(in, out, bias=False)`."""
    return nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)


# ---------------------------------------------------------------------------------- FP8 recipes
def make_fp8_recipe(te: Any, name: str, amax_history_len: int = 1024, amax_compute_algo: str = "max"):
    """TE's recipe object: `delayed` (DelayedScaling, HYBRID: E4M3 forward, E5M2 gradients),
    `current` (Float8CurrentScaling, per-tensor scales from the tensor itself), `mxfp8`
    (MXFP8BlockScaling, 32-element blocks; Blackwell and later) or `blockwise`
    (Float8BlockScaling, E4M3 with power-of-two scales per 1 × 128 block of the inputs and
    gradients and per 128 × 128 block of the weights: DeepSeek-V3's recipe, Hopper with CUDA ≥ 12.9)."""
    recipe = te.recipe
    if name == "delayed":
        return recipe.DelayedScaling(
            fp8_format=recipe.Format.HYBRID, amax_history_len=amax_history_len, amax_compute_algo=amax_compute_algo
        )
    if name == "current":
        return recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID)
    if name == "mxfp8":
        return recipe.MXFP8BlockScaling()
    if name == "blockwise":
        if not hasattr(recipe, "Float8BlockScaling"):
            raise ValueError(
                "train.fp8_recipe=blockwise needs Transformer Engine 2.3 or later (Float8BlockScaling); "
                f"upgrade it ({INSTALL_HINT}) or use fp8_recipe=delayed or current"
            )
        return recipe.Float8BlockScaling(fp8_format=recipe.Format.E4M3)
    raise ValueError(f"train.fp8_recipe must be one of {', '.join(FP8_RECIPES)}, got {name!r}")


def fp8_autocast(te: Any, enabled: bool, recipe=None, amax_group=None):
    """TE's FP8 region: `te.pytorch.autocast(enabled, recipe, amax_reduction_group)` where it
    exists (TE ≥ 2.8), `te.pytorch.fp8_autocast(enabled, fp8_recipe, fp8_group)` before.
    `amax_group`: the process group the delayed recipe's amaxes are reduced over (None: this rank)."""
    autocast = getattr(te.pytorch, "autocast", None)
    if autocast is not None and "recipe" in inspect.signature(autocast).parameters:
        kwargs = {"amax_reduction_group": amax_group} if amax_group is not None else {}
        return autocast(enabled=enabled, recipe=recipe, **kwargs)
    kwargs = {"fp8_group": amax_group} if amax_group is not None else {}
    return te.pytorch.fp8_autocast(enabled=enabled, fp8_recipe=recipe, **kwargs)


def blockwise_unsupported(te: Any) -> str | None:
    """Why this GPU cannot run `Float8BlockScaling` (TE's own check, where it has one), or None."""
    check = getattr(te.pytorch, "is_fp8_block_scaling_available", None)
    if check is None:
        return None if hasattr(te.recipe, "Float8BlockScaling") else "Transformer Engine has no Float8BlockScaling"
    available, reason = check(return_reason=True)
    return None if available else str(reason)


def fp8_checkpoint(te: Any) -> Callable:
    """Activation recompute for code that runs TE modules: `te.pytorch.checkpoint(function,
    *args, use_reentrant=False)`. Its recompute re-enters the forward's FP8 region (recipe and
    all) and torch's autocast state, and the delayed-scaling modules reuse the scales their first
    forward used instead of counting the recompute's amaxes; torch's own checkpoint would rerun
    the projections outside the FP8 region, in another precision than the forward."""

    def checkpoint(function: Callable, *args: Any) -> Any:
        return te.pytorch.checkpoint(function, *args, use_reentrant=False)

    return checkpoint


def fp8_enabled(te: Any) -> bool:
    """Whether the code runs inside an enabled FP8 region."""
    return bool(te.fp8_state_manager.is_fp8_enabled())


def fp8_fits(in_features: int, out_features: int, multiple: int = FP8_DIM_MULTIPLE) -> bool:
    """Whether a projection of this shape can run as an FP8 GEMM at all (16; MXFP8's blocks: 32)."""
    return in_features % multiple == 0 and out_features % multiple == 0


# ---------------------------------------------------------------------------------- FP8 state
def _scaling_meta(module: nn.Module) -> list[Any] | None:
    """TE's forward and backward `FP8TensorMeta` (delayed scaling), or None before the first FP8
    step and for recipes without persistent state."""
    meta = getattr(module, "fp8_meta", None) or {}
    found = [meta.get(key) for key in ("scaling_fwd", "scaling_bwd")]
    if any(
        m is None
        or not isinstance(getattr(m, "amax_history", None), torch.Tensor)
        or not isinstance(getattr(m, "scale", None), torch.Tensor)
        for m in found
    ):
        return None
    return found


def fp8_state_tensor(module: nn.Module) -> torch.Tensor:
    """The module's FP8 scaling state as one flat fp32 CPU tensor (empty when there is none):
    `[version, n_fwd, hist_fwd, cols_fwd, n_bwd, hist_bwd, cols_bwd, scale_fwd, amax_history_fwd,
    scale_bwd, amax_history_bwd]`."""
    metas = _scaling_meta(module)
    if metas is None:
        return torch.empty(0, dtype=torch.float32)
    header, values = [FP8_STATE_VERSION], []
    for meta in metas:
        history = meta.amax_history.reshape(meta.amax_history.shape[0], -1)
        header += [meta.scale.numel(), history.shape[0], history.shape[1]]
        values += [meta.scale.detach().float().reshape(-1).cpu(), history.detach().float().reshape(-1).cpu()]
    return torch.cat([torch.tensor(header, dtype=torch.float32), *values])


def parse_fp8_state(state: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`fp8_state_tensor`'s layout back into [(scale, amax_history)] for forward and backward."""
    flat = state.detach().float().reshape(-1).cpu()
    if flat.numel() < 7 or flat[0].item() != FP8_STATE_VERSION:
        raise ValueError(f"FP8 extra state of {flat.numel()} values is not format {FP8_STATE_VERSION}")
    sizes = [int(v) for v in flat[1:7].tolist()]
    offset, parts = 7, []
    for scales, rows, cols in (sizes[0:3], sizes[3:6]):
        scale = flat[offset : offset + scales]
        offset += scales
        history = flat[offset : offset + rows * cols].reshape(rows, cols)
        offset += rows * cols
        parts.append((scale, history))
    if offset != flat.numel():
        raise ValueError(f"FP8 extra state has {flat.numel()} values, its header describes {offset}")
    return parts


def restore_fp8_state(module: nn.Module, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Copy saved scales and histories into the module's FP8 meta; False when it has none yet
    (the module has not started FP8) or the shapes differ (another recipe)."""
    metas = _scaling_meta(module)
    if metas is None:
        return False
    for meta, (scale, history) in zip(metas, parts):
        if meta.scale.numel() != scale.numel() or meta.amax_history.numel() != history.numel():
            return False
    with torch.no_grad():
        for meta, (scale, history) in zip(metas, parts):
            meta.scale.copy_(scale.reshape(meta.scale.shape))
            meta.amax_history.copy_(history.reshape(meta.amax_history.shape))
            if isinstance(getattr(meta, "scale_inv", None), torch.Tensor):  # TE 1.x keeps it
                meta.scale_inv.copy_(1.0 / meta.scale)
    return True


class FP8StateMixin:
    """k3train's conventions for a TE module: pickle-free FP8 extra state, restored on the first
    FP8 forward when it is loaded before TE has created its meta tensors (a resume), and a
    `keep_out_of_fp8` switch (the recipe's excluded layers, and shapes FP8 GEMMs cannot take)."""

    keep_out_of_fp8: bool = False
    te_namespace: Any = None
    fp8_num_gemms: int = 1

    def _is_first_microbatch(self, weight: torch.Tensor) -> bool | None:
        """TE's `is_first_microbatch` for this call: True when the weight may have changed since
        its FP8 cast was cached (TE casts it again and caches it), False when it cannot have (TE
        reuses the cache: micro-batches after the first, and the recompute of any), None outside
        FP8. "Changed": another tensor, an in-place update autograd counts (`_version`), or
        `new_fp8_weights` since (the optimizer step, writes through `.data` that bump no version)."""
        te = self.te_namespace
        if self.keep_out_of_fp8 or not fp8_enabled(te):
            return None
        key = (weight.data_ptr(), weight._version)
        first = self.__dict__.get("fp8_weight_key") != key
        self.__dict__["fp8_weight_key"] = key
        return first

    def get_extra_state(self) -> torch.Tensor:
        return fp8_state_tensor(cast(nn.Module, self))  # always mixed into a TE module

    def set_extra_state(self, state: Any) -> None:
        if not isinstance(state, torch.Tensor) or state.numel() == 0:
            self.__dict__["pending_fp8_state"] = None  # a bf16 checkpoint: keep the fresh state
            return
        parts = parse_fp8_state(state)
        restored = restore_fp8_state(cast(nn.Module, self), parts)  # always mixed into a TE module
        self.__dict__["pending_fp8_state"] = None if restored else parts

    def _fp8_region(self):
        """The FP8 context this module's GEMMs run in: switched off when it is kept out of FP8."""
        te = self.te_namespace
        if self.keep_out_of_fp8 and fp8_enabled(te):
            return fp8_autocast(te, enabled=False)
        pending = self.__dict__.get("pending_fp8_state")
        if pending is not None and fp8_enabled(te):
            # TE creates its meta tensors on the first FP8 forward; create them now and fill them.
            self.init_fp8_metadata(num_gemms=self.fp8_num_gemms)
            if restore_fp8_state(self, pending):
                self.__dict__["pending_fp8_state"] = None
        return contextlib.nullcontext()


def _drop_te_parallel_marks(param: nn.Parameter) -> None:
    """TE marks its weights for Megatron's TP (`tensor_model_parallel`, `partition_dim`, ...);
    k3train marks its own shards (parallel/tensor.py), so TE's marks would only mislead."""
    for attribute in ("tensor_model_parallel", "partition_dim", "partition_stride"):
        if attribute in vars(param):
            delattr(param, attribute)


@functools.cache
def te_linear_class(te: Any) -> type:
    """`te.pytorch.Linear` with `FP8StateMixin` (one class per TE namespace)."""

    class TELinear(FP8StateMixin, te.pytorch.Linear):
        """`te.Linear(in, out, bias=False)` on this rank's shard; the parameter is `weight [out, in]`."""

        te_namespace = te

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with self._fp8_region():
                return super().forward(x, is_first_microbatch=self._is_first_microbatch(self.weight))

    return TELinear


@functools.cache
def te_grouped_linear_class(te: Any) -> type:
    """`te.pytorch.GroupedLinear` whose weights are not its own parameters but the slices of an
    expert stack `[groups, out, in]` given with each call (`GroupedExperts.w1/w3/w2`, or the
    replicas expert parallelism fetched): the stack stays the one parameter the optimizer,
    ZeRO-1 and checkpoints see, and gradients flow into it through the slices."""

    class TEGroupedLinear(FP8StateMixin, te.pytorch.GroupedLinear):
        te_namespace = te

        def __init__(self, num_gemms: int, in_features: int, out_features: int, **kwargs):
            super().__init__(num_gemms, in_features, out_features, **kwargs)
            self.fp8_num_gemms = num_gemms
            for index in range(num_gemms):  # TE allocated its own weights: drop them
                self._parameters.pop(f"weight{index}", None)
            self.__dict__["stack_slices"] = None

        def __getattr__(self, name: str):
            if name.startswith("weight") and name[6:].isdigit():
                slices = self.__dict__.get("stack_slices")
                if slices is not None:
                    return slices[int(name[6:])]
            return super().__getattr__(name)

        def forward_stack(self, rows: torch.Tensor, m_splits: list[int], stack: torch.Tensor) -> torch.Tensor:
            """`rows [Σ m_splits, in]` grouped by expert through `stack [groups, out, in]`."""
            # One unbind, not one index per expert: its backward stacks the experts' gradients
            # once, where `stack[i]` would build a zero-filled full stack per expert.
            self.__dict__["stack_slices"] = stack.unbind(0)
            try:
                with self._fp8_region():
                    return super().forward(rows, m_splits)
            finally:
                self.__dict__["stack_slices"] = None

    return TEGroupedLinear


# ---------------------------------------------------------------------------------- factory
class TELinearFactory:
    """Builds TE modules for k3train's projections: `factory(in, out)` a `te.Linear` shard,
    `factory.grouped(groups, in, out)` a grouped expert GEMM. `fp8_rows`: the multiple FP8 GEMMs
    need (16; 32 for MXFP8): expert groups are padded to it, projections with a dimension off it
    stay bf16."""

    backend = "te"

    def __init__(self, te: Any, device: torch.device | str | None = None, fp8_rows: int = 16):
        self.te = te
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.fp8_rows = fp8_rows

    def checkpoint(self, function: Callable, *args: Any) -> Any:
        """The activation recompute for code running the modules this factory builds (the
        model's `recompute: sublayer`): TE's checkpoint (`fp8_checkpoint`)."""
        return fp8_checkpoint(self.te)(function, *args)

    def _device(self, device) -> torch.device:
        device = torch.device(device) if device is not None else self.device
        return device if device.type in ("cuda", "meta") else self.device

    def __call__(self, in_features: int, out_features: int, device=None, dtype=None) -> nn.Module:
        linear = te_linear_class(self.te)(
            in_features,
            out_features,
            bias=False,
            params_dtype=dtype or torch.get_default_dtype(),
            device=self._device(device),
        )
        linear.keep_out_of_fp8 = not fp8_fits(in_features, out_features, self.fp8_rows)
        _drop_te_parallel_marks(linear.weight)
        return linear

    def grouped(self, num_groups: int, in_features: int, out_features: int, dtype=None) -> GroupedExpertGEMM:
        module = te_grouped_linear_class(self.te)(
            num_groups,
            in_features,
            out_features,
            bias=False,
            params_dtype=dtype or torch.get_default_dtype(),
            device=self.device,
        )
        module.keep_out_of_fp8 = not fp8_fits(in_features, out_features, self.fp8_rows)
        return GroupedExpertGEMM(module, self.fp8_rows)


class GroupedExpertGEMM(nn.Module):
    """One grouped GEMM of the routed experts through `te.GroupedLinear`: rows sorted by expert
    (`group_ends`, cumulative counts) times each expert's matrix of a stack `[groups, out, in]`.
    Under FP8 every group is padded with zero rows to `fp8_rows` (TE's FP8 GEMMs need it) and
    the padding is dropped from the result. The group sizes are read on the host (TE takes a list)."""

    def __init__(self, grouped_linear: nn.Module, fp8_rows: int):
        super().__init__()
        # a `te_grouped_linear_class` instance: its class is built at run time, per TE namespace
        self.gemm: Any = grouped_linear
        self.fp8_rows = fp8_rows

    def forward(self, rows: torch.Tensor, group_ends: torch.Tensor, stack: torch.Tensor) -> torch.Tensor:
        counts = torch.diff(group_ends, prepend=group_ends.new_zeros(1)).tolist()
        rows = rows[: sum(counts)]
        if self.gemm.keep_out_of_fp8 or not fp8_enabled(self.gemm.te_namespace):
            return self.gemm.forward_stack(rows, counts, stack)
        padded, padded_counts, keep = pad_groups(rows, counts, self.fp8_rows)
        return self.gemm.forward_stack(padded, padded_counts, stack)[keep]


def pad_groups(
    rows: torch.Tensor, counts: Sequence[int], multiple: int
) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Rows grouped by `counts` → (rows with every group zero-padded to a multiple of `multiple`,
    the padded counts, the index of the original rows in the padded tensor)."""
    padded_counts = [-(-count // multiple) * multiple for count in counts]
    padding = GroupPadding.of(counts, padded_counts, rows.device)
    return padding.pad(rows), padded_counts, padding.keep


def linear_factory_for(backend: str, device: torch.device, fp8_recipe: str = "delayed") -> Callable:
    """The factory of a resolved backend (`resolve_linear_backend`)."""
    if backend == "torch":
        return torch_linear
    te, why = import_transformer_engine()
    if te is None:
        raise RuntimeError(f"model.linear_backend=te needs Transformer Engine ({why}); {INSTALL_HINT}")
    return TELinearFactory(te, device, fp8_rows=FP8_GROUP_ROWS.get(fp8_recipe, 16))


def new_fp8_weights(modules: Sequence[nn.Module]) -> int:
    """After the weights of `modules` changed (an optimizer step): the next FP8 forward of each
    TE linear casts its weight again (`is_first_microbatch=True`). Returns how many were told."""
    count = 0
    for root in modules:
        for module in root.modules():
            if isinstance(module, FP8StateMixin):
                module.__dict__["fp8_weight_key"] = None
                count += 1
    return count


def keep_modules_out_of_fp8(modules: Sequence[nn.Module]) -> int:
    """Switch FP8 off in every TE module inside `modules` (the recipe's excluded layers); returns
    how many were switched."""
    count = 0
    for root in modules:
        for module in root.modules():
            if isinstance(module, FP8StateMixin):
                module.keep_out_of_fp8 = True
                count += 1
    return count


def fp8_forward_context(te: Any, recipe, amax_group=None) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the FP8 region every forward pass runs in (inside bf16 autocast)."""
    return lambda: fp8_autocast(te, enabled=True, recipe=recipe, amax_group=amax_group)


__all__ = [
    "FP8_RECIPES",
    "INSTALL_HINT",
    "FP8StateMixin",
    "TENamespace",
    "GroupedExpertGEMM",
    "TELinearFactory",
    "blockwise_unsupported",
    "fp8_autocast",
    "fp8_checkpoint",
    "fp8_forward_context",
    "fp8_state_tensor",
    "import_transformer_engine",
    "keep_modules_out_of_fp8",
    "linear_factory_for",
    "make_fp8_recipe",
    "new_fp8_weights",
    "pad_groups",
    "parse_fp8_state",
    "resolve_linear_backend",
    "restore_fp8_state",
    "te_missing",
    "torch_linear",
]
