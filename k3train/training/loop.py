"""The training loop: micro-batches → loss → optimizer step → balancer update → metrics → checkpoints.

One `Trainer.train_step` is one optimizer step over `train.global_batch_size` samples, split into
micro-batches whose gradients accumulate (each micro-batch's mean loss is divided by their
number, so the step's gradient is that of the mean loss over the global batch). A step whose
loss or gradient norm is not finite is skipped (no update, no balancer change, data consumed)
and counted; `train.max_nonfinite_steps` skips in a row stop the run with a clear message.

Test-only fault hook: `K3TRAIN_TEST_NAN_GRAD=RANK:STEP[,STEP...]` makes rank RANK's gradients NaN
in the backward of those steps (before the data-parallel reduction, as a bad batch on one rank
would), so the fault-injection suite can check that every rank skips the step together. Unset in
real runs; nothing else reads it.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from k3train.config import ConfigError, JobConfig
from k3train.contracts.token_batch import TokenBatch
from k3train.data.documents import document_lengths
from k3train.errors import UserError
from k3train.kernels import te as te_kernels
from k3train.model import flops
from k3train.model.k3 import K3RankModel
from k3train.model.moe import finish_expert_step, pool_routing_statistics
from k3train.optim.schedules import lr_at, set_lr
from k3train.parallel.grad_norm import clip_grad_norm
from k3train.parallel.grad_reduce import GradientReducer, average_over_dp
from k3train.parallel.pipeline import PipelineExecutor
from k3train.parallel.pipeline_schedule import PipelineConfigError, check_interleaved_micro_batches
from k3train.parallel.state import ParallelState
from k3train.training.metrics import MetricsLogger
from k3train.training.throughput import PeakFlops, format_eta, muon_step_stats, rank_memory_gib


class TrainingError(UserError, RuntimeError):
    """The run cannot continue (e.g. too many non-finite steps in a row); the message says why."""


NAN_GRAD_HOOK_ENV = "K3TRAIN_TEST_NAN_GRAD"


def nan_gradient_steps(value: str | None, rank: int) -> frozenset[int]:
    """The steps whose gradients the test-only hook poisons on `rank` (`RANK:STEP[,STEP...]`)."""
    if not value:
        return frozenset()
    try:
        hook_rank, steps = value.split(":")
        return frozenset(int(s) for s in steps.split(",")) if int(hook_rank) == rank else frozenset()
    except ValueError:
        raise TrainingError(f"{NAN_GRAD_HOOK_ENV}={value!r}: expected RANK:STEP[,STEP...] (a test-only hook)") from None


@dataclass
class Progress:
    """Loop counters saved in checkpoints."""

    step: int = 0  # optimizer steps completed
    consecutive_nonfinite: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict[str, int]:
        return {
            "step": self.step,
            "consecutive_nonfinite": self.consecutive_nonfinite,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Raises ValueError for a counter that is not a non-negative whole number (a damaged or
        crafted checkpoint: a negative step would train outside the schedule)."""
        for name in ("step", "consecutive_nonfinite", "skipped_steps"):
            value = state[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"progress.{name} must be a non-negative whole number, got {value!r}")
        self.step = state["step"]
        self.consecutive_nonfinite = state["consecutive_nonfinite"]
        self.skipped_steps = state["skipped_steps"]


def precision_context(precision: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """The context every forward pass runs in: bf16 autocast (`train.precision=bf16`; AttnRes,
    router, balancer and loss still compute in fp32 inside it) or nothing (fp32)."""
    if precision == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def exposed_communication(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Seconds waited per label between two readings of a `TrafficCounter.wait_seconds` (the
    labels with any wait, sorted)."""
    waited = {label: after[label] - before.get(label, 0.0) for label in sorted(after)}
    return {label: seconds for label, seconds in waited.items() if seconds > 0}


class Trainer:
    """Runs the steps of one rank. Parallel layouts enter through `parallel` (a
    `k3train.parallel.state.ParallelState`; `ParallelState.single()` for one process, where every
    collective is the identity), `schedule` (the pipeline schedule over this rank's model chunks;
    with one stage it is plain gradient accumulation) and `reducer` (the data-parallel gradient
    reducer over `model`, the `K3RankModel` that owns this rank's chunks)."""

    def __init__(
        self,
        config: JobConfig,
        model: K3RankModel,
        optimizer,
        data,
        device: torch.device,
        training_flops_per_token: float,
        peak: PeakFlops,
        logger: MetricsLogger | None,
        parallel: ParallelState,
        reducer: GradientReducer,
        schedule: PipelineExecutor,
    ):
        self.config, self.model, self.optimizer, self.data = config, model, optimizer, data
        self.schedule = schedule
        self.device = device
        self.training_flops_per_token = training_flops_per_token
        self._step_flops_per_token = training_flops_per_token  # this step's, with packed documents
        self.peak = peak
        self.logger = logger
        self.parallel = parallel
        self.reducer = reducer
        self.progress = Progress()
        train = config.train
        dp = parallel.layout.data_parallel  # distinct batch shards (the cp ranks of one share rows)
        try:
            self.micro_batches = train.micro_batches_per_rank(dp)  # with the dp resolved from the world size
        except ConfigError as error:
            raise TrainingError(str(error)) from None
        pp, virtual_stages = parallel.layout.pp, config.parallel.virtual_stages
        if virtual_stages > 1:  # refused here, before the first step, rather than inside it
            try:
                check_interleaved_micro_batches(pp, self.micro_batches)
            except PipelineConfigError as error:
                raise TrainingError(str(error)) from None
        self.tokens_per_step = train.global_batch_size * config.data.seq_length  # whole job
        # The ranks that routed distinct tokens: they pool their balancer statistics.
        self.routing_group = parallel.data_tensor if parallel.sequence_parallel else parallel.dp
        self._run_start: float | None = None
        self._steps_this_run = 0
        self.stopped_at_step: int | None = None
        """The step at which a SIGTERM/SIGINT stopped `run` (its checkpoint saved); None otherwise."""
        self._nan_gradient_steps = nan_gradient_steps(os.environ.get(NAN_GRAD_HOOK_ENV), parallel.rank)

    # ------------------------------------------------------------------ pieces
    def train_step(self) -> dict[str, Any]:
        """One optimizer step; returns the step's metrics."""
        started = time.perf_counter()
        config, model, parallel = self.config, self.model, self.parallel
        waited_before = dict(parallel.counter.wait_seconds)
        step = self.progress.step + 1
        lr = lr_at(step - 1, config.schedule, config.optimizer.lr, config.train.steps)
        set_lr(self.optimizer, lr)
        model.train()

        # This data-parallel rank's rows of the step's global batch (TP and PP ranks share them),
        # through the pipeline schedule: forward and backward of every micro-batch, gradients of
        # the mean loss accumulated, the data-parallel reduction launched during the last backward.
        # Under context parallelism the cp ranks read the same rows; the model keeps its own pieces of
        # every sequence (parallel/context.py), and the loss averaged over dp × cp is the global mean.
        batch = self.data.next_batch(config.train.global_batch_size, parallel.data_rank, parallel.layout.data_parallel)
        self._step_flops_per_token = self._flops_per_token(batch)
        micro_batches = [mb.to(self.device, non_blocking=True) for mb in batch.split(config.train.micro_batch_size)]
        with self._poisoned_gradients(step in self._nan_gradient_steps):
            local_loss = self.schedule.run(self.model.chunks, micro_batches)
        self.reducer.finish()
        finish_expert_step(self.model.moe_layers(), parallel)  # next step's replicas
        step_loss = average_over_dp(local_loss, parallel).item()
        grad_norm = clip_grad_norm(
            self.optimizer.gradients_for_step(),  # the model's parameters, or the owned fp32 masters
            config.optimizer.clip_grad,
            parallel,
            owner_only=self.optimizer.owner_only_gradients(),
        ).item()

        expert_stats = self._pooled_expert_stats()
        optimizer_seconds, newton_schulz = 0.0, None
        if math.isfinite(step_loss) and math.isfinite(grad_norm):  # the same decision on every rank
            optimizer_started = time.perf_counter()
            self.optimizer.step()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the optimizer's share of the step, not its launch time
            optimizer_seconds = time.perf_counter() - optimizer_started
            if config.train.precision == "fp8":  # the FP8 weight casts cached since the last step are stale
                te_kernels.new_fp8_weights(model.chunks)
            newton_schulz = muon_step_stats(self.optimizer)
            model.update_routing_biases(self.routing_group)  # used from the next step on
            self.progress.consecutive_nonfinite = 0
        else:
            self.progress.skipped_steps += 1
            self.progress.consecutive_nonfinite += 1
            model.discard_routing_statistics()
            if self.progress.consecutive_nonfinite >= config.train.max_nonfinite_steps:
                raise TrainingError(
                    f"step {step}: loss {step_loss} / grad_norm {grad_norm} not finite for "
                    f"{self.progress.consecutive_nonfinite} steps in a row (train.max_nonfinite_steps="
                    f"{config.train.max_nonfinite_steps}); lower optimizer.lr or resume from an earlier checkpoint"
                )
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step = step
        metrics = self._step_metrics(step, step_loss, grad_norm, lr, expert_stats, time.perf_counter() - started)
        exposed = exposed_communication(waited_before, parallel.counter.wait_seconds)
        metrics.update(
            exposed_comm_s=exposed,  # per counter label: the seconds this rank waited in its collectives
            exposed_comm_total_s=sum(exposed.values()),
        )
        metrics.update(
            optimizer_time_s=optimizer_seconds,
            optimizer_share=optimizer_seconds / metrics["step_time_s"],
            newton_schulz_time_s=newton_schulz.ns_seconds if newton_schulz else 0.0,
            newton_schulz_gflop=newton_schulz.ns_flops / 1e9 if newton_schulz else 0.0,
        )
        return metrics

    @contextlib.contextmanager
    def _poisoned_gradients(self, poison: bool):
        """The test-only NaN hook: this rank's gradients of every parameter become NaN."""
        handles = (
            [
                p.register_hook(lambda grad: torch.full_like(grad, math.nan))
                for p in self.model.parameters()
                if p.requires_grad
            ]
            if poison
            else []
        )
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _pooled_expert_stats(self) -> list:
        """Each local MoE layer's routing this step (tokens per expert, dropped slots, replicas),
        pooled over every rank that routed tokens through it (the balancers' sums ride along, so
        the bias update after the optimizer step needs no further communication except the exact
        quantile's gather). Pipeline stages report their own layers; the step line shows this
        rank's worst layer."""
        moe_layers = self.model.moe_layers()
        ranks = pool_routing_statistics(moe_layers, self.routing_group)  # one all-reduce per step
        return [moe.pop_step_stats(ranks=ranks) for moe in moe_layers]

    def _flops_per_token(self, batch: TokenBatch) -> float:
        """Model FLOPs per training token of this step: with packed documents kept apart, those
        of this rank's rows' documents (MLA within each document: fewer), else the fixed count."""
        if batch.document_starts is None:
            return self.training_flops_per_token
        seq = self.config.data.seq_length
        rows = [
            flops.training_flops_per_token(self.config.model, seq, document_lengths=lengths).total
            for lengths in document_lengths(batch.document_starts)
        ]
        return sum(rows) / len(rows)

    def _step_metrics(self, step, loss, grad_norm, lr, expert_stats, seconds) -> dict[str, Any]:
        self._steps_this_run += 1
        elapsed = time.perf_counter() - self._run_start if self._run_start else seconds
        world_size = self.parallel.layout.world_size
        tokens_per_s = self.tokens_per_step / seconds
        tflops = tokens_per_s * self._step_flops_per_token / world_size / 1e12  # per device
        load_ratios = [stats.load_max_over_mean for stats in expert_stats]
        dropped = sum(stats.dropped_slots for stats in expert_stats)
        remaining = self.config.train.steps - step
        memory = rank_memory_gib(self.device, world_size)
        return {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_s": tokens_per_s,
            "tflops": tflops,
            "mfu": tflops / self.peak.tflops,
            "expert_load_max_over_mean": max(load_ratios) if load_ratios else None,
            "expert_load_max_over_mean_per_layer": load_ratios,
            "dropped_tokens": dropped,  # routed (token, expert) slots beyond expert capacity
            "dropped_tokens_per_layer": [stats.dropped_slots for stats in expert_stats],
            "replicated_experts_per_layer": [stats.replicated_experts for stats in expert_stats],
            "replicas_placed": sum(stats.replicated_experts for stats in expert_stats),  # this stage's layers
            "ep_token_bytes": sum(stats.token_wire_bytes for stats in expert_stats),  # per rank, this step
            "ep_replica_bytes": sum(stats.replica_wire_bytes for stats in expert_stats),
            "skipped_steps": self.progress.skipped_steps,
            "memory_gib": max(memory),
            "memory_gib_per_rank": memory,
            "step_time_s": seconds,
            "eta": format_eta(elapsed / self._steps_this_run * remaining),
        }

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the first `train.eval_batches` validation batches of `global_batch_size`
        rows (the same rows whatever the layout, as Megatron's eval iterations), averaged over DP
        (NaN if the split cannot fill one). Each DP rank takes its share of every batch and runs
        it in the training step's micro-batches (so the pipeline schedules take it as they are)."""
        parallel, train = self.parallel, self.config.train
        dp = parallel.layout.data_parallel
        batches = [
            micro.to(self.device)
            for batch in self.data.validation_token_batches(
                train.global_batch_size, train.eval_batches, dp_rank=parallel.data_rank, dp_size=dp
            )
            for micro in batch.split(train.micro_batch_size)
        ]
        if not batches:
            return math.nan
        self.model.eval()
        loss = self.schedule.run(self.model.chunks, batches, forward_only=True)
        self.model.train()
        return average_over_dp(loss, parallel).item()

    # ------------------------------------------------------------------ the loop
    def run(self, should_stop: Callable[[], bool], save_checkpoint: Callable[[int], None]) -> list[dict[str, Any]]:
        """Train until `train.steps`, or until `should_stop()` (SIGTERM/SIGINT): then save and return."""
        config = self.config
        history: list[dict[str, Any]] = []
        self._run_start = time.perf_counter()
        if self.progress.step >= config.train.steps:
            print(
                f"already at step {self.progress.step} of train.steps={config.train.steps}: nothing to train "
                f"(raise train.steps to continue)",
                flush=True,
            )
            return history
        while self.progress.step < config.train.steps:
            metrics = self.train_step()
            history.append(metrics)
            step = metrics["step"]
            if self.logger is not None and (step % config.train.log_interval == 0 or step == config.train.steps):
                self.logger.log_step(metrics)
            self.parallel.counter.note("world", "all_reduce of the stop flag")
            if should_stop():
                print(f"stop requested: saving a checkpoint at step {step} and exiting", flush=True)
                save_checkpoint(step)
                self.stopped_at_step = step
                return history
            if config.checkpoint.interval and step % config.checkpoint.interval == 0:
                save_checkpoint(step)  # before evaluation: nothing trained is lost if evaluation fails
            if config.train.eval_interval and step % config.train.eval_interval == 0:
                loss = self.evaluate()
                if self.logger is not None:
                    self.logger.log_validation(step, loss)
        if config.checkpoint.save_at_end and not (
            config.checkpoint.interval and self.progress.step % config.checkpoint.interval == 0
        ):
            save_checkpoint(self.progress.step)
        return history
