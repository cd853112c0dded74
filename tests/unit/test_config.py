"""Config loading: recipes, overrides, strict errors, round trips, and the generated docs."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from k3train.config import (
    ConfigError,
    JobConfig,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    load_config,
    save_config,
)
from k3train.config.command_line import parse_job_args, parse_job_args_or_exit
from k3train.config.reference import config_reference_markdown
from k3train.model.config import ModelConfig

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]
DEBUG = str(CHECKOUT / "recipes" / "debug.yaml")
K3 = str(CHECKOUT / "recipes" / "k3.yaml")


def write_recipe(tmp_path: pathlib.Path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


def config_error(recipe: str | None, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(recipe, overrides)
    return str(info.value)


# ---------------------------------------------------------------- recipes


def test_debug_recipe_loads():
    cfg = load_config(DEBUG, [])
    assert cfg.model == ModelConfig()
    assert cfg.train.device == "cpu"


def test_k3_recipe_is_the_k3_preset():
    cfg = load_config(K3, [])
    # the preset's architecture, with the recipe's memory choice on top (exact: same numbers)
    assert cfg.model == ModelConfig.preset("k3").replace(recompute_glu=True, linear_backend="torch")
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep) == (8, 16, 64)
    assert sum(cfg.parallel.pipeline_layers) == cfg.model.num_hidden_layers


def test_no_recipe_gives_defaults():
    assert load_config(None, []) == JobConfig()


# ---------------------------------------------------------------- overrides


def test_overrides_change_fields():
    cfg = load_config(
        DEBUG, ["train.steps=50", "optimizer.lr=3e-4", "model.linear_attn_config.num_heads=8", "model.attn_res=full"]
    )
    assert cfg.train.steps == 50
    assert cfg.optimizer.lr == 3e-4 and isinstance(cfg.optimizer.lr, float)
    assert cfg.model.linear_attn_config.num_heads == 8
    assert cfg.model.linear_attn_config.head_dim == 32  # the rest of the nested section is kept
    assert cfg.model.attn_res == "full"


def test_override_coercions():
    cfg = load_config(
        None,
        [
            "logging.wandb=yes",
            "parallel.zero1=0",
            "parallel.sequence_parallel=True",
            "checkpoint.dir=null",
            "model.q_lora_rank=null",
            "data.tokenizer=yes",
            "parallel.pp=2",
            "parallel.pipeline_layers=[3,5]",
            "data.paths=[a, b]",
            "data.weights=[1, 2.5]",
            "train.steps=1e3",
            "logging.peak_tflops=989",
        ],
    )
    assert cfg.logging.wandb is True and cfg.parallel.zero1 is False
    assert cfg.parallel.sequence_parallel is True
    assert cfg.checkpoint.dir is None and cfg.model.q_lora_rank is None
    assert cfg.data.tokenizer == "yes"  # a string field takes the text, not YAML's boolean
    assert cfg.parallel.pipeline_layers == [3, 5]
    assert cfg.data.paths == ["a", "b"] and cfg.data.weights == [1.0, 2.5]
    assert cfg.train.steps == 1000
    assert cfg.logging.peak_tflops == 989.0 and isinstance(cfg.logging.peak_tflops, float)


def test_apply_overrides_returns_a_validated_copy():
    base = load_config(DEBUG, [])
    changed = apply_overrides(base, ["train.steps=3"])
    assert changed.train.steps == 3 and base.train.steps == 100
    with pytest.raises(ConfigError):
        apply_overrides(base, ["train.micro_batch_size=3"])


def test_override_without_equals_sign():
    message = config_error(None, ["train.steps"])
    assert "train.steps" in message and "section.field=value" in message


def test_unknown_override_key_suggests():
    message = config_error(None, ["train.lr=1"])
    assert "train.lr" in message and "optimizer.lr" in message
    assert "train.steps" in config_error(None, ["trian.steps=1"])


def test_wrong_type():
    message = config_error(None, ["train.steps=abc"])
    assert "train.steps" in message and "'abc'" in message and "int" in message
    assert "\n" not in message


def test_bad_literal_names_the_choices():
    message = config_error(None, ["model.attn_res=blocks"])
    assert "model.attn_res" in message and "blocks" in message
    assert all(choice in message for choice in ("block", "full", "none"))


def test_section_needs_a_mapping():
    assert "section" in config_error(None, ["model=3"])


# ---------------------------------------------------------------- recipe errors


def test_unknown_key_in_recipe(tmp_path):
    recipe = write_recipe(tmp_path, "optimizer:\n  lrr: 0.1\n")
    message = config_error(recipe, [])
    assert "optimizer.lrr" in message and "optimizer.lr" in message and recipe in message


def test_unknown_nested_key_in_recipe(tmp_path):
    recipe = write_recipe(tmp_path, "model:\n  linear_attn_config:\n    num_head: 8\n")
    message = config_error(recipe, [])
    assert "model.linear_attn_config.num_head" in message
    assert "model.linear_attn_config.num_heads" in message


def test_unknown_section(tmp_path):
    message = config_error(write_recipe(tmp_path, "trainer:\n  steps: 3\n"), [])
    assert "trainer" in message and "train" in message


def test_wrong_type_in_recipe(tmp_path):
    message = config_error(write_recipe(tmp_path, "train:\n  precision: fp16\n"), [])
    assert "train.precision" in message and "fp32" in message and "bf16" in message


def test_scientific_notation_string_is_a_float(tmp_path):
    # PyYAML (YAML 1.1) reads 3e-4 as the string "3e-4".
    cfg = load_config(write_recipe(tmp_path, "optimizer:\n  lr: 3e-4\n"), [])
    assert cfg.optimizer.lr == 3e-4 and isinstance(cfg.optimizer.lr, float)


def test_empty_section_keeps_defaults(tmp_path):
    cfg = load_config(write_recipe(tmp_path, "logging:\n  # jsonl: false\ntrain:\n  steps: 5\n"), [])
    assert cfg.logging.jsonl is True and cfg.train.steps == 5


def test_duplicate_key_and_bad_yaml(tmp_path):
    assert "duplicate key 'steps'" in config_error(write_recipe(tmp_path, "train:\n  steps: 3\n  steps: 4\n"), [])
    assert "line 2" in config_error(write_recipe(tmp_path, "train:\n  steps: [3\n"), [])
    assert "not found" in config_error(str(tmp_path / "missing.yaml"), [])


# ---------------------------------------------------------------- validation


def test_cross_field_validation_names_both_fields():
    message = config_error(None, ["train.global_batch_size=6"])
    assert "train.global_batch_size" in message and "train.micro_batch_size" in message
    assert "parallel.pipeline_layers" in config_error(None, ["parallel.pp=2", "parallel.pipeline_layers=[4,5]"])
    assert "parallel.tp" in config_error(None, ["parallel.tp=3"])


def test_model_validation_becomes_config_error():
    message = config_error(None, ["model.num_experts_per_token=40"])
    assert "num_experts_per_token" in message


# ---------------------------------------------------------------- saving


@pytest.mark.parametrize(
    "recipe, overrides",
    [
        (DEBUG, ["optimizer.lr=3e-4", "data.paths=['yes', '1']", "parallel.pp=2", "parallel.pipeline_layers=[3,5]"]),
        (K3, []),
    ],
)
def test_save_load_round_trip(tmp_path, recipe, overrides):
    cfg = load_config(recipe, overrides)
    path = str(tmp_path / "run" / "config.yaml")
    save_config(cfg, path)
    assert load_config(path, []) == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg


# ---------------------------------------------------------------- docs and command line


def test_docs_not_drifted():
    committed = (CHECKOUT / "docs" / "config.md").read_text(encoding="utf-8")
    assert committed == config_reference_markdown(), "run python tools/gen_config_docs.py"


def test_docs_cover_every_field():
    text = config_reference_markdown()
    for key in (
        "model.linear_attn_config.num_heads",
        "parallel.expert_dispatch",
        "optimizer.adam_beta1",
        "train.max_nonfinite_steps",
        "logging.peak_tflops",
        "data.weights",
    ):
        assert f"`{key}`" in text


def test_parse_job_args():
    cfg, run_dir = parse_job_args(["--recipe", DEBUG, "--run-dir", "/tmp/r", "train.steps=7"])
    assert cfg.train.steps == 7 and run_dir == "/tmp/r"
    assert parse_job_args(["--recipe", DEBUG])[1] is None


def test_help_config_exits_zero(capsys):
    with pytest.raises(SystemExit) as info:
        parse_job_args(["--help-config"])
    assert info.value.code == 0
    assert "model.linear_attn_config.num_heads" in capsys.readouterr().out


def test_command_line_errors_exit_two(capsys):
    with pytest.raises(SystemExit) as info:
        parse_job_args(["--no-such-flag"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        parse_job_args_or_exit(["train.steps=abc"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "train.steps" in err and "abc" in err


def test_config_and_command_line_do_not_import_torch():
    """`pretrain_k3.py --help` and config errors must answer before torch loads (seconds)."""
    code = (
        "import sys\n"
        "import k3train.config.command_line, k3train.config, k3train.config.reference, k3train.training.threads\n"
        "import k3train.cache, k3train.job.signals, k3train.data.indexed_dataset, k3train.job.ending\n"
        "import k3train.path_arguments, k3train.job.preflight\n"
        "from k3train.data.config import DataConfig\n"
        "from k3train.optim.config import OptimizerConfig\n"
        "from k3train.checkpoint.config import CheckpointConfig\n"
        f"k3train.config.load_config({DEBUG!r}, ['train.steps=2'])\n"
        "k3train.config.reference.config_reference_markdown()\n"
        "print(sorted(name for name in sys.modules if name == 'torch' or name.startswith('torch.')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=CHECKOUT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# ---------------------------------------------------------------- each rule stated once


def test_batch_split_rule_is_one_function():
    """The config (with parallel.dp) and the trainer (with the resolved dp) ask the same method."""
    train = load_config(None, []).train  # global 8, micro 4
    assert train.micro_batches_per_rank(1) == 2 and train.micro_batches_per_rank(2) == 1
    with pytest.raises(ConfigError) as info:
        train.micro_batches_per_rank(4)
    message = str(info.value)
    assert "train.global_batch_size (8)" in message and "train.micro_batch_size" in message
    assert "use train.global_batch_size=16" in message and "\n" not in message
    assert message in config_error(None, ["parallel.dp=4"])


def test_layout_rules_at_load_and_at_start_up_are_the_same_check():
    from k3train.parallel.config import ModelSplitSizes
    from k3train.parallel.pipeline_schedule import partition_layers
    from k3train.parallel.state import LayoutError, resolve_layout

    with pytest.raises(LayoutError) as at_start:
        resolve_layout(
            3,
            tp=3,
            pp=1,
            dp=0,
            ep=1,
            virtual_stages=1,
            model=ModelSplitSizes(mla_heads=4, kda_heads=4, vocab_size=384, num_experts=16, num_layers=8),
        )
    assert config_error(None, ["parallel.tp=3"]).endswith(str(at_start.value))
    with pytest.raises(LayoutError) as at_start:
        partition_layers(8, 4, 3)
    assert config_error(None, ["parallel.pp=4", "parallel.virtual_stages=3"]).endswith(str(at_start.value))


def test_data_section_checks_itself_once():
    from k3train.data import DataConfig, build_data

    bad = DataConfig(paths=["a", "b"], weights=[1.0])
    with pytest.raises(ConfigError) as when_built:
        build_data(bad, 8, 1, 384)
    message = str(when_built.value)
    assert "data.weights has 1 entries but data.paths has 2" in message and "one weight per path" in message
    assert config_error(None, ["data.paths=[a, b]", "data.weights=[1.0]"]).endswith(message)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["parallel.ep_overlap_chunks=0"], "parallel.ep_overlap_chunks >= 1"),
        (["parallel.ep_overlap_chunks=2", "train.micro_batch_size=1"], "train.micro_batch_size >= 2"),
        (["parallel.ep_overlap_chunks=2", "model.recompute=sublayer"], "model.recompute"),
    ],
)
def test_overlap_halves_names_what_it_needs(overrides, named):
    message = config_error(DEBUG, ["parallel.ep_overlap_halves=true", *overrides])
    assert "parallel.ep_overlap_halves=true needs" in message and named in message
    assert "\n" not in message
    load_config(DEBUG, ["parallel.ep_overlap_halves=true", "parallel.ep_overlap_chunks=2"])  # the fields it needs
