"""The planner's `nodes` and `splits` transports (`k3train/planning/layout_traffic.py`): the
expected distinct nodes a token reaches, the rows per hop, and the links they are priced on."""

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from k3train.planning.layout_traffic import node_hit_probability, node_layer_traffic


def test_hit_probability_counts_every_choice_of_experts():
    # 8 experts on 4 nodes (2 each), top-2: enumerate the 28 choices, count those touching node 0
    experts, top_k, nodes = 8, 2, 4
    choices = list(itertools.combinations(range(experts), top_k))
    touching = sum(any(e // (experts // nodes) == 0 for e in choice) for choice in choices)
    assert node_hit_probability(experts, top_k, nodes) == pytest.approx(touching / len(choices))


def test_k3_token_reaches_seven_of_eight_nodes():
    # 896 experts over 8 nodes, top-16 (the figure: 7.1 distinct nodes per token)
    assert 8 * node_hit_probability(896, 16, 8) == pytest.approx(7.1, abs=0.05)


def test_the_expectation_matches_sampled_routing_deduplicated_as_the_transport_does():
    generator = torch.Generator().manual_seed(0)
    experts, top_k, ranks, per_node, tokens = 64, 6, 8, 2, 4000
    choice = torch.rand(tokens, experts, generator=generator).argsort(dim=1)[:, :top_k]  # uniform top-k
    node = (choice // (experts // ranks)) // per_node  # expert -> home rank -> node
    nodes = ranks // per_node
    # the transport's (token, node) keys, less this rank's own node (node 0 here)
    keys = torch.unique(torch.arange(tokens)[:, None] * nodes + node)
    remote = int((keys % nodes != 0).sum())
    expected = tokens * (nodes - 1) * node_hit_probability(experts, top_k, nodes)
    # binomial-like spread: a few standard deviations of `tokens` Bernoulli draws per node
    assert abs(remote - expected) < 4 * math.sqrt(tokens * (nodes - 1))


def test_rows_per_hop_and_one_node_sends_nothing_between_nodes():
    cfg = SimpleNamespace(num_experts_per_token=4, expert_width=32, num_experts=16)
    ep = SimpleNamespace(size=4)
    one_node = node_layer_traffic(ep, cfg, tokens=10, activation=2, gpus_per_node=8)
    assert one_node["ep.internode"][0] == 0
    # inside the node: every slot's row and id forward, the outputs back, the adjoints of both
    assert one_node["ep.intranode"][0] == 10 * 4 * ((32 * 2 + 8 + 32 * 2) + 2 * 32 * 2)
    two_nodes = node_layer_traffic(ep, cfg, tokens=10, activation=2, gpus_per_node=2)
    rows = 10 * 1 * node_hit_probability(16, 4, 2)  # one remote node
    per_row = (32 * 2 + 2 * 4 * 8 + 4 * 4 + 32 * 4) + (32 * 2 + 4 * 4 + 32 * 4)
    assert two_nodes["ep.internode"][0] == pytest.approx(rows * per_row)
    assert two_nodes["ep.intranode"] == one_node["ep.intranode"]


def _k3_plan(transport: str):
    from k3train.config import load_config
    from k3train.parallel.pipeline_schedule import PipelinePlan
    from k3train.parallel.state import layout_of
    from k3train.planning.search import analytic_step_bytes
    from k3train.planning.time import group_link

    config = load_config("recipes/k3.yaml", [f"parallel.ep_transport={transport}"])
    layout = layout_of(1024, config.parallel, config.model)
    comm = analytic_step_bytes(config, layout, PipelinePlan.from_config(config.model, config.parallel))
    return comm, {group: group_link(layout, group, 8) for group in comm}


def test_k3_splits_sends_each_slot_once_and_nodes_keeps_its_forwards_on_nvlink():
    relay, _ = _k3_plan("relay")
    splits, _ = _k3_plan("splits")
    nodes, links = _k3_plan("nodes")
    # splits: the s·k rows that exist (relay's fixed buffers hold 1.25× as many); before, the
    # padded [R, s·k] shapes priced it 64× over at ep 64
    assert splits["ep"] < relay["ep"] < 1.3 * splits["ep"]
    assert links["ep"] == "network" and links["ep.intranode"] == "nvlink"
    # between nodes: a row per (token, remote node), fewer than splits' rows per slot
    assert nodes["ep"] < splits["ep"]


def test_chunked_overlap_replays_the_nodes_forwards_with_the_network_hops():
    from k3train.config import load_config
    from k3train.parallel.pipeline_schedule import PipelinePlan
    from k3train.parallel.state import layout_of
    from k3train.planning.hardware import load_profile
    from k3train.planning.search import analytic_step_bytes
    from k3train.planning.time import estimate_step_time

    config = load_config("recipes/k3.yaml", ["parallel.ep_transport=nodes"])
    layout = layout_of(1024, config.parallel, config.model)
    plan = PipelinePlan.from_config(config.model, config.parallel)
    comm = analytic_step_bytes(config, layout, plan)
    hardware = load_profile("h200")

    def step(comm_bytes, chunks):
        return estimate_step_time(
            config.model,
            layout,
            plan,
            hardware,
            micro_batch_size=1,
            seq_length=config.data.seq_length,
            micro_batches=config.train.micro_batches_per_rank(layout.data_parallel),
            precision="bf16",
            comm_bytes=comm_bytes,
            ep_overlap_chunks=chunks,
        ).exposed_comm_s

    plain = step(comm, 0)  # nothing overlapped: each hop exposed on its own link
    assert plain["ep.intranode"] == comm["ep.intranode"] / (hardware.nvlink_gbps * 1e9)
    chunked = step(comm, 4)
    without_forwards = step({**comm, "ep.intranode": 0.0}, 4)
    assert chunked["ep.intranode"] == 0.0  # inside the chunks' replay, under "ep"
    assert without_forwards["ep"] <= chunked["ep"] < plain["ep"] + plain["ep.intranode"]
