"""What a sweep runs: a sweep file (or the command line) expanded into one `RunSpec` per run.

A sweep is a base recipe, named variants (each a list of `section.field=value` overrides), an
optional grid (fields with several values, crossed with every variant), a number of seeds and,
for a ladder, a list of size recipes. Expansion is a pure function of the `Sweep`, so the same
sweep always yields the same run directories, which is what lets an interrupted sweep resume.

Sweep file (YAML; every key but `base`/`ladder` optional):

    base: recipes/ladder/cpu-tiny.yaml      # or `ladder: [recipe, recipe, ...]`
    baseline: block                         # the variant differences are taken against
    overrides: [train.steps=300]            # applied to every run, before the variant's
    variants:
      none: [model.attn_res=none]
      block: [model.attn_res=block]
      tp2: {overrides: [parallel.tp=2], nproc: 2}   # this variant runs under torchrun, 2 ranks
    grid:
      optimizer.lr: [1.0e-3, 3.0e-3]
    seeds: 3
    seed_fields: [train.seed, data.seed]    # each gets base_seed + seed index
    base_seed: 1234
    match: flops                            # or tokens; omitted: every run as its recipe says
"""

from __future__ import annotations

import itertools
import os
import pathlib
import re
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

from k3train.config.recipe import ConfigError

SWEEP_KEYS = (
    "base",
    "ladder",
    "baseline",
    "overrides",
    "variants",
    "grid",
    "seeds",
    "seed_fields",
    "base_seed",
    "match",
)
MATCH_MODES = ("flops", "tokens")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+=,-]*$")


@dataclass(frozen=True)
class Variant:
    """One named arm of the comparison: its overrides on top of the sweep's shared ones."""

    name: str
    overrides: tuple[str, ...] = ()
    nproc: int | None = None
    """Ranks of this variant's runs (torchrun); None: the sweep's `--nproc`."""


@dataclass
class Sweep:
    """A whole sweep, before expansion."""

    recipes: list[str]
    """The base recipe, or the ladder's size recipes (smallest first)."""
    variants: list[Variant] = field(default_factory=lambda: [Variant("base")])
    grid: dict[str, list[str]] = field(default_factory=dict)
    seeds: int = 1
    seed_fields: tuple[str, ...] = ("train.seed", "data.seed")
    base_seed: int = 1234
    overrides: tuple[str, ...] = ()
    baseline: str | None = None
    """Name of the variant the others are compared with; None: the first."""
    match: str | None = None
    ladder: bool = False

    def validate(self) -> None:
        if not self.recipes:
            raise ConfigError("sweep: give a base recipe (`base:` or --recipe) or ladder sizes (`ladder:`)")
        for recipe in self.recipes:
            if not pathlib.Path(recipe).is_file():
                raise ConfigError(
                    f"sweep: recipe {recipe} does not exist; fix the path in `base:`/`ladder:` or --recipe"
                )
        names = [variant.name for variant in self.variants]
        if len(set(names)) != len(names):
            raise ConfigError(f"sweep: variant names must be distinct, got {names}")
        for name in names:
            if not _NAME.match(name):
                raise ConfigError(
                    f"sweep: variant name {name!r} must be letters, digits and _.+=,- (it names a directory)"
                )
        if self.seeds < 1:
            raise ConfigError(f"sweep: seeds must be at least 1, got {self.seeds}")
        if self.match is not None and self.match not in MATCH_MODES:
            raise ConfigError(f"sweep: match must be one of {', '.join(MATCH_MODES)}, got {self.match!r}")
        for name, values in self.grid.items():
            if "." not in name or not values:
                raise ConfigError(f"sweep: grid field {name!r} needs the form section.field=v1,v2")
        known = {arm.name for arm in self.arms()} | {variant.name for variant in self.variants}
        if self.baseline is not None and self.baseline not in known:
            raise ConfigError(f"sweep: baseline {self.baseline!r} is not one of the variants {sorted(known)}")

    def arms(self) -> list[Variant]:
        """The variants crossed with the grid, in a fixed order (variant-major)."""
        if not self.grid:
            return list(self.variants)
        fields_ = list(self.grid)
        arms = []
        for variant in self.variants:
            for values in itertools.product(*(self.grid[name] for name in fields_)):
                grid_overrides = tuple(f"{name}={value}" for name, value in zip(fields_, values))
                suffix = ",".join(f"{name.rsplit('.', 1)[-1]}={value}" for name, value in zip(fields_, values))
                name = suffix if variant.name == "base" and len(self.variants) == 1 else f"{variant.name},{suffix}"
                arms.append(Variant(name, variant.overrides + grid_overrides, variant.nproc))
        return arms

    def _arm_parts(self) -> list[tuple[Variant, str, Variant]]:
        """(variant, grid suffix, arm) for every arm."""
        if not self.grid:
            return [(variant, "", variant) for variant in self.variants]
        arms, per_variant = self.arms(), len(self.arms()) // len(self.variants)
        return [
            (self.variants[i // per_variant], arm.name.split(",", 1)[1] if "," in arm.name else arm.name, arm)
            for i, arm in enumerate(arms)
        ]

    def baseline_arms(self) -> dict[str, str]:
        """Each arm's baseline arm. `baseline` may name an arm (every arm is compared with it) or a
        variant (each arm with that variant at the same grid point); None means the first variant.
        A sweep of the grid alone compares with its first point."""
        parts = self._arm_parts()
        arm_names = [arm.name for _, _, arm in parts]
        if self.baseline in arm_names:
            return {name: self.baseline for name in arm_names}
        if self.grid and len(self.variants) == 1 and self.variants[0].name == "base":
            return {name: arm_names[0] for name in arm_names}
        variant = self.baseline if self.baseline is not None else self.variants[0].name
        by_point = {suffix: arm.name for v, suffix, arm in parts if v.name == variant}
        return {arm.name: by_point[suffix] for _, suffix, arm in parts}

    @property
    def baseline_name(self) -> str:
        """The baseline arm of the first arm (the one the report names)."""
        return next(iter(self.baseline_arms().values()))


@dataclass(frozen=True)
class RunSpec:
    """One training run: its recipe, every override in order, and where it lives under OUT."""

    arm: str
    seed_index: int
    recipe: str
    overrides: tuple[str, ...]
    relative_dir: str
    size: str | None = None
    """The ladder size (the recipe's stem); None outside a ladder."""
    nproc: int | None = None
    """Ranks of this run; None: the sweep's `--nproc`."""

    def with_overrides(self, extra: tuple[str, ...]) -> RunSpec:
        return replace(self, overrides=self.overrides + extra)


def seed_overrides(sweep: Sweep, seed_index: int) -> tuple[str, ...]:
    return tuple(f"{name}={sweep.base_seed + seed_index}" for name in sweep.seed_fields)


def expand(sweep: Sweep) -> list[RunSpec]:
    """Every run of the sweep: sizes × arms × seeds, in that order.

    Overrides apply as: the sweep's shared ones, the seed fields, then the arm's own (so an arm may
    pin a seed field or change a shared setting)."""
    sweep.validate()
    runs = []
    for recipe in sweep.recipes:
        size = pathlib.Path(recipe).stem if sweep.ladder else None
        for arm in sweep.arms():
            for seed_index in range(sweep.seeds):
                parts = ([size] if size else []) + [arm.name, f"seed{seed_index}"]
                runs.append(
                    RunSpec(
                        arm=arm.name,
                        seed_index=seed_index,
                        recipe=recipe,
                        overrides=sweep.overrides + seed_overrides(sweep, seed_index) + arm.overrides,
                        relative_dir="/".join(parts),
                        size=size,
                        nproc=arm.nproc,
                    )
                )
    return runs


def parse_grid_option(text: str) -> tuple[str, list[str]]:
    """`section.field=v1,v2,...` → (field, [values]); a value list in brackets is kept whole."""
    name, sep, values = text.partition("=")
    if not sep or "." not in name or not values:
        raise ConfigError(f"--grid {text!r} must be section.field=v1,v2 (e.g. optimizer.lr=1e-3,3e-3)")
    return name.strip(), [value.strip() for value in values.split(",") if value.strip()]


def _override_list(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if isinstance(value, dict):  # {section.field: value} reads as well as a list of overrides
        return tuple(f"{key}={_yaml_scalar(item)}" for key, item in value.items())
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ConfigError(f"{where} must be a list of section.field=value strings or a mapping of them")
    return tuple(value)


def _yaml_scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True).strip()
    return text[:-4].strip() if text.endswith("\n...") or text.endswith("...") else text


def _variant(name: str, value: Any, path: str) -> Variant:
    """A variant entry: a list of overrides, or {overrides: [...], nproc: N}."""
    if isinstance(value, dict) and set(value) <= {"overrides", "nproc"} and "overrides" in value:
        nproc = value.get("nproc")
        if nproc is not None and (not isinstance(nproc, int) or nproc < 1):
            raise ConfigError(f"{path}: variant {name}: nproc must be a positive integer, got {nproc!r}")
        return Variant(name, _override_list(value["overrides"], f"{path}: variant {name}"), nproc)
    return Variant(name, _override_list(value, f"{path}: variant {name}"))


def load_sweep_file(path: str) -> Sweep:
    """Read a sweep file; relative recipe paths are taken from the current directory, then from
    the sweep file's directory."""
    try:
        data = yaml.safe_load(pathlib.Path(path).read_text())
    except OSError as error:
        raise ConfigError(f"sweep file {path} cannot be read: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"sweep file {path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"sweep file {path} must be a mapping with keys {', '.join(SWEEP_KEYS)}")
    unknown = sorted(set(data) - set(SWEEP_KEYS))
    if unknown:
        raise ConfigError(f"sweep file {path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(SWEEP_KEYS)}")

    def locate(recipe: str) -> str:
        here = pathlib.Path(recipe)
        beside = pathlib.Path(path).parent / recipe
        return os.path.normpath(here if here.exists() or not beside.exists() else beside)

    ladder = data.get("ladder")
    if ladder is not None and (not isinstance(ladder, list) or not ladder):
        raise ConfigError(f"sweep file {path}: ladder must be a list of recipe paths, smallest first")
    recipes = [locate(r) for r in ladder] if ladder else ([locate(data["base"])] if data.get("base") else [])
    variants_data = data.get("variants") or {}
    if not isinstance(variants_data, dict):
        raise ConfigError(f"sweep file {path}: variants must map a name to its overrides")
    variants = [_variant(str(name), value, path) for name, value in variants_data.items()] or [Variant("base")]
    grid_data = data.get("grid") or {}
    if not isinstance(grid_data, dict):
        raise ConfigError(f"sweep file {path}: grid must map section.field to a list of values")
    grid = {
        str(name): [_yaml_scalar(value) for value in (values if isinstance(values, list) else [values])]
        for name, values in grid_data.items()
    }
    return Sweep(
        recipes=recipes,
        variants=variants,
        grid=grid,
        seeds=int(data.get("seeds", 1)),
        seed_fields=tuple(data.get("seed_fields", ("train.seed", "data.seed"))),
        base_seed=int(data.get("base_seed", 1234)),
        overrides=_override_list(data.get("overrides"), f"{path}: overrides"),
        baseline=data.get("baseline"),
        match=data.get("match"),
        ladder=bool(ladder),
    )
