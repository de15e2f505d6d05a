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

import io
import os
import pickle
import re
import shutil
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state.cli.rundir import RUN_CONFIG_KEY
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
    """check_checkpoint, and the strategy's load_checkpoint, which calls it before its loader."""
    from lightning_fp8state.lightning.fsdp import Fp8StateFSDPStrategy
    from lightning_fp8state.lightning.strategies import Fp8StateDeepSpeedStrategy

    marker = planted_run.parent / "MARKER"
    named, refused = _plant_new(planted_run, kind, marker)
    last = planted_run / "checkpoints" / "last.ckpt"
    strategy = Fp8StateDeepSpeedStrategy if kind.startswith("deepspeed") else Fp8StateFSDPStrategy
    for check in (lambda: checkpoint_files.check_checkpoint(last), lambda: strategy().load_checkpoint(last)):
        with pytest.raises(f8s.UntrustedCheckpointError, match=re.escape(refused)) as info:
            check()
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


# -- what the first checks let through ------------------------------------------------------
# A planted file that torch's safe loader cannot even parse (a text pickle, a newer protocol inside
# torch's zip or legacy format) was called "not readable" and the resume fell back past it; DCP
# unpickled a rank-local ``__0.metadata`` with plain pickle once the global ``.metadata`` failed
# (missing, or not DCP metadata); a DeepSpeed directory with a ``.metadata`` in it passed for a DCP
# one, and its ``latest`` went unchecked; ``latest_universal`` was never checked.
def _rank_local_metadata(last: Path, marker: Path, global_metadata: str) -> Path:
    """DCP's fallback: the global ``.metadata`` unreadable to DCP, a planted ``__0.metadata`` beside it."""
    planted = last / "__0.metadata"
    planted.write_bytes(pickle.dumps(PlantedCall(marker)))
    if global_metadata == "missing":
        (last / ".metadata").unlink()
    else:  # a plain dict: DCP's reader fails on it (no storage_meta) and reads the rank's file instead
        (last / ".metadata").write_bytes(pickle.dumps({}))
    return planted


def _torch_file_with_newer_pickle(path: Path, obj: object, legacy: bool) -> None:
    """A torch checkpoint whose pickle is protocol 4/5: torch's safe loader stops at its first
    FRAME opcode ('Unsupported operand 149') before it sees what the pickle calls."""
    if legacy:
        torch.save(obj, path, _use_new_zipfile_serialization=False, pickle_protocol=4)
        return
    buf = io.BytesIO()
    torch.save({"global_step": 1}, buf)
    buf.seek(0)
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            dst.writestr(item, pickle.dumps(obj, protocol=5) if item.filename.endswith("data.pkl") else data)


def _fsdp_run(run: Path, marker: Path) -> Path:
    """``run`` made an FSDP2 one with a clean DCP checkpoint as ``last.ckpt``; its ``meta.pt`` records
    no run configuration (as an earlier version's, or as a sender would leave it: the resume plan
    then gets as far as it can on this machine)."""
    last = run / "checkpoints" / "last.ckpt"
    saved = torch.load(last, weights_only=True)
    saved.pop(RUN_CONFIG_KEY, None)
    _plant(run, "fsdp_meta", marker)  # DCP shards of the run's weights and a planted meta.pt: replaced
    torch.save(saved, last / "meta.pt")
    return last


def _plant_missed(run: Path, kind: str, marker: Path) -> tuple[Path, str]:
    """Plant ``kind`` in ``run``; return the path the refusal must name and what it refuses."""
    last = run / "checkpoints" / "last.ckpt"
    payload = {"global_step": 99, "x": PlantedCall(marker)}
    if kind == "text_pickle":  # protocol 0: torch's safe loader stops at its first opcode
        last.write_bytes(pickle.dumps(payload, protocol=0))
        return last, "posix.system"
    if kind in ("zip_protocol5", "legacy_protocol4"):
        _torch_file_with_newer_pickle(last, payload, legacy=kind == "legacy_protocol4")
        return last, "posix.system"
    if kind == "deepspeed_dcp_disguise":  # a .metadata makes the directory look like a DCP one
        from torch.distributed.checkpoint.metadata import Metadata

        named, refused = _plant_new(run, "deepspeed_latest", marker)
        (last / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))
        # where `latest` leads: a clean client state (what the plan reads), a planted optimizer
        # shard (what DeepSpeed's engine unpickles with weights_only=False)
        outside = run.parent / "outside"
        good = torch.load(run.parent / "good_model_states.pt", weights_only=True)
        good.pop(RUN_CONFIG_KEY, None)
        torch.save(good, outside / "mp_rank_00_model_states.pt")
        optim = {"optimizer_state_dict": {"x": PlantedCall(marker)}, "ds_version": "0.19"}
        torch.save(optim, outside / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        return named, refused
    if kind == "fsdp_rank_metadata":
        return _rank_local_metadata(_fsdp_run(run, marker), marker, "dict"), "posix.system"
    # fsdp_item_protocol4: the param_groups bytes item pickled with protocol 4, in a file of its own
    import torch.distributed.checkpoint.metadata as md

    _plant_new(run, "fsdp_item", marker)
    meta = pickle.loads((last / ".metadata").read_bytes())
    buf = io.BytesIO()
    torch.save(PlantedCall(marker), buf, pickle_protocol=4)
    (last / "item.distcp").write_bytes(buf.getvalue())
    for index, info in meta.storage_data.items():
        if isinstance(meta.state_dict_metadata[index.fqn], md.BytesStorageMetadata):
            info.relative_path, info.offset, info.length = "item.distcp", 0, len(buf.getvalue())
    (last / ".metadata").write_bytes(pickle.dumps(meta))
    return last / "item.distcp", "posix.system"


MISSED = ["text_pickle", "zip_protocol5", "legacy_protocol4", "fsdp_rank_metadata", "fsdp_item_protocol4"]


@pytest.mark.parametrize("kind", [*MISSED, "deepspeed_dcp_disguise"])
def test_a_planted_file_the_safe_loader_cannot_parse_is_refused_by_the_resume_not_skipped(
    planted_run, capsys, monkeypatch, kind
):
    """No fallback past it (the run has good step=10/20 checkpoints), exit 2, one line naming the file."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    marker = planted_run.parent / "MARKER"
    named, refused = _plant_missed(planted_run, kind, marker)
    before = snapshot(planted_run)
    capsys.readouterr()
    assert train("--resume", str(planted_run), "trainer.max_steps=30") == 2
    assert not marker.exists(), "the planted call ran"
    assert_one_clean_error(capsys.readouterr().err, str(named), "refused to load", refused)
    assert snapshot(planted_run) == before


@pytest.mark.parametrize("global_metadata", ["dict", "missing"])
def test_a_rank_local_dcp_metadata_is_refused_and_never_unpickled(planted_run, global_metadata):
    """Through every library way in: check_checkpoint, the FSDP2 strategy's load_checkpoint,
    safe_dcp_load, and our storage reader on its own (without the file check)."""
    import torch.distributed.checkpoint as dcp

    from lightning_fp8state.lightning.fsdp import Fp8StateFSDPStrategy

    marker = planted_run.parent / "MARKER"
    last = _fsdp_run(planted_run, marker)
    planted = _rank_local_metadata(last, marker, global_metadata)
    for load in (
        lambda: checkpoint_files.check_checkpoint(last),
        lambda: Fp8StateFSDPStrategy().load_checkpoint(last),
        lambda: checkpoint_files.safe_dcp_load({"state_dict": {}}, last),
    ):
        with pytest.raises(f8s.UntrustedCheckpointError, match="posix.system") as info:
            load()
        assert str(planted) in str(info.value)
    with warnings.catch_warnings(), pytest.raises(dcp.api.CheckpointException):
        warnings.simplefilter("ignore")
        dcp.load(
            {"state_dict": {}},
            storage_reader=checkpoint_files.SafeFileSystemReader(last),
            planner=checkpoint_files.SafeLoadPlanner(),
            no_dist=True,
        )
    assert not marker.exists(), "the planted call ran"
    with warnings.catch_warnings(), pytest.raises(dcp.api.CheckpointException):
        warnings.simplefilter("ignore")
        dcp.load({"state_dict": {}}, storage_reader=dcp.FileSystemReader(last), no_dist=True)
    assert marker.exists(), "torch's own reader falls back to the rank's file and unpickles it"


@pytest.mark.parametrize("kind", [*MISSED[1:], "deepspeed_dcp_disguise", "latest_universal", "nul_path", "fifo"])
def test_the_library_checks_refuse_what_the_first_ones_missed(planted_run, kind):
    """check_checkpoint, and the strategy's load_checkpoint that calls it before its loader (for a
    Lightning file: our CheckpointIO's, which every other strategy loads through)."""
    from lightning_fp8state.lightning import AtomicCheckpointIO
    from lightning_fp8state.lightning.fsdp import Fp8StateFSDPStrategy
    from lightning_fp8state.lightning.strategies import Fp8StateDeepSpeedStrategy

    marker = planted_run.parent / "MARKER"
    last = planted_run / "checkpoints" / "last.ckpt"
    strategy = Fp8StateFSDPStrategy
    if kind == "latest_universal":  # what DeepSpeed reads instead of `latest` with load_universal on
        _plant_new(planted_run, "deepspeed_latest", marker)
        (last / "latest").write_text("checkpoint")
        (last / "latest_universal").write_text("../../../outside")
        named, refused, strategy = last / "latest_universal", "not one folder name", Fp8StateDeepSpeedStrategy
    elif kind == "fifo":  # a shard DeepSpeed's glob opens, and the check skipped (not a regular file)
        _plant_new(planted_run, "deepspeed_latest", marker)
        (last / "latest").write_text("checkpoint")
        named = last / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        named.unlink()
        os.mkfifo(named)
        refused, strategy = "a special file", Fp8StateDeepSpeedStrategy
    elif kind == "nul_path":
        import torch.distributed.checkpoint.metadata as md

        _plant_new(planted_run, "fsdp_item", marker)
        meta = pickle.loads((last / ".metadata").read_bytes())
        for index, info in meta.storage_data.items():
            if isinstance(meta.state_dict_metadata[index.fqn], md.BytesStorageMetadata):
                info.relative_path = "x\0y"
        (last / ".metadata").write_bytes(pickle.dumps(meta))
        named, refused = last / ".metadata", "'x\\x00y'"
    else:
        named, refused = _plant_missed(planted_run, kind, marker)
        if kind.startswith("deepspeed"):
            strategy = Fp8StateDeepSpeedStrategy
        elif not last.is_dir():  # a Lightning file: every strategy but those two loads it through our CheckpointIO
            strategy = AtomicCheckpointIO
    for check in (lambda: checkpoint_files.check_checkpoint(last), lambda: strategy().load_checkpoint(last)):
        with pytest.raises(f8s.UntrustedCheckpointError) as info:
            check()
        assert str(named) in str(info.value) and refused in str(info.value), str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("legacy", [False, True])
def test_a_clean_checkpoint_the_safe_loader_cannot_parse_is_unreadable_not_planted(planted_run, capsys, legacy):
    """A guard on the check above: a checkpoint saved with ``pickle_protocol=4`` names only what
    torch allows (``torch._utils._rebuild_tensor_v2``...): damaged for us, not planted, so the
    resume falls back to the previous good one as for any damaged file."""
    last = planted_run / "checkpoints" / "last.ckpt"
    saved = torch.load(last, weights_only=True)
    torch.save(saved, last, pickle_protocol=4, _use_new_zipfile_serialization=not legacy)
    with pytest.raises(pickle.UnpicklingError, match="not a readable checkpoint"):
        checkpoint_files.check_checkpoint(last)
    capsys.readouterr()
    assert train("--resume", str(planted_run), "trainer.max_steps=22") == 0
    err = capsys.readouterr().err
    assert "last.ckpt is not a readable checkpoint" in err and "previous good checkpoint" in err
