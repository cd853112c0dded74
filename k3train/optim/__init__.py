"""Per-Head Muon with AdamW grouping, learning-rate schedules and gradient clipping."""

from k3train.optim.builder import (
    ParamRoute,
    ParameterCost,
    build_optimizer,
    describe_param_groups,
    param_groups,
    parameter_costs,
    route_parameters,
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
from k3train.optim.newton_schulz import NS_COEFFICIENTS, newton_schulz, ns_compute_dtype, ns_cost
from k3train.optim.schedules import lr_at, set_lr

__all__ = [
    "BlockLayout",
    "MuonWorkItem",
    "NS_COEFFICIENTS",
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
    "newton_schulz",
    "ns_compute_dtype",
    "ns_cost",
    "orthogonalized_update",
    "param_groups",
    "parameter_costs",
    "route_parameters",
    "set_lr",
]
