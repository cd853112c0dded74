"""`tools/plan.py --validate`: the planner's predictions beside gloo runs of small layouts.

One `torchrun` launch of CPU processes per world size runs the layouts of `VALIDATION_LAYOUTS`
(the debug recipe) of that size in turn, as `pretrain_k3.main` builds them; layouts of more
processes than `ValidationSettings.max_ranks` (default: the machine's cores, 2 to 4) are left out. After a warm-up step, steps alternate between
the machine's own collectives ("plain") and an emulated network on every group but the
pipeline's (`parallel.emulate_network`: each collective completes no earlier than `latency +
bytes / bandwidth` after every rank has entered it and its link is free; pipeline hops are
never delayed). Per layout and rank
it records what `parallel/comm.py` counted (bytes, messages per label), the seconds the rank
waited per label, the step time, and, in one more step of one micro-batch, what the rank holds
(weights, gradients, optimizer state, the bytes autograd saves).

The prediction for each term is the planner's own:
* bytes and messages: the traffic terms of the rank's build (`planning/traffic.py`);
* exposed seconds: `planning/time.py`'s `estimate_step_time` with the emulated link as the
  hardware (latency counted as its bytes on the link: `messages × latency × bandwidth`) and the
  compute rate calibrated from the plain steps (the slowest rank's step less its waits and its
  optimizer step), so the overlap rules (each gradient bucket under the rest of the last
  backward from when it is full, the chunked expert all-to-alls under the experts, the ZeRO-1
  exchange and everything else exposed) are what is checked, not the CPU's speed. Measured: what
  the link added, the label's wait in the emulated steps less its wait in the plain ones (the
  machine's own: gloo's copies and the peers' lateness, printed apart). Under the emulated link
  a transfer starts when every rank has entered the collective, so lateness and link time add,
  as on a real network;
* bubble: the same estimate's `(P − 1)/V` micro-batch times against the pipeline hops' waits of
  the plain steps;
* memory: `planning/memory.py`'s `rank_memory` against the measured bytes (bf16 weights with
  fp32 master shards, as the GPU recipes run).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3train.planning.layout_traffic import DATA_PARALLEL_GROUPS

EXPOSED_BOUND = 0.15
"""A term's predicted exposed seconds within this share of the measured ones counts as validated."""
JUDGED_FROM_S = 0.02
"""Exposed seconds below this, predicted and measured, are not judged: a few scalar all-reduces,
whose waits are the timer's and the scheduler's noise (a ratio of two near-zero numbers)."""
PIPELINE_LABELS = ("pp", "pp_grad")
"""The counter labels of the pipeline's hops (forward on `pp`, gradients on `pp_grad`)."""
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RECIPE = ROOT / "recipes" / "debug.yaml"
EMULATED_GROUPS = ("tp", "dp", "data_tensor", "model", "ep", "expert_dp", "cp")
"""Every group the emulated link delays (the pipeline's hops are timed, never delayed)."""
MIXED = ("train.precision=bf16", "train.weights=bf16_with_fp32_master_shards")
HALVES = ("parallel.ep_overlap_chunks=2", "parallel.ep_overlap_halves=true")
"""Alternating halves with `online` replicas (whose bytes, unlike a step placement's, the planner
knows before the routing: one `[R, M, F]` exchange per half)."""

VALIDATION_LAYOUTS: tuple[dict[str, Any], ...] = (
    dict(name="TP2+SP", tp=2, sequence_parallel=True),
    dict(name="TP2+SP, 4 TP pieces", tp=2, sequence_parallel=True, overrides=["parallel.tp_overlap_chunks=4"]),
    dict(name="DP2", dp=2),
    dict(name="PP2", pp=2),
    dict(name="EP2 relay", dp=2, ep=2, overrides=["parallel.ep_transport=relay"]),
    dict(
        name="EP2 spread, 4 chunks",
        dp=2,
        ep=2,
        overrides=["parallel.ep_transport=spread", "parallel.ep_overlap_chunks=4"],
    ),
    dict(
        name="EP2 padded, 2 chunks, halves",
        dp=2,
        ep=2,
        micro_batch_size=2,
        overrides=[*HALVES, "parallel.ep_transport=padded"],
    ),
    dict(
        name="TP2×EP2+SP spread, 4 chunks",
        tp=2,
        dp=2,
        ep=2,
        sequence_parallel=True,
        overrides=["parallel.ep_transport=spread", "parallel.ep_overlap_chunks=4"],
    ),
    dict(
        name="PP2×EP2 relay, 4 chunks",
        pp=2,
        dp=2,
        ep=2,
        overrides=["parallel.ep_transport=relay", "parallel.ep_overlap_chunks=4"],
    ),
    dict(
        name="PP2×EP2 padded, 2 chunks, halves",
        pp=2,
        dp=2,
        ep=2,
        micro_batch_size=2,
        overrides=[*HALVES, "parallel.ep_transport=padded"],
    ),
)
"""Layouts covering the planner's rules: TP collectives, gradient buckets and the ZeRO-1
exchange, the pipeline, expert all-to-alls exposed and overlapped (in chunks, and as alternating halves). Fixed-shape EP transports
(relay, spread), so that the bytes do not depend on the routing."""


def world_size_of(layout: dict[str, Any]) -> int:
    return layout.get("tp", 1) * layout.get("dp", 1) * layout.get("pp", 1)


def default_max_ranks() -> int:
    """One process per core, at most 4: more processes than cores wait mostly for each other's
    turn on a core, which no network model predicts."""
    return max(2, min(4, os.cpu_count() or 2))


@dataclass(frozen=True)
class ValidationSettings:
    """What `--validate` runs: the emulated link of every group, the steps, the shapes."""

    recipe: str = str(DEFAULT_RECIPE)
    bandwidth_gbps: float = 0.02
    latency_us: float = 100.0
    steps: int = 3
    """Measured steps of each kind (plain, emulated), after one warm-up step."""
    micro_batch_size: int = 1
    micro_batches: int = 4
    max_ranks: int = 4
    """Layouts of more processes are left out (`default_max_ranks`: the machine's cores)."""
    seq_length: int = 64
    timeout_s: float = 900.0


# ------------------------------------------------------------------------------- worker side
def _set_links(state, link_spec: tuple[float, float] | None) -> None:
    from k3train.parallel.comm import EmulatedLink

    for name in EMULATED_GROUPS:
        group = getattr(state, name)
        group.link = None if link_spec is None else EmulatedLink(link_spec[0] * 1e9, link_spec[1] * 1e-6)


def _measure_layout(rank: int, layout: dict[str, Any], settings: ValidationSettings) -> dict[str, Any]:
    from k3train.config import load_config
    from k3train.parallel.state import ParallelState, layout_of
    from k3train.planning.layout_traffic import gradient_bucket_schedule
    from k3train.planning.measured import build_trainer, layout_batching, layout_overrides, measured_memory_step
    from k3train.planning.memory import rank_memory
    from k3train.planning.traffic import job_traffic_terms
    from k3train.training.build import build_planning_rank

    micro_batch_size, micro_batches = layout_batching(layout, settings.micro_batch_size, settings.micro_batches)
    overrides = layout_overrides(layout, micro_batch_size, micro_batches, settings.seq_length)
    config = load_config(settings.recipe, [*overrides, f"train.steps={1 + 2 * settings.steps}"])
    grid = layout_of(world_size_of(layout), config.parallel, config.model)
    state = ParallelState(
        grid,
        rank,
        sequence_parallel=config.parallel.sequence_parallel,
        collective_timeout_s=300,
        tp_overlap_chunks=config.parallel.tp_overlap_chunks,
    )
    trainer = build_trainer(config, state)
    trainer.train_step()  # warm-up: first-step costs, placements
    link = (settings.bandwidth_gbps, settings.latency_us)
    steps: dict[str, list[dict[str, Any]]] = {"plain": [], "emulated": []}
    for _ in range(settings.steps):
        for kind in ("plain", "emulated"):
            _set_links(state, link if kind == "emulated" else None)
            state.counter.reset()
            metrics = trainer.train_step()
            steps[kind].append(
                dict(
                    step_s=metrics["step_time_s"],
                    exposed=metrics["exposed_comm_s"],
                    counted=state.counter.snapshot(),
                    loss=metrics["loss"],
                    optimizer_s=metrics["optimizer_time_s"],
                )
            )
    _set_links(state, None)
    planning_job = build_planning_rank(config, grid, rank)
    terms = job_traffic_terms(planning_job, micro_batches)
    buckets = gradient_bucket_schedule(planning_job, counted=True)

    # Memory: one step of one micro-batch (saved bytes of one micro-batch, counted once each), with
    # the GPU recipes' precision (bf16 weights, fp32 master shards: gradients in `main_grad` buffers).
    memory_config = load_config(
        settings.recipe,
        [*layout_overrides(layout, micro_batch_size, 1, settings.seq_length), "train.steps=1", *MIXED],
    )
    memory_state = ParallelState(
        grid, rank, sequence_parallel=memory_config.parallel.sequence_parallel, collective_timeout_s=300
    )
    _, measured_memory = measured_memory_step(build_trainer(memory_config, memory_state))
    predicted = rank_memory(build_planning_rank(memory_config, grid, rank), grid, 1)
    predicted_memory = dict(
        weights=predicted.weights,
        gradients=predicted.gradients,
        master=predicted.master,
        optimizer=predicted.optimizer,
        activations=predicted.activations + predicted.pipeline_blocks + predicted.expert_buffers,
    )
    return dict(
        name=layout["name"],
        steps=steps,
        terms=[[term.group, term.what, term.bytes, term.messages] for term in terms],
        buckets={group: [list(bucket) for bucket in schedule] for group, schedule in buckets.items()},
        measured_memory=measured_memory,
        predicted_memory=predicted_memory,
    )


def worker_main(argv: list[str]) -> int:
    """One rank of the validation launch: `python -m k3train.planning.validate PAYLOAD OUT_DIR`."""
    import torch
    import torch.distributed as dist

    payload_path, out_dir = argv
    payload = json.loads(Path(payload_path).read_text())
    settings = ValidationSettings(**payload["settings"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = []
    for layout in payload["layouts"]:
        results.append(_measure_layout(rank, layout, settings))
        dist.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------- launcher side
def launch(settings: ValidationSettings, layouts=VALIDATION_LAYOUTS) -> list[tuple[dict[str, Any], list[dict]]]:
    """Run the layouts of at most `settings.max_ranks` processes, one torchrun launch of gloo
    ranks per world size; per layout, its spec and the results of its ranks."""
    by_world: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for layout in layouts:
        if world_size_of(layout) <= settings.max_ranks:
            by_world[world_size_of(layout)].append(layout)
    measured: dict[str, list[dict]] = {}
    for world, chosen in sorted(by_world.items()):
        for layout, per_rank in zip(chosen, _launch_world(settings, world, chosen)):
            measured[layout["name"]] = per_rank
    return [(layout, measured[layout["name"]]) for layout in layouts if layout["name"] in measured]


def _launch_world(settings: ValidationSettings, world: int, layouts: list[dict[str, Any]]) -> list[list[dict]]:
    """One torchrun launch of `world` ranks running `layouts` in turn: per layout, per rank."""
    with tempfile.TemporaryDirectory(prefix="k3train-validate-") as work:
        payload = Path(work, "payload.json")
        payload.write_text(json.dumps(dict(settings=vars(settings), layouts=layouts)))
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={world}",
            "-m",
            "k3train.planning.validate",
            str(payload),
            work,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        try:
            done = subprocess.run(
                command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=settings.timeout_s
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"validation launch of {world} ranks did not finish in {settings.timeout_s:.0f} s (a collective "
                "hung, or the machine is too loaded); raise --validate-timeout"
            ) from None
        if done.returncode != 0:
            raise RuntimeError(f"validation launch failed (exit {done.returncode}):\n{_first_failure(done.stderr)}")
        per_rank = [json.loads(Path(work, f"rank{rank}.json").read_text()) for rank in range(world)]
        return [[per_rank[rank][index] for rank in range(world)] for index in range(len(layouts))]


def _first_failure(stderr: str) -> str:
    """The traceback of the first rank that failed (torchrun prefixes its lines `[rankN]:`), or
    the end of the output."""
    lines = stderr.strip().splitlines()
    for index, line in enumerate(lines):
        if line.startswith("[rank") and "Traceback" in line:
            prefix = line.split(":", 1)[0]
            own = [text for text in lines[index:] if text.startswith(prefix + ":")]
            return "\n".join(own[-12:])
    return "\n".join(lines[-30:])


def _mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else 0.0


def _compute_s(step: dict[str, Any]) -> float:
    """A step's forward and backward compute: its time less its waits and the optimizer step
    (which the planner's compute term does not hold)."""
    return step["step_s"] - sum(step["exposed"].values()) - step["optimizer_s"]


@dataclass
class TermRow:
    layout: str
    term: str
    what: str  # "bytes", "messages", "exposed s", "bubble s", "memory B"
    predicted: float
    measured: float
    machine: float | None = None
    """Exposed seconds: the label's wait in the plain steps (the machine's own), which `measured`
    (the emulated steps' wait) is taken less."""

    @property
    def judged(self) -> bool:
        """An exposed-seconds row large enough to hold to `EXPOSED_BOUND`."""
        return self.what == "exposed s" and max(self.predicted, self.measured) >= JUDGED_FROM_S

    @property
    def within_bound(self) -> bool:
        return self.judged and abs(self.ratio - 1) <= EXPOSED_BOUND

    @property
    def ratio(self) -> float:
        if self.measured == 0:
            return 1.0 if self.predicted == 0 else math.inf
        return self.predicted / self.measured


def predicted_exposed(
    layout_spec: dict[str, Any],
    settings: ValidationSettings,
    terms: list[list[Any]],
    buckets: dict[str, list[list[float]]],
    compute_s: float,
) -> tuple[dict[str, float], float]:
    """The planner's exposed seconds per counter label of one rank's emulated step, and its
    bubble, with the emulated link as hardware and the compute rate that makes its compute
    `compute_s`. `terms`: the rank's traffic terms `[label, what, bytes, messages]`; of the
    data-parallel groups only the gradient buckets overlap (the planner's rule), their other
    terms (the ZeRO-1 exchange, the loss and norm scalars) go in as `<label>.exposed`."""
    from k3train.config import load_config
    from k3train.parallel.pipeline_schedule import PipelinePlan
    from k3train.parallel.state import layout_of
    from k3train.planning.hardware import HardwareProfile
    from k3train.planning.layout_traffic import overlapped_tensor_regions
    from k3train.planning.measured import layout_batching, layout_overrides
    from k3train.planning.time import estimate_step_time

    micro_batch_size, micro_batches = layout_batching(layout_spec, settings.micro_batch_size, settings.micro_batches)
    config = load_config(
        settings.recipe, layout_overrides(layout_spec, micro_batch_size, micro_batches, settings.seq_length)
    )
    world = world_size_of(layout_spec)
    grid = layout_of(world, config.parallel, config.model)
    plan = PipelinePlan.from_config(config.model, config.parallel)
    bandwidth = settings.bandwidth_gbps * 1e9

    latency_bytes = settings.latency_us * 1e-6 * bandwidth
    schedule = {group: [(nbytes + latency_bytes, share) for nbytes, share in rows] for group, rows in buckets.items()}

    # The overlapped TP entries' pieces pay the link's latency each, as every message does here.
    entries = overlapped_tensor_regions(config, grid, device_type="cpu")
    if entries is not None:
        piece_latency = entries.pieces * latency_bytes
        entries = dataclasses.replace(
            entries,
            gather_bytes=entries.gather_bytes + (piece_latency if entries.gather_bytes else 0.0),
            reduce_bytes=entries.reduce_bytes + piece_latency,
        )

    def estimate(tflops: float, comm_bytes: dict[str, float]):
        profile = HardwareProfile("emulated", 1.0, tflops, tflops, 1.0, bandwidth / 1e9, bandwidth / 1e9, world)
        return estimate_step_time(
            config.model,
            grid,
            plan,
            profile,
            micro_batch_size=micro_batch_size,
            seq_length=settings.seq_length,
            micro_batches=micro_batches,
            precision="bf16",
            comm_bytes=comm_bytes,
            efficiency=1.0,
            gpus_per_node=world,
            ep_overlap_chunks=config.parallel.ep_overlap_chunks,
            ep_overlap_halves=config.parallel.ep_overlap_halves,
            gradient_buckets=schedule,
            tp_overlap=entries,
        )

    unit = estimate(1.0, {})
    tflops = unit.compute_s / compute_s  # the rate at which the planner's compute is the measured one
    on_link: dict[str, float] = defaultdict(float)
    label_of: dict[str, str] = {}
    for label, what, nbytes, messages in terms:
        if label.split(".")[0] not in EMULATED_GROUPS:
            continue
        key = label
        if label in DATA_PARALLEL_GROUPS and not what.startswith("gradient buckets"):
            key = f"{label}.exposed"
        on_link[key] += nbytes + messages * latency_bytes
        label_of[key] = label
    step = estimate(tflops, dict(on_link))
    exposed: dict[str, float] = defaultdict(float)
    for key, seconds in step.exposed_comm_s.items():
        exposed[label_of[key]] += seconds
    return dict(exposed), step.bubble_s


def _traffic(terms: list[list[Any]]) -> dict[str, list[int]]:
    """`{label: [bytes, messages]}` of the terms, as the counter's snapshot."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for label, _, nbytes, messages in terms:
        totals[label][0] += nbytes
        totals[label][1] += messages
    return dict(totals)


def compare(results: list[tuple[dict[str, Any], list[dict]]], settings: ValidationSettings) -> list[TermRow]:
    """Rows of predicted against measured for every layout: per label the bytes and messages of
    rank 0 (with a note where a rank differs), the exposed seconds averaged over the ranks, the
    bubble of pipeline layouts, and rank 0's memory terms."""
    rows: list[TermRow] = []
    for layout_spec, per_rank in results:
        name = layout_spec["name"]
        # The pace of the step: the slowest rank's compute (its step minus every wait).
        pace = max(_mean(_compute_s(step) for step in rank_result["steps"]["plain"]) for rank_result in per_rank)
        exposed_predicted: dict[str, list[float]] = defaultdict(list)
        exposed_measured: dict[str, list[float]] = defaultdict(list)
        exposed_plain: dict[str, list[float]] = defaultdict(list)  # the same waits without the link
        bubbles_predicted, bubbles_measured = [], []
        for rank, rank_result in enumerate(per_rank):
            traffic = _traffic(rank_result["terms"])
            counted = rank_result["steps"]["emulated"][-1]["counted"]
            for label in sorted(set(traffic) | set(counted)):
                if rank == 0:
                    want, got = traffic.get(label, [0, 0]), counted.get(label, [0, 0])
                    rows.append(TermRow(name, label, "bytes", want[0], got[0]))
                    rows.append(TermRow(name, label, "messages", want[1], got[1]))
            predicted, bubble = predicted_exposed(
                layout_spec, settings, rank_result["terms"], rank_result["buckets"], pace
            )
            plain, emulated = rank_result["steps"]["plain"], rank_result["steps"]["emulated"]
            for label, seconds in predicted.items():
                exposed_predicted[label].append(seconds)
                waited_plain = _mean(s["exposed"].get(label, 0.0) for s in plain)
                exposed_measured[label].append(_mean(s["exposed"].get(label, 0.0) for s in emulated) - waited_plain)
                exposed_plain[label].append(waited_plain)
            if layout_spec.get("pp", 1) > 1:
                bubbles_predicted.append(bubble)
                bubbles_measured.append(
                    _mean(sum(v for k, v in s["exposed"].items() if k.split(".")[0] in PIPELINE_LABELS) for s in plain)
                )
        for label in sorted(exposed_predicted):
            rows.append(
                TermRow(
                    name,
                    label,
                    "exposed s",
                    _mean(exposed_predicted[label]),
                    _mean(exposed_measured[label]),
                    _mean(exposed_plain[label]),
                )
            )
        if bubbles_predicted:
            rows.append(TermRow(name, "pp", "bubble s", _mean(bubbles_predicted), _mean(bubbles_measured)))
        memory_predicted, memory_measured = per_rank[0]["predicted_memory"], per_rank[0]["measured_memory"]
        for term in ("weights", "gradients", "master", "optimizer", "activations"):
            if memory_predicted[term] or memory_measured[term]:
                rows.append(TermRow(name, term, "memory B", memory_predicted[term], memory_measured[term]))
    return rows


def format_rows(rows: list[TermRow]) -> str:
    """A markdown table; exposed-seconds rows say whether they are within `EXPOSED_BOUND`."""
    lines = [
        "| layout | term | quantity | predicted | measured | predicted/measured | plain steps' wait |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        number = "{:,.0f}" if row.what in ("bytes", "messages", "memory B") else "{:.3f}"
        verdict = ""
        if row.what == "exposed s":
            verdict = (
                " ok"
                if row.within_bound
                else (" off" if row.judged else f" (not judged: < {JUDGED_FROM_S * 1e3:.0f} ms)")
            )
        lines.append(
            f"| {row.layout} | {row.term} | {row.what} | {number.format(row.predicted)} | "
            f"{number.format(row.measured)} | {row.ratio:.3f}{verdict} | "
            + (f"{row.machine:.3f} |" if row.machine is not None else "|")
        )
    return "\n".join(lines)


def summary(rows: list[TermRow]) -> str:
    exposed = [row for row in rows if row.judged]
    within = [row for row in exposed if row.within_bound]
    exact = [row for row in rows if row.what in ("bytes", "messages")]
    equal = [row for row in exact if row.predicted == row.measured]
    return (
        f"bytes and messages: {len(equal)} of {len(exact)} terms equal; exposed seconds: {len(within)} of "
        f"{len(exposed)} terms within {EXPOSED_BOUND:.0%} of measured (terms under {JUDGED_FROM_S * 1e3:.0f} ms not judged)"
    )


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))


__all__ = ["VALIDATION_LAYOUTS", "ValidationSettings", "launch", "compare", "format_rows", "summary", "TermRow"]
