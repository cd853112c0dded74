"""Per-Head Muon with AdamW grouping, learning-rate schedules and gradient clipping."""

from __future__ import annotations

from typing import TYPE_CHECKING

from k3train.lazy_exports import lazy_exports

if TYPE_CHECKING:  # static tools and IDEs see the real imports
    from k3train.optim.builder import (
        ParameterCost,
        ParamRoute,
        build_optimizer,
        describe_param_groups,
        param_groups,
        parameter_costs,
        route_parameters,
        summarize_param_groups,
    )
    from k3train.optim.clip import NormShare, clip_grad_norm_, grad_squared_norm
    from k3train.optim.config import OptimizerConfig, ScheduleConfig
    from k3train.optim.muon import (
        BlockLayout,
        MuonWorkItem,
        PerHeadMuon,
        block_layout,
        orthogonalized_update,
    )
    from k3train.optim.newton_schulz import NS_COEFFICIENTS, ns_compute_dtype, ns_cost
    from k3train.optim.schedules import lr_at, set_lr

# Each name loads its submodule on first use, so that importing `k3train.optim.config` (as the
# torch-free config loader does) does not import torch through this package. (`newton_schulz` is
# the submodule here; the function is `k3train.optim.newton_schulz.newton_schulz`.)
_SUBMODULE_OF = {
    "NS_COEFFICIENTS": "k3train.optim.newton_schulz",
    "BlockLayout": "k3train.optim.muon",
    "MuonWorkItem": "k3train.optim.muon",
    "NormShare": "k3train.optim.clip",
    "OptimizerConfig": "k3train.optim.config",
    "ParamRoute": "k3train.optim.builder",
    "ParameterCost": "k3train.optim.builder",
    "PerHeadMuon": "k3train.optim.muon",
    "ScheduleConfig": "k3train.optim.config",
    "block_layout": "k3train.optim.muon",
    "build_optimizer": "k3train.optim.builder",
    "clip_grad_norm_": "k3train.optim.clip",
    "describe_param_groups": "k3train.optim.builder",
    "grad_squared_norm": "k3train.optim.clip",
    "lr_at": "k3train.optim.schedules",
    "ns_compute_dtype": "k3train.optim.newton_schulz",
    "ns_cost": "k3train.optim.newton_schulz",
    "orthogonalized_update": "k3train.optim.muon",
    "param_groups": "k3train.optim.builder",
    "parameter_costs": "k3train.optim.builder",
    "route_parameters": "k3train.optim.builder",
    "set_lr": "k3train.optim.schedules",
    "summarize_param_groups": "k3train.optim.builder",
}

__all__ = [
    "NS_COEFFICIENTS",
    "BlockLayout",
    "MuonWorkItem",
    "OptimizerConfig",
    "NormShare",
    "ParamRoute",
    "ParameterCost",
    "PerHeadMuon",
    "ScheduleConfig",
    "block_layout",
    "build_optimizer",
    "clip_grad_norm_",
    "describe_param_groups",
    "grad_squared_norm",
    "lr_at",
    "ns_compute_dtype",
    "ns_cost",
    "orthogonalized_update",
    "param_groups",
    "parameter_costs",
    "route_parameters",
    "set_lr",
    "summarize_param_groups",
]


__getattr__, __dir__ = lazy_exports(__name__, _SUBMODULE_OF)
