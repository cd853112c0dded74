#!/usr/bin/env python
"""Pretrain a Kimi K3-style model.

    python pretrain_k3.py --recipe recipes/debug.yaml [--run-dir DIR] [section.field=value ...]
    python pretrain_k3.py --help-config        # every recipe field, its default and meaning

The job, top to bottom: recipe → config → parallel state → model → data → optimizer and
schedule → checkpoint resume → training loop → checkpoints.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

# k3train runs from its checkout, as Megatron-LM does (see k3train/__init__.py).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402

from k3train.checkpoint import Checkpointer, GracefulExit, RNGState, read_manifest  # noqa: E402
from k3train.config import JobConfig, parse_job_args_or_exit, save_config  # noqa: E402
from k3train.data import build_data  # noqa: E402
from k3train.model.flops import training_flops_per_token  # noqa: E402
from k3train.model.k3 import K3Model  # noqa: E402
from k3train.optim.builder import build_optimizer, describe_param_groups  # noqa: E402
from k3train.training.loop import Trainer, TrainingError  # noqa: E402
from k3train.training.metrics import MetricsLogger  # noqa: E402
from k3train.training.throughput import peak_flops  # noqa: E402


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_single_process(config: JobConfig) -> None:
    """This version trains on one process; refuse parallel layouts clearly instead of ignoring them."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    parallel = config.parallel
    split = {name: getattr(parallel, name) for name in ("tp", "pp", "ep", "cp", "virtual_stages")}
    if world_size > 1 or parallel.dp > 1 or any(size > 1 for size in split.values()):
        fail(
            f"this k3train version trains on a single process (WORLD_SIZE={world_size}, "
            f"parallel={split}, dp={parallel.dp}); launch with `python pretrain_k3.py` and keep "
            "parallel.* at 1: the DP/TP/PP/EP layouts arrive with the parallel issues"
        )


def select_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        fail("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def main(argv: list[str] | None = None) -> int:
    # 1. Recipe → config, written next to everything the run produces.
    config, run_dir_arg = parse_job_args_or_exit(argv)
    run_dir = pathlib.Path(run_dir_arg or f"runs/run-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, str(run_dir / "config.yaml"))
    print(f"run directory: {run_dir}")

    # 2. Parallel state: one process in this version.
    check_single_process(config)
    device = select_device(config.train.device)
    if config.train.num_threads:
        torch.set_num_threads(config.train.num_threads)
    torch.manual_seed(config.train.seed)

    # 3. Model, initialised from the seed alone (the same weights under any later layout).
    model = K3Model(config.model)
    model.init_weights(config.train.seed)
    model.to(device)
    total_params = sum(p.numel() for p in model.parameters())
    print(f"model: {total_params / 1e6:.2f}M parameters, {config.model.num_hidden_layers} layers, "
          f"attn_res={config.model.attn_res}, balancer={config.model.balancer}")

    # 4. Data: samples of seq_length + 1 tokens, deterministic and resumable.
    data = build_data(config.data, config.train.global_batch_size, config.train.steps, config.model.vocab_size)

    # 5. Optimizer (Per-Head Muon + AdamW) and its schedule (a pure function of the step).
    optimizer = build_optimizer(model, config.optimizer)
    print(describe_param_groups(model, config.optimizer))

    # 6. Resume from the newest complete checkpoint, if asked to.
    peak = peak_flops(device, config.logging.peak_tflops)
    logger = MetricsLogger(config, run_dir, peak.label)
    trainer = Trainer(config, model, optimizer, data, device,
                      training_flops_per_token(config.model, config.data.seq_length).total, peak, logger)
    checkpointer = Checkpointer(config.checkpoint.dir or run_dir / "checkpoints", keep_last=config.checkpoint.keep_last)

    def app_state() -> dict:
        # The QB biases are model buffers; the LR schedule is a pure function of the step.
        return {"model": model, "optimizer": optimizer, "data": data, "progress": trainer.progress,
                "rng": RNGState()}

    resume_from = checkpointer.resolve_resume(config.checkpoint.resume)
    if resume_from is not None:
        if (read_manifest(resume_from) or {}).get("keys") == ["model"]:
            # A model-only checkpoint (tools/convert_checkpoint.py from-hf): fine-tune from its
            # weights with a fresh optimizer, data position, step counter and RNG streams.
            checkpointer.load(resume_from, {"model": model})
            print(f"initialised the model from {resume_from} (model-only checkpoint: fresh optimizer, step 0)")
        else:
            checkpointer.load(resume_from, app_state())
            print(f"resumed from {resume_from} at step {trainer.progress.step}")

    def save_checkpoint(step: int) -> None:
        path = checkpointer.save(step, app_state())
        print(f"checkpoint saved: {path}", flush=True)

    # 7. Train.
    try:
        with GracefulExit() as stop:
            history = trainer.run(lambda: stop.should_stop, save_checkpoint)
    except TrainingError as error:
        fail(str(error))
    finally:
        logger.close()
    if history:
        print(f"done: step {trainer.progress.step}, loss {history[0]['loss']:.4f} → {history[-1]['loss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
