#!/usr/bin/env python
"""Pretrain a Kimi K3-style model.

    python pretrain_k3.py --recipe recipes/debug.yaml [--run-dir DIR] [section.field=value ...]
    python pretrain_k3.py --help-config        # every recipe field, its default and meaning

The job, top to bottom: recipe → config and the files it names → parallel state → this rank's
model (stages and experts), gradient reducer, optimizer and pipeline schedule → data →
checkpoint resume → training loop → checkpoints.

Exit status (every failure is one line on stderr, `error: ...`, no traceback):
    0  done: train.steps reached ("done: step N, loss A (step 1) → B (step N)")
    2  a recipe, layout, data, checkpoint or training error (rank 0 prints it)
    3  stopped by SIGTERM/SIGINT/SIGHUP after saving a checkpoint ("stopped at step N (SIGTERM)")
    4  stopped by a signal it could not honour within train.stop_grace_s (a rank blocked on a
       collective), signalled twice, or signalled outside the training loop (start-up): no
       checkpoint written, the newest complete one is kept
    5  a collective failed: a peer rank died or stopped answering within
       parallel.collective_timeout_s (every surviving rank prints which group and operation)

These are each rank's statuses. Plain torchrun reports any non-zero one with its own traceback
and summary and exits 1; `python tools/launch.py` (torchrun's arguments and agent) exits with
them and adds nothing to the rank's line (docs/failures.md, "Under torchrun").
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import time
from typing import TYPE_CHECKING, NoReturn

# Only torch-free modules here: `--help`, recipe errors and missing files answer before torch and
# the model are imported, and a signal during the imports already ends in one line.
from k3train.config import save_config
from k3train.config.command_line import parse_job_args_or_exit
from k3train.errors import RunDirectoryError, UserError
from k3train.job.ending import exit_same_on_every_rank, write_torchrun_error_file
from k3train.job.preflight import check_input_files
from k3train.job.run_lock import release_run_directories
from k3train.job.signals import StoppedOutsideTheLoop, exit_unsaved, stop_signals_raise

if TYPE_CHECKING:
    import torch


ERROR = 2
PEER_LOST = 5


def fail(message: str) -> NoReturn:
    """One line on stderr and exit code 2. The errors raised here (recipe, layout, batch sizes,
    non-finite steps) are the same on every rank, so under torchrun only rank 0 prints them, and
    ends first (k3train/job/ending.py)."""
    exit_same_on_every_rank(f"error: {message}", ERROR)


def exit_on_collective_failure(error: BaseException, parallel=None, timeout_s: float | None = None) -> None:
    """A collective whose peer died or stopped answering: one line from every surviving rank
    (the failed rank may be rank 0) and exit PEER_LOST at once, without the interpreter's
    shutdown, which could block again on the dead peer. Returns if `error` is something else.
    Before the groups exist (`parallel` None) the line names no group."""
    from k3train.parallel.comm import describe_collective_failure

    counter = parallel.counter if parallel is not None else None
    message = describe_collective_failure(error, counter, parallel.collective_timeout_s if parallel else timeout_s)
    if message is None:
        return
    rank, world_size = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    line = (
        f"error: rank {rank} of {world_size}: {message}; exiting, the newest complete checkpoint "
        f"is kept (resume with checkpoint.resume=auto)"
    )
    print(line, file=sys.stderr, flush=True)
    write_torchrun_error_file(line)
    sys.stdout.flush()
    os._exit(PEER_LOST)


def select_device(choice: str) -> torch.device:
    """CPU, or this process's GPU: `LOCAL_RANK` from torchrun picks it (one GPU per rank)."""
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        fail("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
    if choice == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)  # before NCCL starts, so each rank's communicator uses its own GPU
    return device


def shared_run_dir(requested: str | None) -> pathlib.Path:
    """`--run-dir`, or `runs/run-<timestamp>` chosen by rank 0 and sent to every rank."""
    import torch

    name = [requested or f"runs/run-{time.strftime('%Y%m%d-%H%M%S')}"]
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(name, src=0)
    return pathlib.Path(name[0])


def main(argv: list[str] | None = None) -> int:
    stop_signals_raise()  # SIGTERM/SIGINT/SIGHUP outside the training loop: one line and status 4
    try:
        # 1. Recipe → config and the files it names (seconds, not the minutes of a model build);
        #    then torch and the model code.
        config, run_dir_arg = parse_job_args_or_exit(argv)
        check_input_files(config, run_dir_arg)
        return start_job(config, run_dir_arg)
    except UserError as error:  # every failure the user can fix, from any step: one line, status 2
        fail(str(error))
    except StoppedOutsideTheLoop as stop:  # every rank got it (torchrun forwards to all): rank 0 prints
        exit_unsaved(
            stop.signum, "it arrived outside the training loop", print_line=int(os.environ.get("RANK", "0")) == 0
        )
        raise  # not reached: exit_unsaved ends the process
    finally:
        release_run_directories()  # a crash (kill -9, os._exit) leaves a stale lock the next start takes over
        # The status is decided. torchrun's agent SIGTERMs the other ranks as soon as one ends, and
        # Python's shutdown resets its handlers to the default: a SIGTERM then would turn this
        # rank's status (2, 3, 0) into -15. SIG_IGN survives the shutdown; SIGKILL still ends a
        # process that hangs in it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)


def start_job(config, run_dir_arg: str | None) -> int:
    """Steps 2-6 of the job: the parallel state, then `run_job`; a collective that fails on the
    way means a dead or frozen peer (status 5)."""
    from k3train.parallel.config import collective_timeout_seconds
    from k3train.parallel.state import ParallelState
    from k3train.training.build import check_precision_support

    # 2. Parallel state from torchrun's environment (one process without it).
    device = select_device(config.train.device)
    check_precision_support(config, device)  # fp8 / Transformer Engine: say so before anything starts
    try:
        parallel = ParallelState.from_environment(config.parallel, config.model, device.type)
    except UserError:
        raise
    except Exception as error:  # a peer that never joined or died while the groups were built
        exit_on_collective_failure(
            error,
            timeout_s=collective_timeout_seconds(
                config.parallel.collective_timeout_s, "nccl" if device.type == "cuda" else "gloo"
            ),
        )
        raise
    try:
        return run_job(config, run_dir_arg, parallel, device)
    except UserError:
        raise
    except Exception as error:  # a dead or frozen peer surfaces as whatever collective waited on it
        exit_on_collective_failure(error, parallel)
        raise


def set_up_rank(config, parallel, device) -> list[str]:
    """One rank prints; the thread count for this rank and the host heap's reuse of freed memory
    (returns their lines to print); the cache's deprecation notice; the seed."""
    import torch

    from k3train.cache import locate_cache
    from k3train.training.host_heap import configure_host_heap
    from k3train.training.threads import (
        available_cores,
        choose_num_threads,
        launcher_environment,
        machine_busy_fraction,
    )

    if parallel.rank != 0:
        sys.stdout = open(os.devnull, "w")  # errors still reach stderr
    threads, threads_line = choose_num_threads(
        config.train.num_threads,
        os.environ,
        available_cores(),
        machine_busy_fraction(),
        launcher_environment(os.environ),
    )
    torch.set_num_threads(threads)  # torch's default, every core in every rank, oversubscribes
    cache = locate_cache()
    if cache.deprecation and parallel.rank == 0:
        print(cache.deprecation, file=sys.stderr)
    torch.manual_seed(config.train.seed)
    heap_line = configure_host_heap(config.train.host_heap, device.type)  # before the model's tensors
    return [threads_line] + ([heap_line] if heap_line else [])


def writable(action: str, path, fix: str):
    """A context that turns an OSError while `action`-ing `path` into a one-line RunDirectoryError."""
    import contextlib

    @contextlib.contextmanager
    def context():
        try:
            yield
        except RunDirectoryError:
            raise
        except OSError as error:
            raise RunDirectoryError(f"{action} {path} failed ({error.strerror or error}){fix}") from error

    return context()


def claim_run_directories(directories: list[pathlib.Path], is_lock_rank: bool) -> None:
    """Rank 0 locks the run and checkpoint directories (k3train/job/run_lock.py); every rank learns
    whether it could, so a refusal is one line and status 2 everywhere, before any collective."""
    import torch

    from k3train.job.run_lock import lock_run_directories

    refusal: list[str | None] = [None]
    if is_lock_rank:
        try:
            lock_run_directories(directories)
        except RunDirectoryError as error:
            refusal = [str(error)]
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise RunDirectoryError(refusal[0])


def resume(checkpointer, resume_setting: str, model, app_state, progress) -> None:
    """Load the checkpoint `checkpoint.resume` names, if any: a whole training state, or a
    model-only checkpoint (tools/convert_checkpoint.py from-hf) to fine-tune from."""
    from k3train.checkpoint import read_manifest

    resume_from = checkpointer.resolve_resume(resume_setting)
    if resume_from is None:
        return
    if (read_manifest(resume_from) or {}).get("keys") == ["model"]:
        # Fresh optimizer, data position, step counter and RNG streams.
        checkpointer.load(resume_from, {"model": model})
        print(f"initialised the model from {resume_from} (model-only checkpoint: fresh optimizer, step 0)")
    else:
        checkpointer.load(resume_from, app_state())
        print(f"resumed from {resume_from} at step {progress.step}")


def run_job(config, run_dir_arg: str | None, parallel, device) -> int:
    """Steps 3-6 of the job on this rank (after the parallel state is up). Raises `UserError`
    for anything the user can fix; `main` prints it."""

    from k3train.checkpoint import Checkpointer, PerRank, RNGState
    from k3train.data import build_data
    from k3train.model.flops import parameter_counts, training_flops_per_token
    from k3train.optim.builder import describe_param_groups, summarize_param_groups
    from k3train.training.build import build_rank
    from k3train.training.loop import Trainer
    from k3train.training.metrics import MetricsLogger, require_sinks
    from k3train.training.throughput import peak_flops

    is_logging_rank = parallel.rank == 0
    set_up_lines = set_up_rank(config, parallel, device)
    run_dir = shared_run_dir(run_dir_arg)
    checkpoint_dir = pathlib.Path(config.checkpoint.dir) if config.checkpoint.dir else run_dir / "checkpoints"
    # Before anything there is read, cleaned or written: one job per run directory.
    claim_run_directories([run_dir, checkpoint_dir], is_logging_rank)
    print(f"run directory: {run_dir}")
    layout = parallel.layout
    print(
        f"parallel: world {layout.world_size} = tp {layout.tp} × cp {layout.cp} × dp {layout.data_parallel} × pp {layout.pp} "
        f"(virtual stages {config.parallel.virtual_stages}), ep {layout.ep}, "
        f"sequence parallel {parallel.sequence_parallel}, ZeRO-1 {config.parallel.zero1}"
    )
    for line in set_up_lines:
        print(line)

    # 3. What this rank runs (k3train/training/build.py): its pipeline chunks with their TP shards
    #    and EP experts, initialised from the seed alone (the same weights under any layout); the
    #    gradient reducer over data parallelism; the optimizer (Per-Head Muon + AdamW, its state
    #    sharded over DP with ZeRO-1); the pipeline schedule (1F1B, interleaved with virtual stages;
    #    one stage is plain gradient accumulation), which reduces gradients on the last backward.
    job = build_rank(config, parallel, device)
    model, optimizer = job.model, job.optimizer
    counts = parameter_counts(config.model)
    print(
        f"model: {counts.total / 1e6:.2f}M parameters ({counts.active / 1e6:.2f}M active per token), "
        f"{config.model.num_hidden_layers} layers, attn_res={config.model.attn_res}, balancer={config.model.balancer}; "
        f"this rank holds layers {job.plan.layer_ranges(parallel.pp_rank)}"
    )
    describe_optimizer = describe_param_groups if config.logging.optimizer_table else summarize_param_groups
    print(describe_optimizer(model, config.optimizer))

    # 4. Data: samples of seq_length + 1 tokens, deterministic and resumable; the LR schedule is a
    #    pure function of the step.
    data = build_data(config.data, config.train.global_batch_size, config.train.steps, config.model.vocab_size)
    print(data.describe())

    # 5. Metrics, the step loop and checkpoints; resume from the newest complete checkpoint if asked.
    peak = peak_flops(device, config.logging.peak_tflops)
    print(peak.describe())
    require_sinks(config)
    with writable("creating or writing the run directory", run_dir, "; pass a writable --run-dir"):
        if is_logging_rank:
            run_dir.mkdir(parents=True, exist_ok=True)
        logger = MetricsLogger(config, run_dir, peak.label) if is_logging_rank else None
    trainer = Trainer(
        config,
        model,
        optimizer,
        data,
        device,
        training_flops_per_token(config.model, config.data.seq_length).total,
        peak,
        logger,
        parallel,
        job.reducer,
        job.schedule,
    )
    with writable(
        "creating or reading the checkpoint directory", checkpoint_dir, "; set checkpoint.dir to a writable directory"
    ):
        checkpointer = Checkpointer(
            checkpoint_dir, keep_last=config.checkpoint.keep_last, async_save=config.checkpoint.async_save
        )

    def app_state() -> dict:
        # The QB biases are model buffers; the LR schedule is a pure function of the step.
        state = {"model": model, "optimizer": optimizer, "data": data, "progress": trainer.progress, "rng": RNGState()}
        if job.expert_parallel is not None:  # the next step's replica placements (per EP group, so per rank)
            state["expert_replicas"] = PerRank(job.expert_parallel)
        return state

    resume(checkpointer, config.checkpoint.resume, model, app_state, trainer.progress)
    resumed_at = trainer.progress.step  # 0 for a fresh start (a model-only checkpoint too)

    # Everything checked: the resolved config goes next to what the run writes (a failed start
    # leaves an earlier run's config.yaml untouched).
    if is_logging_rank:
        with writable("writing", run_dir / "config.yaml", ""):
            save_config(config, str(run_dir / "config.yaml"))

    return train(config, trainer, checkpointer, app_state, logger, parallel, run_dir, resumed_at)


def train(config, trainer, checkpointer, app_state, logger, parallel, run_dir, resumed_at: int) -> int:
    """6. Train to `train.steps`, saving every `checkpoint.interval`. A signal stops after the step
    in progress (saved, status 3); one the loop cannot answer within train.stop_grace_s (blocked
    on a collective) ends the process unsaved (status 4)."""
    import torch

    from k3train.checkpoint import CheckpointError
    from k3train.job.signals import STOPPED, GracefulExit, launcher_grace, signal_name
    from k3train.training.summary import done_line

    is_logging_rank = parallel.rank == 0

    def save_checkpoint(step: int) -> None:
        if trainer.progress.consecutive_nonfinite and not stop.acknowledged:
            # The update was skipped: a periodic save would only push a finite checkpoint out of
            # checkpoint.keep_last. A stop still saves (the same weights, and its step to resume).
            print(f"checkpoint skipped at step {step}: the step was not finite; {newest_kept()}", flush=True)
            return
        with writable(f"saving the checkpoint of step {step} in", checkpointer.directory, ""):
            path = checkpointer.save(step, app_state())
        # An asynchronous save returns once the state is copied; the write finishes in the background.
        print(f"checkpoint {'started' if config.checkpoint.async_save else 'saved'}: {path}", flush=True)

    def newest_kept() -> str:
        try:
            kept = checkpointer.latest()
        except OSError:
            kept = None
        return f"the newest complete checkpoint is {kept}" if kept else "no complete checkpoint is kept"

    grace_s, grace_line = launcher_grace(config.train.stop_grace_s, os.environ)
    if grace_line:
        print(f"note: {grace_line}")
    try:
        with GracefulExit(
            grace_s=grace_s,
            on_unanswered=lambda signum, reason: exit_unsaved(signum, reason, trainer.progress.step),
        ) as stop:
            history = trainer.run(stop.requested, save_checkpoint)  # any rank signalled: all stop
            checkpointer.wait()  # the last asynchronous write, complete (renamed, checksummed) before exit
    except KeyboardInterrupt:  # a second SIGINT (GracefulExit raises it): every rank got it, rank 0 prints
        exit_unsaved(signal.SIGINT, "SIGINT received twice", trainer.progress.step, print_line=is_logging_rank)
    except CheckpointError as error:
        if error.__cause__ is not None:  # a save that waited on a dead or frozen peer
            exit_on_collective_failure(error.__cause__, parallel)
        raise CheckpointError(f"{error}; {newest_kept()}") from error
    except RunDirectoryError as error:
        raise RunDirectoryError(f"{error}; {newest_kept()}") from error
    except OSError as error:  # the metrics file (disk full, directory removed): checkpoints are unaffected
        raise RunDirectoryError(
            f"writing {error.filename or 'the run directory'} failed ({error.strerror or error}); {newest_kept()}"
        ) from error
    finally:
        if logger is not None:
            logger.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if trainer.stopped_at_step is not None:
        how = signal_name(stop.received) if stop.received is not None else "a signal to another rank"
        line = (
            f"stopped at step {trainer.stopped_at_step} ({how}): checkpoint saved; "
            f"rerun with checkpoint.resume=auto to continue"
        )
        print(line, flush=True)
        write_torchrun_error_file(line)  # status 3 is a "failure" to torchrun: its summary shows this line
        return STOPPED
    if history and is_logging_rank:  # the run's first loss is read back from metrics.jsonl after a resume
        metrics_path = run_dir / "metrics.jsonl" if config.logging.jsonl else None
        print(done_line(history, resumed_at, metrics_path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
