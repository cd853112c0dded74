"""Every numeric recipe field's range is checked at load: one line naming the field, never a
shape error at the first forward or a value that trains meaning something else."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from k3train.config import ConfigError, load_config
from k3train.model.config import FIELD_RANGES, ModelConfig
from k3train.optim.config import OPTIMIZER_RANGES

RECIPES = pathlib.Path(__file__).resolve().parents[2] / "recipes"


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("model.linear_attn_config.chunk_size=0", "model.linear_attn_config.chunk_size must be at least 1, got 0"),
        ("model.linear_attn_config.num_heads=0", "model.linear_attn_config.num_heads must be at least 1, got 0"),
        ("model.linear_attn_config.head_dim=0", "model.linear_attn_config.head_dim must be at least 1, got 0"),
        ("model.routed_expert_hidden_size=0", "model.routed_expert_hidden_size must be at least 1 (or null), got 0"),
        ("model.kv_lora_rank=0", "model.kv_lora_rank must be at least 1, got 0"),
        ("model.num_shared_experts=-1", "model.num_shared_experts must not be negative, got -1"),
        ("optimizer.clip_grad=-1", "optimizer.clip_grad must not be negative, got -1.0"),
        ("model.num_experts_per_token=0", "model.num_experts_per_token must lie in [1, model.num_experts)"),
        ("model.num_attention_heads=-4", "model.num_attention_heads must be at least 1, got -4"),
        ("model.rms_norm_eps=0", "model.rms_norm_eps must be positive"),
        ("optimizer.adam_beta2=1", "optimizer.adam_beta2 must lie in [0, 1), got 1.0"),
        ("optimizer.muon_ns_steps=0", "optimizer.muon_ns_steps must be at least 1"),
        ("schedule.decay_fraction=1.5", "schedule.decay_fraction must lie in [0, 1]"),
    ],
)
def test_an_out_of_range_field_is_one_line_naming_it(override, says):
    with pytest.raises(ConfigError) as caught:
        load_config(str(RECIPES / "debug.yaml"), [override])
    message = str(caught.value)
    assert says in message and "\n" not in message, message


@pytest.mark.parametrize("name", sorted(FIELD_RANGES))
def test_every_ranged_model_field_refuses_a_value_below_its_range(name):
    """Each entry of the table is checked: its kind's first value outside the range is refused."""
    kind = FIELD_RANGES[name]
    below = 0 if kind.startswith("at_least_one") or kind == "positive" else -1
    section, _, field_name = name.rpartition(".")
    config = ModelConfig()
    target = getattr(config, section) if section else config
    current = getattr(target, field_name)
    setattr(target, field_name, below if current is None else type(current)(below))
    with pytest.raises(ValueError, match=rf"model\.{name} must"):
        config.validate()


def test_every_numeric_model_and_optimizer_field_has_a_range():
    def numeric(obj, prefix=""):
        for item in dataclasses.fields(obj):
            value = getattr(obj, item.name)
            if dataclasses.is_dataclass(value):
                yield from numeric(value, f"{prefix}{item.name}.")
            elif item.type in ("int", "float", "int | None", "float | None") and item.name not in UNRANGED:
                yield f"{prefix}{item.name}"

    from k3train.optim.config import OptimizerConfig

    UNRANGED = {"first_k_dense_replace", "num_experts_per_token", "gate_lower_bound"}  # checked in validate
    assert set(numeric(ModelConfig())) <= set(FIELD_RANGES)
    assert set(numeric(OptimizerConfig())) <= set(OPTIMIZER_RANGES)


@pytest.mark.parametrize(
    "recipe", sorted(str(p.relative_to(RECIPES)) for p in [*RECIPES.glob("*.yaml"), *RECIPES.glob("ladder/*.yaml")])
)
def test_every_shipped_recipe_is_inside_the_ranges(recipe):
    load_config(str(RECIPES / recipe))
