"""Every value a checkpoint holds is checked before use: the manifest by its format version, the
sizes `.metadata` declares before anything is allocated, JSON nesting, RNG state structure and
progress counters. Each crafted file ends in one CheckpointError line, never a traceback."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from k3train.checkpoint import Checkpointer, CheckpointError, PerRank, RNGState, verify_checkpoint, write_manifest
from k3train.checkpoint.integrity import checksum_files
from k3train.checkpoint.safe_metadata import read_metadata_safely
from k3train.checkpoint.values import MAGIC, decode_value
from k3train.checkpoint.verify import checkpoint_problems
from k3train.training.loop import Progress


def _reseal(path: Path, **changes) -> None:
    """Rewrite the manifest with fresh checksums and `changes` (what a careful forger does)."""
    manifest = json.loads((path / "k3train.json").read_text())
    files = checksum_files(path, sorted(manifest["files"]))
    extra = {k: v for k, v in manifest.items() if k not in ("step", "world_size", "complete", "files")}
    extra.update(files=files)
    extra.update(changes)
    write_manifest(path, manifest["step"], **extra)


def test_a_version_2_manifest_without_checksums_is_damage_not_an_old_format(tmp_path):
    model = nn.Linear(3, 2)
    ck = Checkpointer(tmp_path)
    older, newest = ck.save(1, {"model": model}), ck.save(2, {"model": model})
    manifest = json.loads((newest / "k3train.json").read_text())
    del manifest["files"]
    (newest / "k3train.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="format version 2.*lost its list of file checksums"):
        verify_checkpoint(newest)
    assert [p.reason for p in checkpoint_problems(newest).problems] == ["manifest"]  # verify_checkpoint.py: not ok
    assert ck.resolve_resume("auto") == older
    assert (tmp_path / "step_00000002.damaged-manifest").is_dir()


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("version", None, "no valid format version"),
        ("version", 99, "newer than this k3train reads"),
        ("step", -5, "step -5"),
        ("format", "other", "format 'other'"),
    ],
)
def test_manifest_fields_are_checked(tmp_path, field, value, says):
    path = Checkpointer(tmp_path).save(3, {"model": nn.Linear(3, 2)})
    manifest = json.loads((path / "k3train.json").read_text())
    manifest[field] = value
    (path / "k3train.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=says):
        verify_checkpoint(path)


def test_a_deeply_nested_manifest_is_unreadable_not_a_recursion_error(tmp_path):
    path = Checkpointer(tmp_path).save(3, {"model": nn.Linear(3, 2)})
    (path / "k3train.json").write_text('{"complete": true, "x": ' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(CheckpointError, match="incomplete"):
        verify_checkpoint(path)


def test_deeply_nested_json_values_are_refused():
    with pytest.raises(CheckpointError, match="nested deeper"):
        decode_value(MAGIC + b"[" * 200_000 + b"]" * 200_000, "checkpoint value x")


def test_metadata_declaring_a_huge_tensor_is_refused_before_allocation(tmp_path):
    path = Checkpointer(tmp_path).save(3, {"model": nn.Linear(3, 2)})
    metadata = read_metadata_safely(path)
    md = metadata.state_dict_metadata["model.weight"]
    md.size = torch.Size([2**20, 2**20])
    md.chunks[0].sizes = torch.Size([2**20, 2**20])
    buffer = io.BytesIO()
    pickle.dump(metadata, buffer)
    (path / ".metadata").write_bytes(buffer.getvalue())
    _reseal(path)
    with pytest.raises(CheckpointError, match=r"model.weight chunk \[1048576, 1048576\].*stored in"):
        verify_checkpoint(path)


def test_garbage_rng_state_is_one_line_and_sets_nothing(tmp_path):
    path = Checkpointer(tmp_path).save(3, {"rng": PerRank({"torch": "garbage", "python": [1, 2]})})
    before = torch.get_rng_state()
    with pytest.raises(CheckpointError, match="saved 'rng' state is not valid.*not an RNG state"):
        Checkpointer(tmp_path).load(path, {"rng": RNGState()})
    assert torch.equal(torch.get_rng_state(), before)


def test_a_negative_progress_step_is_refused(tmp_path):
    path = Checkpointer(tmp_path).save(3, {"progress": {"step": -5, "consecutive_nonfinite": 0, "skipped_steps": 0}})
    with pytest.raises(CheckpointError, match=r"'progress' state is not valid.*progress.step .*got -5"):
        Checkpointer(tmp_path).load(path, {"progress": Progress()})


def test_resume_path_to_a_checkpoint_moved_aside_at_start_up_names_where_it_is(tmp_path):
    model = nn.Linear(3, 2)
    broken = Checkpointer(tmp_path).save(2, {"model": model})
    (broken / ".metadata").unlink()
    ck = Checkpointer(tmp_path)  # start-up moves the incomplete checkpoint aside
    with pytest.raises(CheckpointError, match=r"was unusable and is kept as .*step_00000002\.damaged-incomplete"):
        ck.resolve_resume(str(broken))


@pytest.mark.parametrize("name", [".metadata", "k3train.json"])
def test_a_checkpoint_file_linked_out_of_the_checkpoint_is_refused(tmp_path, name):
    path = Checkpointer(tmp_path / "checkpoints").save(3, {"model": nn.Linear(3, 2)})
    outside = tmp_path / f"outside{name}"
    (path / name).rename(outside)
    (path / name).symlink_to(outside)
    verdict = checkpoint_problems(path)
    assert [p.reason for p in verdict.problems] == ["outside"], verdict.problems
    assert f"{name} leads outside the checkpoint" in verdict.problems[0].message


def test_a_step_directory_linked_out_of_the_checkpoint_directory_is_refused(tmp_path):
    elsewhere = Checkpointer(tmp_path / "elsewhere").save(3, {"model": nn.Linear(3, 2)})
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / elsewhere.name).symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match=f"is a link to {elsewhere}, outside {root}"):
        verify_checkpoint(root / elsewhere.name)
    with pytest.raises(CheckpointError, match=r"no usable checkpoint.*step_00000003 \(outside\)"):
        Checkpointer(root).resolve_resume("auto")
    assert (elsewhere / "k3train.json").is_file()  # only the link was moved aside


def test_an_oversized_metadata_file_is_refused_before_it_is_read(tmp_path, monkeypatch):
    import k3train.checkpoint.safe_metadata as safe_metadata

    path = Checkpointer(tmp_path).save(3, {"model": nn.Linear(3, 2)})
    monkeypatch.setattr(safe_metadata, "METADATA_MAX_BYTES", 64)
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"{self} was read"))
    with pytest.raises(CheckpointError, match=r"has a \.metadata of [\d,]+ bytes, more than the 64"):
        read_metadata_safely(path)
