"""Predicted communication of one training step: bytes and messages per group, for one rank.

`predicted_step_traffic` is the formula that `benchmarks/comm.py` prints beside what comm.py's
`TrafficCounter` measured, and that a layout planner can call without starting processes. It
covers data parallelism, tensor parallelism with or without sequence parallelism, and ZeRO-1
(`pp = 1`, `ep = 1`: pipeline hops are counted by `pipeline_schedule.PipelinePlan`, the expert
all-to-all by `expert.py`). It counts what `TrafficCounter` counts (comm.py's convention: an
all-reduce of N bytes counts N, an all-gather counts the local shard, a reduce-scatter counts the
full input; one message per collective), for one `Trainer.train_step` of `training/loop.py`:
`schedule.run` (forward and backward of every micro-batch) → `reducer.finish` →
`average_over_dp` → `clip_grad_norm` → `pop_step_stats` → `optimizer.step` →
`update_routing_biases`.

Notation: `b` micro-batch size, `s` sequence length, `h` hidden size, `M` micro-batches per rank
and step, `a` bytes per activation element at the region boundaries (4 in fp32), `L` decoder
layers, of which `L_moe` are MoE layers, `E` routed experts, `B` balancer bins. `N = b·s·h·a` is
one micro-batch's full-sequence activation. Every term has an exact message count as well as
its bytes. Every term, by group:

`tp` (the tensor-parallel group; nothing when `tp = 1`)
    TP regions: each token mixer (KDA or MLA), each dense MLP and each MoE layer's shared experts
    is one region (`parallel/tensor.py`: enter, column-parallel, row-parallel, leave), so
    `R = L + (L − L_moe) + (L_moe if shared experts)` regions. Per region and micro-batch:
      TP:   leave all-reduce in forward (N) + enter all-reduce in backward (N): 2N, 2 messages;
      +SP:  enter all-gather (N/tp) and leave reduce-scatter (N) in forward, their adjoints
            all-gather (N/tp) and reduce-scatter (N) in backward: 2N + 2N/tp, 4 messages.
    `model.recompute = sublayer` runs each sublayer's forward again in backward, but torch's
    non-reentrant checkpoint stops recomputing once the last saved tensor is rebuilt (early
    stop, the default): that is the input of the row-parallel projection, so `leave` is not
    re-run and only `enter` is: SP: + N/tp (all-gather), 1 message per region and micro-batch;
    TP: nothing (enter is the identity forward). `attn_res` recompute only recomputes the
    AttnRes mix and norm, which communicate nothing.
    Embedding (vocab-parallel, `leave` of the looked-up rows): TP: N forward (all-reduce), 1 message;
    SP: N forward (reduce-scatter) + N/tp backward (all-gather), 2 messages.
    Head (`enter` before the vocab-parallel `lm_head`): TP: N backward (all-reduce), 1 message;
    SP: N/tp forward (all-gather) + N backward (reduce-scatter), 2 messages.
    Vocab-parallel cross-entropy: three all-reduces of `[b·s]` fp32 (max logit, target logit,
    sum of exponentials; fp64 for a float64 model), 3 messages per micro-batch; backward needs none.
    Global gradient norm: one fp32 scalar all-reduce (`global_grad_norm_squared`), 4 bytes.
    Per-Head Muon on a TP-sharded matrix that is not split by heads (an MLP's gate/up/down,
    KDA's `f_b_proj`/`b_proj`; every sharded matrix with `muon_per_head = False`): its rank's
    momentum shard is all-gathered over TP to orthogonalise the whole matrix
    (`optim/muon.py: sharded_matrix_update`), shard bytes, 1 message each, on the rank that
    steps it: every rank without ZeRO-1, the parameter's owner with it. So under ZeRO-1 the
    `tp` traffic differs between DP ranks (the owners of a name are the same dp rank in every
    TP column, so the collectives pair up).

`dp` (nothing when `dp = 1`)
    Gradient buckets (`GradientReducer`) of plain parameters: all-reduce of
    `(numel + parameters) × 4` bytes per bucket (fp32 gradients plus one has-gradient flag per
    parameter), one message per bucket. The buckets are read from a `GradientReducer` built over
    the model on the meta device, so the packing (reverse registration order, `bucket_bytes`)
    is the reducer's own.
    ZeRO-1 parameter exchange: per replica group and dtype, every rank all-gathers a buffer
    padded to the longest rank's owned elements, in chunks of `bucket_bytes`:
    `longest × element size` bytes, `ceil(longest / chunk)` messages. The owners and the buffer
    lengths are the `DistributedOptimizer`'s (`plan_ownership`, its exchange layout) built over
    the meta model. Nothing without ZeRO-1.
    Loss average (`average_over_dp`): one fp64 scalar all-reduce, 8 bytes.
    Balancer and expert-load statistics when sequence parallelism is off (see `data_tensor`).

`data_tensor` (the `dp × tp` ranks of the stage)
    Gradient buckets of `tp_partial_grad` parameters (replicated over TP with partial gradients:
    MLA's `q_a`/`kv_a` stages and their norms, KDA's `f_a_proj` and `o_norm`, and under
    sequence parallelism every norm, AttnRes and routed-MoE parameter): as for `dp`, summed over
    `dp × tp` at once. Exists whenever `tp > 1` (with `dp = 1` it is the TP ranks).
    Routing statistics, on the routing group (`data_tensor` under sequence parallelism, where
    each TP rank routes its own tokens; otherwise `dp`, whose ranks route distinct tokens while
    TP ranks route the same ones), per step: ONE all-reduce (`moe.pool_routing_statistics`) of
      every MoE layer's `E + 4` int64 loads and counters, plus its balancer sums:
      `quantile_histogram` the `E × B` int64 counts, `sign` the `E` int64 loads; the exact
      `quantile` balancer then all-gathers each layer's margins `[M·b·s / (tp under SP), E]` fp32
      (one message per layer); `none` adds nothing.

Not counted (they bypass comm.py's groups; the counter cannot see them): the per-rank memory
all-gather in the step line (`training/throughput.py: rank_memory_gib`, `torch.distributed.
all_gather` of one float64 per rank on the default group), the stop-flag all-reduce of
`GracefulExit.requested` between steps (one int32 on the default group) and the start-up
broadcast of the run directory. `pp` and `ep` have one rank here and carry nothing; `model` and
`expert_dp` carry nothing either (the norm sums over `tp`, and with `ep = 1` no parameter is
expert-parallel).

Assumptions: the step is finite (a skipped step sends no ZeRO-1 exchange, no Muon gather and no
balancer update); every Muon parameter receives a gradient (Muon skips one without); activation
bytes `a` are the same on both sides of a region, which holds in fp32 (the recipes' precision).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from k3train.parallel.grad_reduce import DEFAULT_BUCKET_BYTES, GradientReducer, is_tensor_parallel
from k3train.parallel.zero1 import DistributedOptimizer
from k3train.parallel.state import ParallelState, resolve_layout


@dataclass(frozen=True)
class TrafficTerm:
    """One line of the formula: what one rank sends on `group` in one step."""

    group: str
    what: str
    bytes: int
    messages: int


class _PlanningState(ParallelState):
    """A `ParallelState` with the groups' ranks and sizes but no process groups (no collective
    may run on it): what the model, the reducer and the optimizer need to lay themselves out."""

    def _own_group(self, name, all_groups, distributed):
        return super()._own_group(name, all_groups, False)


def planning_state(model_config, tp: int, dp: int, sequence_parallel: bool,
                   tp_rank: int = 0, dp_rank: int = 0) -> ParallelState:
    """The parallel state rank `(tp_rank, dp_rank)` of a `tp × dp` job would have, without
    torch.distributed; the layout is checked as at start-up (`resolve_layout`)."""
    layout = resolve_layout(tp * dp, tp, 1, dp, 1, 1, model_config.num_attention_heads,
                            model_config.linear_attn_config.num_heads, model_config.vocab_size,
                            model_config.num_experts, model_config.num_hidden_layers)
    if not (0 <= tp_rank < tp and 0 <= dp_rank < dp):
        raise ValueError(f"rank (tp {tp_rank}, dp {dp_rank}) outside tp={tp} × dp={dp}")
    return _PlanningState(layout, layout.rank_of(tp_rank, dp_rank, 0), sequence_parallel=sequence_parallel)


def meta_model(model_config, state: ParallelState, param_dtype: torch.dtype = torch.float32):
    """This rank's model as `pretrain_k3.py` builds it (one `K3Stage` over one `K3Model`), on the
    meta device: shapes, names and parallel markers, no memory."""
    from k3train.model.k3 import K3Model, K3Stage

    with torch.device("meta"):
        model = K3Stage([K3Model(model_config, parallel=state).to(param_dtype)])
    return model


def step_traffic_terms(
    model_config,
    optimizer_config,
    *,
    tp: int = 1,
    dp: int = 1,
    pp: int = 1,
    ep: int = 1,
    micro_batch_size: int,
    seq_length: int,
    micro_batches: int,
    dtype_bytes: int = 4,
    zero1: bool = True,
    sequence_parallel: bool = False,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    tp_rank: int = 0,
    dp_rank: int = 0,
    param_dtype: torch.dtype = torch.float32,
) -> list[TrafficTerm]:
    """Every term of one training step on rank `(tp_rank, dp_rank)`, in the module docstring's
    order (terms that send nothing are left out). `micro_batches` is per rank and step
    (`global_batch_size / (micro_batch_size · dp)`); `dtype_bytes` the activation element size."""
    if pp != 1 or ep != 1:
        raise ValueError(f"the traffic formula covers pp=1 and ep=1 (got pp={pp}, ep={ep}); pipeline hops: "
                         "PipelinePlan.blocks_per_micro_batch, expert dispatch: benchmarks/moe.py")
    sp = sequence_parallel and tp > 1
    if sp and seq_length % tp:
        raise ValueError(f"seq_length={seq_length} does not split over tp={tp} (sequence parallelism)")
    state = planning_state(model_config, tp, dp, sp, tp_rank, dp_rank)
    cfg = model_config
    terms: list[TrafficTerm] = []

    def add(group: str, what: str, nbytes: int, messages: int) -> None:
        if messages:
            terms.append(TrafficTerm(group, what, int(nbytes), int(messages)))

    layers = cfg.num_hidden_layers
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(layers))
    dense_layers = layers - moe_layers
    float_bytes = 8 if dtype_bytes == 8 else 4  # CE and router scores: fp32, or fp64 in a float64 model
    M = micro_batches
    tokens = micro_batch_size * seq_length
    full = tokens * cfg.hidden_size * dtype_bytes  # N: one micro-batch's full-sequence activation
    shard = full // tp  # N / tp: its sequence shard

    # ---- tp: TP regions, embedding, head, cross-entropy, norm, Muon gathers
    if tp > 1:
        regions = layers + dense_layers + (moe_layers if cfg.num_shared_experts > 0 else 0)
        if sp:
            add("tp", f"{regions} TP regions fwd: enter all-gather N/tp + leave reduce-scatter N",
                M * regions * (shard + full), M * regions * 2)
            add("tp", f"{regions} TP regions bwd: leave all-gather N/tp + enter reduce-scatter N",
                M * regions * (shard + full), M * regions * 2)
        else:
            add("tp", f"{regions} TP regions fwd: leave all-reduce N", M * regions * full, M * regions)
            add("tp", f"{regions} TP regions bwd: enter all-reduce N", M * regions * full, M * regions)
        if cfg.recompute == "sublayer" and sp:  # every region sits in a recomputed sublayer
            add("tp", f"recompute=sublayer: {regions} regions' enter all-gather N/tp again in backward",
                M * regions * shard, M * regions)
        if sp:
            add("tp", "embedding leave: reduce-scatter N fwd + all-gather N/tp bwd", M * (full + shard), 2 * M)
            add("tp", "head enter: all-gather N/tp fwd + reduce-scatter N bwd", M * (shard + full), 2 * M)
        else:
            add("tp", "embedding leave: all-reduce N fwd", M * full, M)
            add("tp", "head enter: all-reduce N bwd", M * full, M)
        add("tp", "vocab-parallel CE: 3 all-reduces of [b·s]", M * 3 * tokens * float_bytes, 3 * M)
        add("tp", "global grad norm: fp32 scalar all-reduce", 4, 1)

    from k3train.optim.builder import build_optimizer, parameter_costs, route_parameters
    from k3train.optim.muon import block_layout

    model = meta_model(cfg, state, param_dtype)
    optimizer = DistributedOptimizer(build_optimizer(model, optimizer_config), model, state,
                                     parameter_costs(model, optimizer_config), zero1=zero1, bucket_bytes=bucket_bytes)
    if tp > 1:

        stepped = set(optimizer.owned_parameter_names())
        gathered = [route.param for route in route_parameters(model, optimizer_config)
                    if route.route == "muon" and route.name in stepped and is_tensor_parallel(route.param)
                    and block_layout(route.param, optimizer_config.muon_per_head).kind == "matrix"]
        add("tp", f"Muon: all-gather of {len(gathered)} sharded whole matrices' momentum"
            + (" (owned ones)" if zero1 and dp > 1 else ""),
            sum(p.numel() * p.element_size() for p in gathered), len(gathered))

    # ---- dp / data_tensor: gradient buckets, loss, ZeRO-1 exchange
    reducer = GradientReducer(model, state, bucket_bytes=bucket_bytes, overlap=False)
    buckets: dict[str, list] = defaultdict(list)
    for bucket in reducer.buckets:
        buckets[bucket.reduction.group.name].append(bucket)
    for group_name in ("dp", "data_tensor"):
        found = buckets.get(group_name, [])
        if found:
            tensors = sum(len(b.params) for b in found)
            add(group_name, f"gradient buckets: {tensors} tensors, {sum(b.numel for b in found)} elements (+flags)",
                sum(b.nbytes for b in found), len(found))
    if dp > 1:
        add("dp", "loss average: fp64 scalar all-reduce", 8, 1)
    for exchange in optimizer._exchanges:
        element = torch.empty((), dtype=exchange.dtype).element_size()
        chunk = max(1, bucket_bytes // element)
        add(exchange.group.name, f"ZeRO-1 exchange ({exchange.dtype}): padded buffer of {exchange.length} elements",
            exchange.length * element, math.ceil(exchange.length / chunk))

    # ---- routing statistics on the routing group
    routing_group = state.data_tensor if sp else state.dp
    if routing_group.size > 1 and moe_layers:
        name = routing_group.name
        experts = cfg.num_experts
        # One all-reduce pools every layer's summable statistics (`moe.pool_routing_statistics`).
        pooled_elements = moe_layers * (experts + 4)
        described = f"{moe_layers} × (E+4) loads"
        if cfg.balancer == "quantile_histogram":
            pooled_elements += moe_layers * experts * cfg.balancer_bins
            described += f" + {moe_layers} × E×bins histograms"
        elif cfg.balancer == "sign":
            pooled_elements += moe_layers * experts
            described += f" + {moe_layers} × E balancer loads"
        add(name, f"routing statistics, one all-reduce: {described}, int64", pooled_elements * 8, 1)
        if cfg.balancer == "quantile":
            local_tokens = M * tokens // (tp if sp else 1)
            add(name, f"balancer: {moe_layers} × all-gather of [{local_tokens}, E] margins",
                moe_layers * local_tokens * experts * float_bytes, moe_layers)
    return terms


def predicted_step_traffic(model_config, optimizer_config, **kwargs) -> dict[str, tuple[int, int]]:
    """`{group name: (bytes, messages)}` one rank sends in one training step, in the form of
    `TrafficCounter.snapshot()`; the arguments are `step_traffic_terms`'."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for term in step_traffic_terms(model_config, optimizer_config, **kwargs):
        totals[term.group][0] += term.bytes
        totals[term.group][1] += term.messages
    return {name: (totals[name][0], totals[name][1]) for name in sorted(totals)}


def describe_terms(terms: list[TrafficTerm]) -> str:
    """The terms as markdown table rows (group, what, bytes, messages)."""
    lines = ["| group | term | bytes | messages |", "| --- | --- | ---: | ---: |"]
    lines += [f"| {t.group} | {t.what} | {t.bytes:,} | {t.messages} |" for t in terms]
    return "\n".join(lines)


__all__ = ["TrafficTerm", "step_traffic_terms", "predicted_step_traffic", "planning_state", "meta_model",
           "describe_terms"]
