"""The job's configuration: one typed dataclass per concern, strict YAML loading, overrides.

A recipe is a YAML mapping of sections (the fields of `JobConfig`) to their fields; nested
dataclasses nest in YAML and take more dots on the command line
(`model.linear_attn_config.num_heads=8`). Loading is strict: an unknown key, a wrong type or an
inconsistent combination is a `ConfigError` whose message names the field, the file or override
it came from, and what would be accepted. Everything here walks the dataclass tree generically,
so a field added to any section is loadable, overridable and documented without touching this
module.

    cfg, run_dir = parse_job_args(["--recipe", "recipes/debug.yaml", "train.steps=5"])
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import difflib
import inspect
import json
import math
import os
import sys
import tempfile
import textwrap
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence, Union

import yaml

from k3train.data.config import DataConfig
from k3train.model.config import ModelConfig
from k3train.optim.config import OptimizerConfig, ScheduleConfig

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "JobConfig",
    "LoggingConfig",
    "ParallelConfig",
    "TrainConfig",
    "apply_overrides",
    "config_from_dict",
    "config_reference_markdown",
    "config_to_dict",
    "field_docs",
    "load_config",
    "parse_job_args",
    "parse_job_args_or_exit",
    "save_config",
]


class ConfigError(ValueError):
    """A recipe, override or combination of fields that cannot be used; the message says which
    field, where it came from, and how to fix it (one line, or a few short ones)."""


def _check(checks: Sequence[tuple[bool, str]]) -> None:
    """Raise ConfigError with the message of the first failed (ok, message) pair."""
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


# ====================================================================== sections


@dataclass
class ParallelConfig:
    """How the job is split across processes (SPEC §2). Only values are checked here; whether the
    layout fits the world size is checked by the parallel code at start-up."""

    tp: int = 1
    """Tensor-parallel size (attention heads and expert/MLP widths split across ranks)."""
    pp: int = 1
    """Pipeline-parallel size (stages of consecutive decoder layers)."""
    dp: int = 0
    """Data-parallel size; 0 means whatever is left of the world size (world / (tp * pp))."""
    ep: int = 1
    """Expert-parallel size for the MoE layers, carved out of dp * tp; must divide model.num_experts."""
    cp: int = 1
    """Context-parallel size (reserved; 1 for now)."""
    virtual_stages: int = 1
    """Virtual pipeline stages per rank (interleaved 1F1B when > 1; needs pp > 1)."""
    sequence_parallel: bool = False
    """Split the sequence dimension of norms and residual activations across the TP ranks."""
    zero1: bool = True
    """Shard the optimizer state across the data-parallel ranks (ZeRO-1)."""
    pipeline_layers: Optional[list[int]] = None
    """Decoder layers per pipeline chunk, overriding the even split: pp * virtual_stages entries in
    chunk order (chunk c runs on rank c mod pp), summing to model.num_hidden_layers; null splits
    evenly."""
    expert_dispatch: Literal["balanced", "capacity"] = "balanced"
    """Fixed-size expert dispatch (SPEC §2.2): 'balanced' replicates overloaded experts onto
    underloaded ranks; 'capacity' drops slots beyond capacity_factor."""
    capacity_factor: float = 1.25
    """Slots per (source, destination) rank pair, as a multiple of the even share tokens * top_k / ep."""
    max_replicas_per_rank: int = 2
    """'balanced' dispatch: the most replicated experts one rank hosts in a step."""

    def validate(self) -> None:
        """Raise ConfigError naming the first out-of-range field."""
        sizes = {"tp": self.tp, "pp": self.pp, "ep": self.ep, "cp": self.cp,
                 "virtual_stages": self.virtual_stages}
        _check([(value >= 1, f"parallel.{name} must be at least 1, got {value}")
                for name, value in sizes.items()])
        _check([
            (self.dp >= 0, f"parallel.dp must be 0 (the rest of the world size) or positive, "
                           f"got {self.dp}"),
            (self.virtual_stages == 1 or self.pp > 1,
             f"parallel.virtual_stages={self.virtual_stages} needs parallel.pp > 1 (interleaving splits pipeline stages)"),
            (self.capacity_factor > 0, f"parallel.capacity_factor must be positive, got {self.capacity_factor}"),
            (self.max_replicas_per_rank >= 1,
             f"parallel.max_replicas_per_rank must be at least 1, got {self.max_replicas_per_rank}"),
        ])
        if self.pipeline_layers is not None:
            chunks = self.pp * self.virtual_stages
            _check([
                (len(self.pipeline_layers) == chunks,
                 f"parallel.pipeline_layers has {len(self.pipeline_layers)} entries but parallel.pp * "
                 f"parallel.virtual_stages = {chunks}; give one layer count per pipeline chunk"),
                (all(n >= 0 for n in self.pipeline_layers),
                 f"parallel.pipeline_layers must not be negative, got {self.pipeline_layers}"),
            ])


@dataclass
class TrainConfig:
    """The step loop: how long, how big, on what, and when to log and evaluate."""

    steps: int = 100
    """Optimizer steps to train for (the total, counting steps done before a resume)."""
    global_batch_size: int = 8
    """Samples per optimizer step, over all data-parallel ranks and micro-batches."""
    micro_batch_size: int = 4
    """Samples per micro-batch on one data-parallel rank."""
    seed: int = 1234
    """Seed of parameter initialisation and every other random choice of the run."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """Compute dtype of parameters and activations (AttnRes scores, router and QB stay fp32)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """'auto' uses CUDA when available, else the CPU."""
    log_interval: int = 1
    """Steps between metric lines."""
    eval_interval: int = 0
    """Steps between validation passes; 0 means never."""
    eval_batches: int = 2
    """Global batches per validation pass."""
    max_nonfinite_steps: int = 3
    """Stop after this many consecutive steps with a NaN/Inf loss or gradient norm (each is skipped)."""
    num_threads: int = 0
    """Intra-op CPU threads per process; 0 keeps torch's default."""

    def validate(self) -> None:
        """Raise ConfigError naming the first out-of-range field."""
        _check([
            (self.steps >= 1, f"train.steps must be at least 1, got {self.steps}"),
            (self.global_batch_size >= 1, f"train.global_batch_size must be at least 1, got {self.global_batch_size}"),
            (self.micro_batch_size >= 1, f"train.micro_batch_size must be at least 1, got {self.micro_batch_size}"),
            (self.global_batch_size % self.micro_batch_size == 0,
             f"train.global_batch_size ({self.global_batch_size}) must be a multiple of "
             f"train.micro_batch_size ({self.micro_batch_size})"),
            (self.log_interval >= 1, f"train.log_interval must be at least 1, got {self.log_interval}"),
            (self.eval_interval >= 0, f"train.eval_interval must be 0 (never) or positive, got {self.eval_interval}"),
            (self.eval_batches >= 1, f"train.eval_batches must be at least 1, got {self.eval_batches}"),
            (self.max_nonfinite_steps >= 1,
             f"train.max_nonfinite_steps must be at least 1, got {self.max_nonfinite_steps}"),
            (self.num_threads >= 0, f"train.num_threads must be 0 (torch default) or positive, got {self.num_threads}"),
        ])


@dataclass
class CheckpointConfig:
    """Where and when checkpoints are written, and what a run resumes from."""

    dir: Optional[str] = None
    """Checkpoint directory; null means RUN_DIR/checkpoints."""
    interval: int = 0
    """Steps between checkpoints; 0 means only at the end (when save_at_end)."""
    keep_last: int = 3
    """How many of the newest complete checkpoints to keep; 0 keeps all."""
    resume: str = "auto"
    """'auto' resumes from the newest complete checkpoint in dir if there is one; 'none' starts
    fresh; anything else is the path of a checkpoint to resume from."""
    save_at_end: bool = True
    """Write a checkpoint after the last step."""

    def validate(self) -> None:
        """Raise ConfigError naming the first out-of-range field."""
        _check([
            (self.interval >= 0, f"checkpoint.interval must be 0 (only at the end) or positive, got {self.interval}"),
            (self.keep_last >= 0, f"checkpoint.keep_last must be 0 (keep all) or positive, got {self.keep_last}"),
            (self.resume != "", "checkpoint.resume must be 'auto', 'none' or a checkpoint path, got an empty string"),
        ])


@dataclass
class LoggingConfig:
    """Metric sinks (the console always gets a line every train.log_interval steps)."""

    jsonl: bool = True
    """Write metrics.jsonl in the run directory."""
    tensorboard: bool = False
    """Write TensorBoard event files (needs the tensorboard package)."""
    wandb: bool = False
    """Log to Weights & Biases (needs the wandb package)."""
    wandb_project: str = "k3train"
    """W&B project name."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """W&B mode; 'offline' writes locally for a later `wandb sync`."""
    peak_tflops: Optional[float] = None
    """Peak dense TFLOP/s per device used for MFU; null looks it up from the device name."""

    def validate(self) -> None:
        """Raise ConfigError naming the first out-of-range field."""
        _check([
            (self.peak_tflops is None or self.peak_tflops > 0,
             f"logging.peak_tflops must be positive or null, got {self.peak_tflops}"),
        ])


@dataclass
class JobConfig:
    """A whole training job: one section per concern, in the order data flows (SPEC §2)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The architecture (defaults: the CPU debug model)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The parallel layout."""
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets, tokenizer and packing."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Per-Head Muon / AdamW settings."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The step loop."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metric sinks."""

    def validate(self) -> None:
        """Check every section's values, then the fields that must agree across sections.

        Raises ConfigError; a section's own ValueError (e.g. from `ModelConfig.validate`) is
        re-raised as ConfigError. Whether the parallel layout fits the world size is left to the
        parallel code, which knows the world size.
        """
        for section_field in dataclasses.fields(self):
            section = getattr(self, section_field.name)
            validate = getattr(section, "validate", None)
            if callable(validate):
                try:
                    validate()
                except ConfigError:
                    raise
                except ValueError as error:
                    raise ConfigError(str(error)) from None

        model, par, train, data = self.model, self.parallel, self.train, self.data
        _check([
            (par.dp == 0 or train.global_batch_size % (train.micro_batch_size * par.dp) == 0,
             f"train.global_batch_size ({train.global_batch_size}) must be a multiple of "
             f"train.micro_batch_size * parallel.dp ({train.micro_batch_size} * {par.dp})"),
            (model.num_experts == 0 or model.num_experts % par.ep == 0,
             f"parallel.ep ({par.ep}) must divide model.num_experts ({model.num_experts})"),
            (model.num_attention_heads % par.tp == 0,
             f"parallel.tp ({par.tp}) must divide model.num_attention_heads ({model.num_attention_heads})"),
            (model.linear_attn_config.num_heads % par.tp == 0,
             f"parallel.tp ({par.tp}) must divide model.linear_attn_config.num_heads "
             f"({model.linear_attn_config.num_heads})"),
            (par.pipeline_layers is None or sum(par.pipeline_layers) == model.num_hidden_layers,
             f"parallel.pipeline_layers sums to {sum(par.pipeline_layers or [])} but "
             f"model.num_hidden_layers is {model.num_hidden_layers}"),
            (data.weights is None or len(data.weights) == len(data.paths),
             f"data.weights has {len(data.weights or [])} entries but data.paths has {len(data.paths)}; "
             f"give one weight per path or null"),
            (data.seq_length >= 1, f"data.seq_length must be at least 1, got {data.seq_length}"),
            (self.optimizer.lr >= 0, f"optimizer.lr must not be negative, got {self.optimizer.lr}"),
            (self.schedule.warmup_steps >= 0,
             f"schedule.warmup_steps must not be negative, got {self.schedule.warmup_steps}"),
            (0 <= self.schedule.min_lr_ratio <= 1,
             f"schedule.min_lr_ratio must lie in [0, 1], got {self.schedule.min_lr_ratio}"),
        ])


# ====================================================================== introspection


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _field_types(cls: type) -> dict[str, Any]:
    """Resolved type of every init field of a dataclass, in declaration order.

    `typing.get_type_hints` resolves string annotations (modules using
    `from __future__ import annotations`) in the defining module's namespace.
    """
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _union_args(tp: Any) -> Optional[tuple[Any, ...]]:
    """The members of a `Union[...]`/`X | Y` type, or None for any other type."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return typing.get_args(tp)
    return None


def _nested_dataclass(tp: Any) -> Optional[type]:
    """The dataclass a field holds (directly or as Optional[...]), else None."""
    if _is_dataclass_type(tp):
        return tp
    members = _union_args(tp)
    if members is not None:
        classes = [m for m in members if _is_dataclass_type(m)]
        if len(classes) == 1 and all(m is type(None) or m is classes[0] for m in members):
            return classes[0]
    return None


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (and its dataclass bases): the string literal on the
    line(s) right after each field. Fields without one are absent."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # no source on disk (frozen or generated class)
            continue
        class_nodes = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)]
        if not class_nodes:
            continue
        body = class_nodes[0].body
        for statement, following in zip(body, body[1:]):
            if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


def _leaf_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key under a dataclass: sections/nested dataclasses and their fields."""
    keys: list[str] = []
    for name, tp in _field_types(cls).items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        nested = _nested_dataclass(tp)
        if nested is not None:
            keys.extend(_leaf_keys(nested, dotted + "."))
    return keys


def _type_name(tp: Any) -> str:
    """A short, readable name of a field type, used by the docs and in error messages."""
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    members = _union_args(tp)
    if members is not None:
        named = [_type_name(m) for m in members if m is not type(None)]
        text = " or ".join(named)
        return f"{text} or null" if type(None) in members else text
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(choice) for choice in typing.get_args(tp))
    if origin is not None:
        args = ", ".join("..." if a is Ellipsis else _type_name(a) for a in typing.get_args(tp))
        return f"{origin.__name__}[{args}]" if args else origin.__name__
    return getattr(tp, "__name__", str(tp))


# ====================================================================== coercion


class _Mismatch(Exception):
    """Internal: a value that does not fit a type; turned into a ConfigError with context."""

    def __init__(self, key: str, value: Any, tp: Any, hint: str = "") -> None:
        super().__init__(key)
        self.key, self.value, self.tp, self.hint = key, value, tp, hint


_TRUE_WORDS = frozenset({"true", "yes", "on", "1"})
_FALSE_WORDS = frozenset({"false", "no", "off", "0"})


def _coerce(value: Any, tp: Any, key: str, raw: Optional[str]) -> Any:
    """Convert a YAML value to a field's type, accepting the spellings users expect.

    `raw` is the command-line text of the value when there is one: a `str` field then takes the
    text itself, so `data.tokenizer=yes` means the string "yes" and not YAML's boolean.
    """
    if tp is Any or tp is object:
        return value
    if tp is type(None):
        if value is None:
            return None
        raise _Mismatch(key, value, tp)

    members = _union_args(tp)
    if members is not None:
        if value is None and type(None) in members:
            return None
        for member in members:
            if member is type(None):
                continue
            try:
                return _coerce(value, member, key, raw)
            except _Mismatch:
                continue
        raise _Mismatch(key, value, tp)

    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        for choice in choices:
            if value == choice and type(value) is type(choice):
                return choice
        if raw is not None and raw.strip() in choices:
            return raw.strip()
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        raise _Mismatch(key, value, tp, f"did you mean {close[0]}?" if close else "")

    if origin in (list, tuple, set, frozenset) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _Mismatch(key, value, tp, "write a list such as [1, 2]")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise _Mismatch(key, value, tp, f"give exactly {len(args)} items")
            item_types = list(args)
        else:
            item_types = [args[0] if args else Any] * len(value)
        items = [_coerce(v, t, f"{key}[{i}]", None) for i, (v, t) in enumerate(zip(value, item_types))]
        container = origin or tp
        return items if container is list else container(items)

    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise _Mismatch(key, value, tp, "write a mapping such as {a: 1}")
        key_type, value_type = typing.get_args(tp) or (Any, Any)
        return {_coerce(k, key_type, f"{key}.{k}", None): _coerce(v, value_type, f"{key}.{k}", None)
                for k, v in value.items()}

    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE_WORDS | _FALSE_WORDS:
            return value.strip().lower() in _TRUE_WORDS
        raise _Mismatch(key, value, tp, "use true or false")

    if tp is int:
        if isinstance(value, bool):
            raise _Mismatch(key, value, tp)
        if isinstance(value, int):
            return value
        number = value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                try:
                    number = float(value.strip())  # "1e3" is a string to YAML 1.1
                except ValueError:
                    raise _Mismatch(key, value, tp) from None
        if isinstance(number, float) and math.isfinite(number) and number.is_integer():
            return int(number)
        raise _Mismatch(key, value, tp)

    if tp is float:
        if isinstance(value, bool):
            raise _Mismatch(key, value, tp)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            # PyYAML follows YAML 1.1, where 3e-4 (no dot) is a string, not a float.
            try:
                return float(value.strip())
            except ValueError:
                raise _Mismatch(key, value, tp) from None
        raise _Mismatch(key, value, tp)

    if tp is str:
        if isinstance(value, str):
            return value
        if raw is not None:
            return raw.strip()
        raise _Mismatch(key, value, tp, "quote it in YAML to make it a string")

    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise _Mismatch(key, value, tp)


def _mismatch_message(mismatch: _Mismatch, where: str) -> str:
    given = "null" if mismatch.value is None else repr(mismatch.value)
    hint = f"; {mismatch.hint}" if mismatch.hint else ""
    return f"{where}: {mismatch.key} expects {_type_name(mismatch.tp)}, got {given}{hint}"


def _unknown_key_message(dotted: str, where: str) -> str:
    """'unknown key' with the closest valid keys: the same field name in another section first (a
    field put in the wrong section is a common slip), then siblings spelled alike, then any key of
    the same depth spelled alike."""
    all_keys = _leaf_keys(JobConfig)
    parent, _, leaf = dotted.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in all_keys if k.rpartition(".")[0] == parent}
    same_depth = [k for k in all_keys if k.count(".") == dotted.count(".")]
    suggestions = [k for k in all_keys if k.rpartition(".")[2] == leaf]
    suggestions += [siblings[name] for name in difflib.get_close_matches(leaf, list(siblings), n=3, cutoff=0.6)]
    suggestions += difflib.get_close_matches(dotted, same_depth, n=3, cutoff=0.8)
    unique = list(dict.fromkeys(suggestions))[:3]
    if unique:
        fix = "did you mean " + (", ".join(unique[:-1]) + " or " if len(unique) > 1 else "") + unique[-1] + "?"
    else:
        # List what exists at the first level of the key that does not exist.
        parts = dotted.split(".")
        depth = next((i for i in range(len(parts)) if ".".join(parts[: i + 1]) not in all_keys), len(parts) - 1)
        level = ".".join(parts[:depth])
        names = [k.rpartition(".")[2] for k in all_keys if k.rpartition(".")[0] == level]
        fix = (f"valid keys{' under ' + level if level else ''}: {', '.join(names)}" if names
               else f"{level} is a field, not a section")
    return f"{where}: unknown key '{dotted}'; {fix}"


def _resolve_value(current: Any, tp: Any, value: Any, dotted: str, where: str, raw: Optional[str]) -> Any:
    """The new value of a field: a mapping onto a nested dataclass merges into its current value
    (so a recipe need only name the fields it changes); anything else is coerced to the type."""
    nested = _nested_dataclass(tp)
    if nested is not None and value is None and _union_args(tp) is None:
        value = {}  # a section whose lines are all commented out reads as null: nothing to change
    if nested is not None and isinstance(value, Mapping):
        base = current if isinstance(current, nested) else nested()
        return _apply_mapping(base, value, dotted, where)
    if nested is not None and value is not None:
        raise ConfigError(f"{where}: {dotted} is a section; give a mapping of its fields "
                          f"(e.g. {_leaf_keys(nested, dotted + '.')[0]}=...)")
    try:
        return _coerce(value, tp, dotted, raw)
    except _Mismatch as mismatch:
        raise ConfigError(_mismatch_message(mismatch, where)) from None


def _apply_mapping(obj: Any, mapping: Mapping, prefix: str, where: str = "") -> Any:
    """Set the fields of dataclass instance `obj` from `mapping` (in place); return `obj`."""
    types_by_name = _field_types(type(obj))
    for key, value in mapping.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if not isinstance(key, str) or key not in types_by_name:
            raise ConfigError(_unknown_key_message(dotted, where))
        setattr(obj, key, _resolve_value(getattr(obj, key), types_by_name[key], value, dotted, where, None))
    return obj


# ====================================================================== loading


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML silently keeps the last one, which hides a
    recipe's typo'd copy-paste)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key '{key_node.value}'", key_node.start_mark)
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)


def _yaml_error_message(error: yaml.YAMLError, where: str) -> str:
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark, context = error.problem_mark, ""
        if error.context and error.context_mark is not None:
            context = f" ({error.context} at line {error.context_mark.line + 1})"
        return f"{where}: invalid YAML at line {mark.line + 1}, column {mark.column + 1}: {error.problem}{context}"
    return f"{where}: invalid YAML: {' '.join(str(error).split())}"


def _read_recipe(path: str) -> Mapping:
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.load(handle, Loader=_StrictLoader)
    except FileNotFoundError:
        raise ConfigError(f"recipe {path} not found; pass an existing YAML file to --recipe") from None
    except OSError as error:
        raise ConfigError(f"recipe {path} cannot be read: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(_yaml_error_message(error, path)) from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: a recipe must be a mapping of sections ({', '.join(_field_types(JobConfig))}), "
                          f"got {type(data).__name__}")
    return data


def _apply_override(cfg: JobConfig, item: str) -> None:
    """Apply one `section.field=value` override to cfg in place."""
    where = f"override '{item}'"
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"{where} is not of the form section.field=value (e.g. train.steps=50)")
    try:
        value = yaml.load(text, Loader=_StrictLoader) if text.strip() else None
    except yaml.YAMLError as error:
        raise ConfigError(_yaml_error_message(error, where)) from None

    *parents, name = key.split(".")
    obj: Any = cfg
    for part in parents:
        child = getattr(obj, part, None) if part in _field_types(type(obj)) else None
        if not dataclasses.is_dataclass(child):
            raise ConfigError(_unknown_key_message(key, where))
        obj = child
    types_by_name = _field_types(type(obj))
    if name not in types_by_name:
        raise ConfigError(_unknown_key_message(key, where))
    setattr(obj, name, _resolve_value(getattr(obj, name), types_by_name[name], value, key, where, text))


def apply_overrides(cfg: JobConfig, overrides: Sequence[str]) -> JobConfig:
    """A validated copy of cfg with `section.field=value` overrides applied in order (each value
    parsed as YAML, then coerced to the field's type)."""
    cfg = copy.deepcopy(cfg)
    for item in overrides:
        _apply_override(cfg, item)
    cfg.validate()
    return cfg


def config_from_dict(data: Mapping, source: str = "config") -> JobConfig:
    """A validated JobConfig from a mapping of sections (as `config_to_dict` writes); fields left
    out keep their defaults. `source` names the origin in error messages."""
    cfg = _apply_mapping(JobConfig(), data, "", source)
    try:
        cfg.validate()
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None
    return cfg


def load_config(recipe_path: Optional[str], overrides: Sequence[str] = ()) -> JobConfig:
    """Defaults, then the recipe (if any), then the overrides in order; validated.

    Raises ConfigError for a missing or malformed recipe, an unknown key, a value of the wrong
    type or an inconsistent combination of fields.
    """
    cfg = JobConfig()
    source = recipe_path or "defaults"
    if recipe_path is not None:
        _apply_mapping(cfg, _read_recipe(recipe_path), "", recipe_path)
    for item in overrides:
        _apply_override(cfg, item)
    try:
        cfg.validate()
    except ConfigError as error:
        suffix = " with overrides" if overrides else ""
        raise ConfigError(f"{source}{suffix}: {error}") from None
    return cfg


# ====================================================================== saving


def _plain(value: Any) -> Any:
    """Dataclasses, tuples and sets as YAML-safe builtins, keeping field order."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


class _RecipeDumper(yaml.SafeDumper):
    """Block-style mappings with lists on one line, the way the hand-written recipes look."""


_RecipeDumper.add_representer(
    list, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True))


def config_to_dict(cfg: JobConfig) -> dict[str, Any]:
    """The resolved config as nested builtins (sections → fields), loadable by `config_from_dict`."""
    return _plain(cfg)


def save_config(cfg: JobConfig, path: str) -> None:
    """Write the resolved config as a YAML recipe (atomically: a reader never sees half a file)."""
    text = ("# Resolved k3train config (every field); rerun with --recipe this_file.\n"
            + yaml.dump(config_to_dict(cfg), Dumper=_RecipeDumper, sort_keys=False))
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, tmp_path = tempfile.mkstemp(dir=directory, prefix=".config-", suffix=".yaml.tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(tmp_path, 0o644)  # mkstemp creates 0600; a config is for everyone to read
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)
        raise


# ====================================================================== documentation


def _format_default(value: Any) -> str:
    return json.dumps(_plain(value), ensure_ascii=False, default=str)


def _describe(name: str, docs: Mapping[str, str]) -> str:
    """A field's description on one line (table cells cannot break lines)."""
    text = docs.get(name) or name.replace("_", " ").capitalize() + "."
    return " ".join(text.split()).replace("|", "\\|")


def _doc_rows(obj: Any, prefix: str) -> list[str]:
    rows: list[str] = []
    docs = field_docs(type(obj))
    for name, tp in _field_types(type(obj)).items():
        value = getattr(obj, name)
        dotted = f"{prefix}.{name}"
        if _nested_dataclass(tp) is not None and dataclasses.is_dataclass(value):
            rows.extend(_doc_rows(value, dotted))  # nested sections flatten into dotted rows
            continue
        type_text = _type_name(tp).replace("|", "\\|")
        rows.append(f"| `{dotted}` | {type_text} | `{_format_default(value)}` | {_describe(name, docs)} |")
    return rows


def config_reference_markdown() -> str:
    """The field reference of every section (docs/config.md and `--help-config`)."""
    defaults = JobConfig()
    lines = [
        "# k3train configuration reference",
        "",
        "<!-- Generated by `python tools/gen_config_docs.py` from the config dataclasses; do not edit. -->",
        "",
        "A recipe (`--recipe recipes/X.yaml`) is a YAML mapping of sections to fields; nested",
        "sections nest. Fields a recipe leaves out keep the defaults below (the model defaults are",
        "the CPU debug model). Any field can be overridden on the command line as",
        "`section.field=value`, nested ones with more dots (`model.linear_attn_config.num_heads=8`);",
        "the value is read as YAML (`true`, `null`, `3e-4`, `[4, 4]`). Unknown keys and values of the",
        "wrong type are errors.",
        "",
    ]
    for section_field in dataclasses.fields(defaults):
        section = getattr(defaults, section_field.name)
        cls = type(section)
        summary = " ".join(inspect.cleandoc(cls.__doc__ or "").split())
        lines += [
            f"## `{section_field.name}` ({cls.__name__}, `{cls.__module__}`)",
            "",
            *([summary, ""] if summary else []),
            "| key | type | default | meaning |",
            "| --- | --- | --- | --- |",
            *_doc_rows(section, section_field.name),
            "",
        ]
    return "\n".join(lines)


# ====================================================================== command line


def _argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_k3.py",
        description="Pretrain a K3-style model. Settings come from the defaults, then the recipe, "
                    "then section.field=value overrides (see --help-config).",
    )
    parser.add_argument("--recipe", metavar="YAML", default=None,
                        help="recipe file (e.g. recipes/debug.yaml); without one the defaults are used")
    parser.add_argument("--run-dir", metavar="DIR", default=None,
                        help="directory for logs, metrics and (by default) checkpoints")
    parser.add_argument("--help-config", action="store_true",
                        help="print every config field with its type, default and meaning, and exit")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value",
                        help="override a config field, e.g. train.steps=50 optimizer.lr=3e-4")
    return parser


def parse_job_args(argv: Optional[Sequence[str]] = None) -> tuple[JobConfig, Optional[str]]:
    """Parse `[--recipe YAML] [--run-dir DIR] [section.field=value ...]` into a validated config and
    the run directory (None if not given).

    `--help-config` prints the field reference and exits 0; bad flags exit 2 as argparse does;
    a bad recipe or override raises ConfigError (see `parse_job_args_or_exit`).
    """
    parser = _argument_parser()
    # Intermixed: overrides may come before or after --run-dir / --recipe.
    args = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    if args.help_config:
        print(config_reference_markdown())
        parser.exit(0)
    return load_config(args.recipe, args.overrides), args.run_dir


def parse_job_args_or_exit(argv: Optional[Sequence[str]] = None) -> tuple[JobConfig, Optional[str]]:
    """`parse_job_args` for a script's main(): a ConfigError becomes one line on stderr and exit 2."""
    try:
        return parse_job_args(argv)
    except ConfigError as error:
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank fails alike: print once
            print(f"pretrain_k3.py: config error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
