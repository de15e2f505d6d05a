"""A checkpoint received from someone else runs no code, through any loader we call (issue 41).

Every planted payload here is a pickled ``os.system`` call that would create a marker file; each
test checks the marker is absent, the refusal is one line naming the file and what was refused
(exit 2 from the CLI, ``UntrustedCheckpointError`` from the library), and the run directory is
unchanged. Ways in: ``fp8state train --resume`` (its plan reads every file first), and the
library loaders (``check_checkpoint``, which the DeepSpeed and FSDP2 strategies call, and
``safe_dcp_load``, every FSDP2 load of ours). The earlier kinds (a Lightning file, a DeepSpeed
shard, FSDP2's ``meta.pt`` and ``.metadata``) are in ``test_faults.py``.
"""

from __future__ import annotations

import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state.state import checkpoint_files
from tests.cli.test_faults import PlantedCall, _plant, assert_one_clean_error, snapshot, train


def _dcp_with_item(last: Path, marker: Path, saved: dict) -> None:
    """A DCP checkpoint whose optimizer param group holds the planted call: DCP stores a
    non-tensor value as a bytes item in the ``.distcp`` shard and unpickles it at load."""
    import torch.distributed.checkpoint as dcp

    state = {
        "state_dict": saved.pop("state_dict"),
        "optimizer_0": {"param_groups": [{"lr": 0.1, "x": PlantedCall(marker)}]},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(last))
    torch.save(saved, last / "meta.pt")


def _plant_new(run: Path, kind: str, marker: Path) -> tuple[Path, str]:
    """Plant ``kind`` in ``run``; return the path the refusal must name and what it refuses."""
    ckpts = run / "checkpoints"
    last = ckpts / "last.ckpt"
    if kind == "plain_pickle":  # protocol 4: torch's safe loader cannot parse it ("Unsupported operand")
        last.write_bytes(pickle.dumps({"global_step": 99, "x": PlantedCall(marker)}, protocol=4))
        return last, "posix.system"
    if kind.startswith("fsdp"):
        saved = torch.load(last, weights_only=True)
        _plant(run, "fsdp_meta", marker)  # the run becomes an FSDP2 one; its files are replaced below
        shutil.rmtree(last)
        _dcp_with_item(last, marker, saved)
        if kind == "fsdp_item":
            return next(last.glob("*.distcp")), "posix.system"
        # the bytes item's storage path leads to a file beside the checkpoint
        import torch.distributed.checkpoint.metadata as md

        meta = pickle.loads((last / ".metadata").read_bytes())
        planted = ckpts / "planted.distcp"
        blob = next(last.glob("*.distcp")).read_bytes()
        planted.write_bytes(blob)
        for index, info in meta.storage_data.items():
            if isinstance(meta.state_dict_metadata[index.fqn], md.BytesStorageMetadata):
                info.relative_path = "../planted.distcp"
        (last / ".metadata").write_bytes(pickle.dumps(meta))
        return last / ".metadata", "'../planted.distcp' outside the checkpoint folder"
    # DeepSpeed: a clean shard in last.ckpt/checkpoint, the planted one where `latest` leads
    _plant(run, "deepspeed", marker)
    good = torch.load(run.parent / "good_model_states.pt", weights_only=False)
    torch.save(good, last / "checkpoint" / "mp_rank_00_model_states.pt")
    outside = run.parent / "outside"
    outside.mkdir(exist_ok=True)
    torch.save({**good, "x": PlantedCall(marker)}, outside / "mp_rank_00_model_states.pt")
    if kind == "deepspeed_latest":
        (last / "latest").write_text("../../../outside")
        return last / "latest", "not one folder name inside the checkpoint"
    shutil.rmtree(last / "checkpoint")
    (last / "checkpoint").symlink_to(outside, target_is_directory=True)
    (last / "latest").write_text("checkpoint")
    return last / "checkpoint", "a symbolic link"


KINDS = ["plain_pickle", "fsdp_item", "fsdp_path", "deepspeed_latest", "deepspeed_link"]


@pytest.fixture
def planted_run(finished_run):
    """finished_run, with a clean DeepSpeed client-state shard kept beside it for the DeepSpeed kinds."""
    saved = torch.load(finished_run / "checkpoints" / "last.ckpt", weights_only=True)
    model = {**saved, "module": saved.pop("state_dict"), "ds_version": "0.19"}
    torch.save(model, finished_run.parent / "good_model_states.pt")
    return finished_run


@pytest.mark.parametrize("kind", KINDS)
def test_a_received_checkpoint_is_refused_by_the_resume_before_anything_reads_it(
    planted_run, capsys, monkeypatch, kind
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a GPU strategy's resume: refused after the plan
    marker = planted_run.parent / "MARKER"
    named, refused = _plant_new(planted_run, kind, marker)
    before = snapshot(planted_run)
    capsys.readouterr()
    assert train("--resume", str(planted_run), "trainer.max_steps=30") == 2
    assert not marker.exists(), "the planted call ran"
    assert_one_clean_error(capsys.readouterr().err, str(named), "refused to load", refused)
    assert snapshot(planted_run) == before


@pytest.mark.parametrize("kind", KINDS[1:])
def test_the_library_checks_refuse_them_too(planted_run, kind):
    """check_checkpoint: what Fp8StateDeepSpeedStrategy and Fp8StateFSDPStrategy call before their loaders."""
    marker = planted_run.parent / "MARKER"
    named, refused = _plant_new(planted_run, kind, marker)
    with pytest.raises(f8s.UntrustedCheckpointError, match=refused.replace("(", r"\(").replace(")", r"\)")) as info:
        checkpoint_files.check_checkpoint(planted_run / "checkpoints" / "last.ckpt")
    assert str(named) in str(info.value)
    assert not marker.exists()


def test_an_fsdp2_bytes_item_runs_under_torchs_default_load_and_not_under_ours(tmp_path):
    """The payload is live: DCP's own load (``weights_only=False`` for bytes items) runs it; our
    planner, which every FSDP2 load of ours uses, refuses it, with and without the file check."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "MARKER"
    last = tmp_path / "ckpt"
    _dcp_with_item(last, marker, {"state_dict": {"w": torch.randn(3)}, "global_step": 1})

    def fresh():
        return {"state_dict": {"w": torch.zeros(3)}, "optimizer_0": {"param_groups": [{"lr": 0.0, "x": None}]}}

    with pytest.raises(f8s.UntrustedCheckpointError, match="posix.system"):
        checkpoint_files.safe_dcp_load(fresh(), last)
    with pytest.raises(dcp.api.CheckpointException, match="UntrustedCheckpointError.*posix.system"):  # DCP wraps it
        dcp.load(
            fresh(),
            storage_reader=dcp.FileSystemReader(str(last)),
            planner=checkpoint_files.SafeLoadPlanner(),
            no_dist=True,
        )
    assert not marker.exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(fresh(), checkpoint_id=str(last), no_dist=True)
    assert marker.exists(), "torch's default planner unpickles the item (what the planner above prevents)"


def test_a_clean_fsdp2_checkpoint_with_bytes_items_still_loads(tmp_path):
    import torch.distributed.checkpoint as dcp

    saved = {"state_dict": {"w": torch.randn(3)}, "optimizer_0": {"param_groups": [{"lr": 0.25, "betas": (0.9, 0.95)}]}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(saved, checkpoint_id=str(tmp_path))
        loaded = {"state_dict": {"w": torch.zeros(3)}, "optimizer_0": {"param_groups": [{"lr": 0.0, "betas": None}]}}
        checkpoint_files.safe_dcp_load(loaded, tmp_path)
    assert torch.equal(loaded["state_dict"]["w"], saved["state_dict"]["w"])
    assert loaded["optimizer_0"]["param_groups"] == [{"lr": 0.25, "betas": (0.9, 0.95)}]
