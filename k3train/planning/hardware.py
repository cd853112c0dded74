"""Hardware profiles for the time estimate: peak FLOP rates and link bandwidths of one GPU.

Profiles live in `tools/hardware/<name>.yaml`, each number with its datasheet source in a comment.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

PROFILE_DIR = Path(__file__).resolve().parents[2] / "tools" / "hardware"
MEMORY_LIMIT_SHARE = 0.9
"""Of the HBM, what a rank may plan to use: the rest goes to the allocator's fragmentation, the
CUDA context and the communication libraries' buffers."""


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU and its links (bandwidths one way, GB/s = 1e9 bytes/s)."""

    name: str
    memory_gib: float
    bf16_tflops: float
    fp8_tflops: float
    hbm_gbps: float
    nvlink_gbps: float
    internode_gbps: float
    gpus_per_node: int

    def peak_flops(self, precision: str) -> float:
        """Dense peak in FLOP/s for `fp32`/`bf16` (fp32 training runs on the bf16 tensor cores' TF32
        half: counted at bf16 / 2) or `fp8`."""
        if precision == "fp8":
            return self.fp8_tflops * 1e12
        return self.bf16_tflops * 1e12 / (2 if precision == "fp32" else 1)

    def memory_limit_gib(self) -> float:
        """The default per-rank limit of the search and of the plan's verdict, in GiB
        (`memory_gib` holds the datasheet's decimal GB)."""
        return self.memory_gib * MEMORY_LIMIT_SHARE * 1e9 / 2**30


def available_profiles() -> list[str]:
    return sorted(path.stem for path in PROFILE_DIR.glob("*.yaml"))


def load_profile(name_or_path: str) -> HardwareProfile:
    """A profile by name (`h200`) from tools/hardware/, or from a YAML path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path.lower()}.yaml"
    if not path.exists():
        raise FileNotFoundError(f"no hardware profile {name_or_path!r}; known: {', '.join(available_profiles())}")
    data = yaml.safe_load(path.read_text())
    return HardwareProfile(**data)


__all__ = ["HardwareProfile", "load_profile", "available_profiles", "PROFILE_DIR", "MEMORY_LIMIT_SHARE"]
