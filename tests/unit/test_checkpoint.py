"""Checkpointer (k3train.checkpoint): bit-exact round trips, atomic saves, pruning, resume
resolution, clear errors, RNG state, graceful exit, and a 2-process gloo save/load."""

from __future__ import annotations

import datetime
import os
import random
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import k3train.checkpoint.checkpointer as ckpt_mod
import k3train.checkpoint.writing as writing_mod
from k3train.checkpoint import (
    MANIFEST,
    Checkpointer,
    CheckpointError,
    PerRank,
    RNGState,
    capture_rng_state,
    is_complete,
    read_manifest,
    restore_rng_state,
)
from k3train.checkpoint.safe_metadata import read_metadata_safely
from k3train.job.signals import GracefulExit


class Net(nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(4, hidden)
        self.out = nn.Linear(hidden, 3)
        self.register_buffer("qb_bias", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x))) + self.qb_bias


def make_adamw(model: nn.Module) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups: list[dict[str, Any]] = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 123) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 4, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.get_buffer("qb_bias").add_(0.01)  # a buffer that changes during training (like QB biases)


def assert_same_tree(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(a), sorted(b))
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def small_state(seed: int = 0, steps: int = 3):
    torch.manual_seed(seed)
    model = Net()
    opt = make_adamw(model)
    if steps:
        train(model, opt, steps)
    return model, opt


# ---------------------------------------------------------------------------------------------


def test_round_trip_bit_exact(tmp_path):
    model, opt = small_state()
    extra = {
        "step": 3,
        "schedule": {"last_step": 3, "lrs": [0.1, 0.2]},
        "position": torch.arange(7),
        "nested": {"a": {"b": 1.5, "name": "x"}},
        "betas": (0.9, 0.95),
    }
    ck = Checkpointer(tmp_path / "ckpt")
    path = ck.save(3, {"model": model, "optimizer": opt, "extra": extra})
    assert path == tmp_path / "ckpt" / "step_00000003" and is_complete(path)
    manifest = read_manifest(path)
    assert manifest["complete"] is True and manifest["step"] == 3 and manifest["world_size"] == 1
    assert manifest["torch_version"] == torch.__version__

    model2, opt2 = small_state(seed=1, steps=0)  # different init, lazily initialised optimizer
    extra2: dict = {}
    ck.load(path, {"model": model2, "optimizer": opt2, "extra": extra2})
    assert_same_tree(model.state_dict(), model2.state_dict(), "model")
    assert_same_tree(opt.state_dict(), opt2.state_dict(), "optimizer")
    assert_same_tree(extra, extra2, "extra")
    assert isinstance(extra2["betas"], tuple)

    train(model, opt, 2, seed=7)
    train(model2, opt2, 2, seed=7)
    for (n, p), (_, q) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(p, q), n


def test_load_is_in_place_and_handles_custom_optimizer(tmp_path):
    class SignMomentum(torch.optim.Optimizer):
        """A custom optimizer with tensor and non-tensor state."""

        def __init__(self, params, lr=0.1, beta=0.9):
            super().__init__(params, dict(lr=lr, beta=beta))

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    if not st:
                        st["buf"] = torch.zeros_like(p)
                        st["count"] = 0
                        st["history"] = {"last_norm": 0.0}
                    st["buf"].mul_(group["beta"]).add_(p.grad)
                    st["count"] += 1
                    st["history"]["last_norm"] = float(p.grad.norm())
                    p.add_(st["buf"].sign(), alpha=-group["lr"])

    torch.manual_seed(0)
    model = Net()
    opt = SignMomentum(model.parameters())
    train(model, opt, 3)
    position = torch.tensor([5, 6])
    extra = {"position": position, "epoch": 2, "by_index": {0: torch.ones(2), 1: 5}}
    buffers = [torch.full((2,), 3.0), torch.arange(3)]
    ck = Checkpointer(tmp_path)
    path = ck.save(1, {"model": model, "opt": opt, "extra": extra, "buffers": buffers})

    torch.manual_seed(1)
    model2 = Net()
    weight = model2.inp.weight
    opt2 = SignMomentum(model2.parameters())
    position2 = torch.zeros(2, dtype=torch.long)
    extra2 = {"position": position2, "epoch": 0, "empty": {}, "by_index": {0: torch.zeros(2), 1: 0}}
    buffers2 = [torch.zeros(2), torch.zeros(3, dtype=torch.long)]
    state2 = {"model": model2, "opt": opt2, "extra": extra2, "buffers": buffers2}
    ck.load(path, state2)
    assert state2["extra"] is extra2 and extra2["position"] is position2  # in place
    assert sorted(extra2) == ["by_index", "empty", "epoch", "position"]
    assert extra2["epoch"] == 2 and extra2["empty"] == {} and torch.equal(position2, position)
    assert set(extra2["by_index"]) == {0, 1} and extra2["by_index"][1] == 5  # int keys kept
    assert torch.equal(extra2["by_index"][0], torch.ones(2))
    assert state2["buffers"] is buffers2 and all(torch.equal(a, b) for a, b in zip(buffers, buffers2))
    assert model2.inp.weight is weight and torch.equal(weight, model.inp.weight)
    assert_same_tree(opt.state_dict(), opt2.state_dict(), "optimizer")
    train(model, opt, 1, seed=9)
    train(model2, opt2, 1, seed=9)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))


def test_crash_during_save_keeps_latest(tmp_path, monkeypatch):
    model, opt = small_state()
    ck = Checkpointer(tmp_path, keep_last=0)
    first = ck.save(1, {"model": model, "optimizer": opt})

    class CrashingWriter(writing_mod.ChecksummingWriter):
        def finish(self, metadata, results):  # data files written, .metadata not yet
            raise RuntimeError("simulated crash")

    monkeypatch.setattr(writing_mod, "ChecksummingWriter", CrashingWriter)
    with pytest.raises(CheckpointError, match="simulated crash"):
        ck.save(2, {"model": model, "optimizer": opt})
    monkeypatch.undo()
    assert ck.latest() == first
    assert not (tmp_path / "step_00000002").exists()

    # The remains of hard crashes: a temp dir, and a final-named dir without metadata/manifest.
    stale = tmp_path / ".tmp_step_00000003_deadbeef"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"partial")
    broken = tmp_path / "step_00000004"
    broken.mkdir()
    (broken / "__0_0.distcp").write_bytes(b"partial")
    assert ck.latest() == first

    ck2 = Checkpointer(tmp_path, keep_last=0)  # start-up cleans temp dirs
    assert not stale.exists()
    assert ck2.latest() == first

    # Saving over an existing (incomplete) final directory replaces it safely.
    path = ck2.save(4, {"model": model, "optimizer": opt})
    assert path == broken and is_complete(path) and ck2.latest() == path
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_old_dir_restored_at_startup(tmp_path):
    model, _ = small_state(steps=0)
    ck = Checkpointer(tmp_path, keep_last=0)
    path = ck.save(5, {"model": model})
    # Crash between moving the old step_5 aside and renaming its replacement into place.
    aside = tmp_path / ".old_step_00000005_0123abcd"
    os.replace(path, aside)
    assert ck.latest() is None
    ck2 = Checkpointer(tmp_path)
    assert ck2.latest() == path and not aside.exists()


def test_keep_last_pruning(tmp_path):
    model, _ = small_state(steps=0)
    ck = Checkpointer(tmp_path / "a", keep_last=2)
    for step in (1, 2, 3, 4):
        ck.save(step, {"model": model})
    assert [s for s, _ in ck.checkpoints()] == [3, 4]
    ck_all = Checkpointer(tmp_path / "b", keep_last=0)
    for step in (1, 2, 3):
        ck_all.save(step, {"model": model})
    assert [s for s, _ in ck_all.checkpoints()] == [1, 2, 3]


def test_resolve_resume(tmp_path):
    model, _ = small_state(steps=0)
    ck = Checkpointer(tmp_path / "run")
    assert ck.resolve_resume("auto") is None
    assert ck.resolve_resume("none") is None and ck.resolve_resume(None) is None
    p1 = ck.save(1, {"model": model})
    p2 = ck.save(2, {"model": model})
    assert ck.resolve_resume("auto") == p2
    assert ck.resolve_resume(str(p1)) == p1
    assert ck.resolve_resume("step_00000001") == p1  # relative to the checkpoint directory
    with pytest.raises(CheckpointError, match="does not exist"):
        ck.resolve_resume(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="step_00000002"):
        ck.resolve_resume(str(tmp_path / "run"))  # a root, not a checkpoint: points at the newest
    (p1 / ".metadata").unlink()
    with pytest.raises(CheckpointError) as err:
        ck.resolve_resume(str(p1))
    assert str(p1) in str(err.value) and "checkpoint.resume=" in str(err.value)
    assert ck.resolve_resume("auto") == p2


def test_incomplete_and_truncated_checkpoints(tmp_path):
    model, opt = small_state()
    ck = Checkpointer(tmp_path, keep_last=0)
    state = {"model": model, "optimizer": opt}
    paths = [ck.save(step, state) for step in (1, 2, 3, 4)]

    (paths[0] / ".metadata").unlink()
    with pytest.raises(CheckpointError) as err:
        ck.load(paths[0], state)
    msg = str(err.value)
    assert str(paths[0]) in msg and "incomplete" in msg and "checkpoint.resume=" in msg

    (paths[1] / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        ck.load(paths[1], state)
    assert ck.latest() == paths[3]

    data = sorted(paths[2].glob("*.distcp"))
    assert data
    data[0].unlink()
    with pytest.raises(CheckpointError, match="missing"):
        ck.load(paths[2], state)

    data = sorted(paths[3].glob("*.distcp"))[0]
    blob = data.read_bytes()
    data.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError) as err:
        ck.load(paths[3], state)
    assert "truncated" in str(err.value) and str(paths[3]) in str(err.value)

    with pytest.raises(CheckpointError, match="does not exist"):
        ck.load(tmp_path / "step_00000099", state)


def test_mismatch_names_keys(tmp_path):
    model, opt = small_state()
    ck = Checkpointer(tmp_path)
    path = ck.save(1, {"model": model, "optimizer": opt})

    wider = Net(hidden=16)
    with pytest.raises(CheckpointError) as err:
        ck.load(path, {"model": wider, "optimizer": make_adamw(wider)})
    msg = str(err.value)
    assert "shape mismatch" in msg and "inp.weight" in msg and "(8, 4) vs (16, 4)" in msg

    class Bigger(Net):
        def __init__(self):
            super().__init__()
            self.extra = nn.Linear(3, 3)

    bigger = Bigger()
    with pytest.raises(CheckpointError) as err:
        ck.load(path, {"model": bigger})
    assert "missing in the checkpoint" in str(err.value) and "extra.weight" in str(err.value)

    with pytest.raises(CheckpointError, match="missing in the checkpoint"):
        ck.load(path, {"model": model, "optimizer": opt, "sampler": {"position": 3}})


def test_rng_capture_restore(tmp_path):
    def draw():
        return (torch.rand(4), random.random(), np.random.rand(3))

    state = capture_rng_state()
    a = draw()
    restore_rng_state(state)
    b = draw()
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and np.array_equal(a[2], b[2])

    # Through a checkpoint, keyed by rank.
    ck = Checkpointer(tmp_path)
    torch.manual_seed(42)
    path = ck.save(1, {"rng": RNGState()})
    expected = draw()
    draw()
    ck.load(path, {"rng": RNGState()})
    got = draw()
    assert torch.equal(expected[0], got[0]) and expected[1] == got[1] and np.array_equal(expected[2], got[2])
    assert "rng.rank_0.torch" in read_metadata_safely(path).state_dict_metadata


def test_per_rank_missing_rank_warns(tmp_path):
    ck = Checkpointer(tmp_path)
    path = ck.save(1, {"loader": {"position": 0}})  # saved without PerRank
    holder = {"position": 5}
    with pytest.warns(UserWarning, match="rank_0"):
        ck.load(path, {"loader": PerRank(holder)})
    assert holder == {"position": 5}


def test_graceful_exit():
    previous = signal.getsignal(signal.SIGTERM)
    with GracefulExit() as stop:
        assert not stop.should_stop
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 2
        while not stop.should_stop and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.should_stop and stop.received == signal.SIGTERM and stop.requested()
    assert signal.getsignal(signal.SIGTERM) is previous
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    with pytest.raises(KeyboardInterrupt):
        with GracefulExit() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            assert stop.should_stop
            os.kill(os.getpid(), signal.SIGINT)  # second Ctrl-C: stop for real
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# --------------------------------------------------------------------------------------------
# Two processes, gloo


def _gloo_worker(rank: int, world: int, root: str, init_file: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        model, opt = small_state()  # replicated (same seed, same data on both ranks)
        shard = {"x": torch.full((3,), float(rank + 1)), "rank": rank}
        meta = {"step": 5, "tokens": 1000}
        ck = Checkpointer(root, keep_last=2)
        torch.manual_seed(100 + rank)
        path = ck.save(5, {"model": model, "optimizer": opt, "shard": PerRank(shard), "rng": RNGState(), "meta": meta})
        expected_rand = torch.rand(3)

        model2, opt2 = small_state(seed=9, steps=0)
        shard2 = {"x": torch.zeros(3), "rank": -1}
        meta2: dict = {}
        ck.load(path, {"model": model2, "optimizer": opt2, "shard": PerRank(shard2), "rng": RNGState(), "meta": meta2})
        assert_same_tree(model.state_dict(), model2.state_dict(), "model")
        assert_same_tree(opt.state_dict(), opt2.state_dict(), "optimizer")
        assert_same_tree(shard, shard2, "shard")
        assert meta2 == meta
        assert torch.equal(torch.rand(3), expected_rand)
        assert ck.latest() == path
        # One rank cannot load (another model shape): every rank gets the error, none hangs.
        wrong = Net(hidden=16) if rank == 1 else Net()
        with pytest.raises(CheckpointError, match="inp.weight"):
            ck.load(path, {"model": wrong})
        Path(out, f"ok_{rank}").write_text("ok")
        dist.barrier()
    except BaseException:
        Path(out, f"error_{rank}").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_two_process_gloo_save_load(tmp_path):
    import torch.multiprocessing as mp

    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    ctx = mp.start_processes(
        _gloo_worker,
        args=(2, str(root), str(tmp_path / "init"), str(out)),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 90
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail("2-process checkpoint test timed out")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    errors = {p.name: p.read_text() for p in out.glob("error_*")}
    assert not errors, errors
    assert sorted(p.name for p in out.iterdir()) == ["ok_0", "ok_1"]

    # The 2-rank checkpoint loads into a single process (a different layout).
    path = root / "step_00000005"
    assert read_manifest(path)["world_size"] == 2
    model, opt = small_state()
    model2, opt2 = small_state(seed=9, steps=0)
    shard = {"x": torch.zeros(3), "rank": -1}
    Checkpointer(root).load(path, {"model": model2, "optimizer": opt2, "shard": PerRank(shard), "meta": {}})
    assert_same_tree(model.state_dict(), model2.state_dict(), "model")
    assert_same_tree(opt.state_dict(), opt2.state_dict(), "optimizer")
    assert shard["rank"] == 0 and torch.equal(shard["x"], torch.ones(3))


# ---------------------------------------------------------------------------- module boundaries


def test_checkpoint_modules_use_only_public_names_of_their_siblings():
    """No `from k3train.checkpoint.x import _name` and no `x._name` on a sibling module."""
    import ast

    package = Path(ckpt_mod.__file__).parent
    siblings = {p.stem for p in package.glob("*.py")}
    offences = []
    for file in sorted(package.glob("*.py")):
        tree = ast.parse(file.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("k3train.checkpoint"):
                offences += [f"{file.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in siblings
            ):
                offences.append(f"{file.name}: {node.value.id}.{node.attr}")
    assert not offences


def test_listing_names_and_process_group_helpers_without_a_group(tmp_path):
    from k3train.checkpoint.manifest import complete_checkpoints, replaced_step_name, step_of
    from k3train.checkpoint.process_group import broadcast_from_first, first_error, group_rank, group_size

    assert step_of("step_00000010") == 10 and step_of("step_123456789") == 123456789
    assert step_of(".tmp_step_00000010_ab") is None and step_of("step_x") is None
    assert replaced_step_name(".old_step_00000010_0a1b") == "step_00000010"
    assert replaced_step_name(".tmp_step_00000010_0a1b") is None
    model, opt = small_state()
    checkpointer = Checkpointer(tmp_path, keep_last=0)
    for step in (20, 3):
        checkpointer.save(step, {"model": model})
    (tmp_path / "step_00000007").mkdir()  # incomplete: not listed
    assert complete_checkpoints(tmp_path) == [(3, tmp_path / "step_00000003"), (20, tmp_path / "step_00000020")]
    assert complete_checkpoints(tmp_path / "absent") == []
    assert (group_rank(), group_size()) == (0, 1)
    assert broadcast_from_first("x") == "x" and first_error(None) is None and first_error("bad") == "bad"
