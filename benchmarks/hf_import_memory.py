"""Peak memory of `convert_checkpoint.py from-hf` on a wide, shallow model (hundreds of MB).

Builds a K3 model at a tiny-but-wide config (`--hidden`, `--experts`, `--vocab`), saves it as a
run, exports it with `to-hf` (bf16, `--max-shard-size`), then runs `from-hf` in a child process
and reports the child's max RSS next to the model's fp32 size, the largest shard and the RSS of
a process that only imports the converter (torch included).

    OMP_NUM_THREADS=1 python benchmarks/hf_import_memory.py              # ~0.9 GB fp32 model
    OMP_NUM_THREADS=1 python benchmarks/hf_import_memory.py --experts 8  # smaller
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(CHECKOUT))


def wide_config(hidden: int, experts: int, vocab: int, layers: int):
    from k3train.model.config import LinearAttnConfig, ModelConfig

    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_experts=experts,
        num_experts_per_token=2,
        moe_intermediate_size=hidden,
        routed_expert_hidden_size=hidden // 2,
        num_attention_heads=8,
        q_lora_rank=hidden // 4,
        kv_lora_rank=hidden // 8,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        linear_attn_config=LinearAttnConfig(num_heads=8, head_dim=64),
    )


def max_rss_of(command: list[str]) -> int:
    """Max RSS in bytes of `command`, measured by a fresh parent process (RUSAGE_CHILDREN keeps
    the largest child a process ever waited for, so each measurement gets its own parent)."""
    probe = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, *command], check=True, cwd=CHECKOUT, capture_output=True, text=True
    )
    return int(done.stdout.split()[-1]) * 1024  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-shard-size", default="100MB", help="to-hf's shard size")
    parser.add_argument("--max-file-size", default="100MB", help="from-hf's checkpoint file size")
    parser.add_argument("--workdir", default=None, help="keep the files here (default: a temporary directory)")
    args = parser.parse_args()

    from k3train.checkpoint import Checkpointer
    from k3train.config import JobConfig, save_config
    from k3train.model.k3 import K3ModelChunk

    config = wide_config(args.hidden, args.experts, args.vocab, args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        run, hf, out = root / "run", root / "hf", root / "imported"
        model = K3ModelChunk(config)
        model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        job = JobConfig()
        job.model = config
        run.mkdir(parents=True, exist_ok=True)
        save_config(job, str(run / "config.yaml"))
        Checkpointer(run / "checkpoints").save(1, {"model": model})
        del model
        tool = str(CHECKOUT / "tools" / "convert_checkpoint.py")
        subprocess.run(
            [sys.executable, tool, "to-hf", "--load", str(run), "--out", str(hf), "--overwrite", "--quiet"]
            + ["--max-shard-size", args.max_shard_size],
            check=True,
            cwd=CHECKOUT,
        )
        shard = max(p.stat().st_size for p in hf.glob("*.safetensors"))
        imports = max_rss_of([sys.executable, "-c", f"import runpy; runpy.run_path({tool!r}, run_name='probe')"])
        peak = max_rss_of(
            [sys.executable, tool, "from-hf", "--load", str(hf), "--out", str(out), "--overwrite", "--quiet"]
            + ["--max-file-size", args.max_file_size]
        )
        files = sorted(p for p in (out / "checkpoints").rglob("*.distcp"))
        largest_file = max(p.stat().st_size for p in files)
    print(f"model: {model_bytes / 1e6:.0f} MB fp32 ({config.num_experts} experts, hidden {config.hidden_size})")
    print(f"largest HF shard: {shard / 1e6:.0f} MB bf16; largest k3train checkpoint file: {largest_file / 1e6:.0f} MB")
    print(f"max RSS: importing the converter {imports / 1e6:.0f} MB; from-hf {peak / 1e6:.0f} MB")
    print(
        f"from-hf above the import: {(peak - imports) / 1e6:.0f} MB ({(peak - imports) / model_bytes:.2f} of the fp32 model)"
    )


if __name__ == "__main__":
    main()
