"""Checksums (recorded per file, verified on load and by tools/verify_checkpoint.py), damaged and
incomplete checkpoints moved aside instead of being skipped or overwritten, and asynchronous saves."""

from __future__ import annotations

import datetime
import importlib.util
import json
import logging
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
from torch import nn

from k3train.checkpoint import Checkpointer, CheckpointError, PerRank, read_manifest, verify_checkpoint
from k3train.checkpoint.manifest import damaged_checkpoints

CHECKOUT = Path(__file__).resolve().parents[2]


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"_tool_int_{name}", CHECKOUT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _state(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(5, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _flip_bytes(path: Path, count: int = 16) -> Path:
    shard = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + count):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


def test_manifest_lists_every_file_with_its_checksum(tmp_path):
    model, opt = _state()
    path = Checkpointer(tmp_path).save(2, {"model": model, "optimizer": opt, "progress": {"step": 2}})
    manifest = read_manifest(path)
    on_disk = sorted(p.name for p in path.iterdir() if p.name != "k3train.json")
    assert manifest["checksum"] == "crc32" and sorted(manifest["files"]) == on_disk
    for name, entry in manifest["files"].items():
        assert entry["size"] == (path / name).stat().st_size and len(entry["crc32"]) == 8


def test_flipped_bytes_are_found_on_load_and_by_the_tool(tmp_path, capsys):
    model, opt = _state()
    ck = Checkpointer(tmp_path)
    path = ck.save(2, {"model": model, "optimizer": opt})
    verify = _load_tool("verify_checkpoint")
    assert verify.main([str(path)]) == 0
    assert capsys.readouterr().out.startswith("ok: ")
    shard = _flip_bytes(path)

    model2, opt2 = _state(seed=1)
    with pytest.raises(CheckpointError, match=f"{shard.name} is damaged") as info:
        ck.load(path, {"model": model2, "optimizer": opt2})
    assert "\n" not in str(info.value)
    assert verify.main([str(tmp_path)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("checksum: ") and shard.name in lines[0]
    assert verify.main([str(tmp_path / "nothing")]) == 2


def test_resume_auto_moves_a_damaged_newest_aside_and_falls_back(tmp_path, caplog):
    model, opt = _state()
    ck = Checkpointer(tmp_path, keep_last=2)
    first = ck.save(1, {"model": model, "optimizer": opt})
    second = ck.save(2, {"model": model, "optimizer": opt})
    _flip_bytes(second)
    with caplog.at_level(logging.WARNING):
        chosen = ck.resolve_resume("auto")
    assert chosen == first
    aside = tmp_path / "step_00000002.damaged-checksum"
    assert aside.is_dir() and not second.exists()
    assert any(
        "step_00000002" in r.message and "damaged" in r.message and "moved aside" in r.message for r in caplog.records
    )
    model2, opt2 = _state(seed=3)
    ck.load(chosen, {"model": model2, "optimizer": opt2})
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    # Later saves neither count nor delete nor overwrite the damaged one.
    for step in (2, 3, 4):
        ck.save(step, {"model": model})
    assert [p.name for _, p in ck.checkpoints()] == ["step_00000003", "step_00000004"]
    assert damaged_checkpoints(tmp_path) == [aside]


def test_incomplete_checkpoint_is_moved_aside_with_a_message(tmp_path, caplog):
    model, _ = _state()
    ck = Checkpointer(tmp_path)
    good = ck.save(1, {"model": model})
    broken = ck.save(2, {"model": model})
    (broken / ".metadata").unlink()
    with caplog.at_level(logging.WARNING):
        ck2 = Checkpointer(tmp_path)
    assert any("step_00000002" in r.message and "incomplete" in r.message for r in caplog.records)
    assert (tmp_path / "step_00000002.damaged-incomplete").is_dir()
    assert ck2.resolve_resume("auto") == good
    # Every checkpoint damaged: auto refuses to start fresh silently.
    manifest = json.loads((good / "k3train.json").read_text())
    manifest["files"][".metadata"]["crc32"] = "00000000"
    (good / "k3train.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="no usable checkpoint.*step_00000001 \\(checksum\\)"):
        ck2.resolve_resume("auto")


def test_async_save_stages_a_copy_and_round_trips(tmp_path):
    model, opt = _state()
    ck = Checkpointer(tmp_path, async_save=True)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    path = ck.save(2, {"model": model, "optimizer": opt, "progress": {"step": 2}})
    with torch.no_grad():  # training goes on while the copy is written
        for p in model.parameters():
            p.add_(1.0)
    assert ck.wait() == path and ck.wait() is None
    verify_checkpoint(path)
    model2, opt2 = _state(seed=5)
    progress: dict = {}
    ck.load(path, {"model": model2, "optimizer": opt2, "progress": progress})
    assert progress == {"step": 2}
    for name, value in model2.state_dict().items():
        assert torch.equal(value, expected[name]), name


def _async_gloo_worker(rank: int, world: int, root: str, init_file: str, out: str) -> None:
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
        model, opt = _state()
        ck = Checkpointer(root, keep_last=2, async_save=True)
        shard = {"x": torch.full((3,), float(rank + 1))}
        ck.save(1, {"model": model, "optimizer": opt, "shard": PerRank(shard)})
        for _ in range(3):  # training collectives on the default group while the save is written
            t = torch.ones(4)
            dist.all_reduce(t)
            assert torch.equal(t, torch.full((4,), float(world)))
        path = ck.save(2, {"model": model, "optimizer": opt, "shard": PerRank(shard)})
        assert ck.wait() == path
        model2, opt2 = _state(seed=9)
        shard2 = {"x": torch.zeros(3)}
        resume = ck.resolve_resume("auto")
        assert resume is not None
        ck.load(resume, {"model": model2, "optimizer": opt2, "shard": PerRank(shard2)})
        assert torch.equal(shard2["x"], shard["x"])
        for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
            assert torch.equal(a, b)
        Path(out, f"ok_{rank}").write_text("ok")
        dist.barrier()
    except BaseException:
        Path(out, f"error_{rank}").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_two_process_gloo_async_save(tmp_path):
    import torch.multiprocessing as mp

    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    ctx = mp.start_processes(
        _async_gloo_worker,
        args=(2, str(root), str(tmp_path / "init"), str(out)),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail("2-process async checkpoint test timed out")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    errors = {p.name: p.read_text() for p in out.glob("error_*")}
    assert not errors, errors
    assert read_manifest(root / "step_00000002")["world_size"] == 2
    assert len(read_manifest(root / "step_00000002")["files"]) >= 3  # both ranks' data files and .metadata
