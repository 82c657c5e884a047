"""The one commit point: a manifest is written only through ``tiers.commit.commit_manifest``,
which names the save it commits and acts on a claim or a decision."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter
from dcp_datastates.errors import CheckpointError, ClaimLostError, StorageFailedError
from dcp_datastates.format.names import MANIFEST_NAME, rank_manifest_name
from dcp_datastates.tiers import StorageTier
from dcp_datastates.tiers.commit import ByClaim, ByDecision, commit_manifest
from dcp_datastates.tiers.local import LocalBackend
from dcp_datastates.tiers.manifests import manifest_head


def _saved(path, value: float) -> tuple[StorageTier, bytes, str]:
    dcp.save({"w": torch.full((64,), value)}, storage_writer=DataStatesWriter(str(path), overwrite=True),
             no_dist=True)
    tier = StorageTier(str(path))
    head = manifest_head(tier)
    assert head is not None
    return tier, tier.read_bytes(MANIFEST_NAME), head.save_id


def _loaded(path) -> float:
    out = {"w": torch.zeros(64)}
    dcp.load(out, storage_reader=DataStatesReader(str(path)), no_dist=True)
    return float(out["w"][0])


@pytest.mark.parametrize("how", ["commit_bytes", "publish", "open_sink"])
@pytest.mark.parametrize("name", [MANIFEST_NAME, rank_manifest_name(3, "0123456789ab")])
def test_storage_refuses_a_manifest_by_any_other_way(tmp_path, how, name):
    tier = StorageTier(str(tmp_path))
    call = {"commit_bytes": lambda: tier.commit_bytes(name, b"x"), "publish": lambda: tier.publish("t", name),
            "open_sink": lambda: tier.open_sink(name)}[how]
    with pytest.raises(ValueError, match="commit_manifest"):
        call()
    assert not (tmp_path / name).exists()


def test_a_manifest_is_committed_only_as_the_save_its_bytes_name(tmp_path):
    tier, body, save_id = _saved(tmp_path / "a", 1.0)
    other, _, other_id = _saved(tmp_path / "b", 2.0)
    with pytest.raises(CheckpointError, match=f"manifest of save {save_id} as save {other_id}"):
        commit_manifest(other, body, other_id, ByDecision("test"))
    with pytest.raises(CheckpointError, match="refusing"):
        commit_manifest(other, b"not a manifest", other_id, ByDecision("test"))
    assert _loaded(tmp_path / "b") == 2.0


def test_a_claim_lost_before_the_rename_commits_nothing(tmp_path):
    tier, body, save_id = _saved(tmp_path / "a", 1.0)
    other, before, _ = _saved(tmp_path / "b", 2.0)

    def lost() -> None:
        raise ClaimLostError("taken over", checkpoint=other.url)
    with pytest.raises(ClaimLostError):
        commit_manifest(other, body, save_id, ByClaim(lost))
    assert other.read_bytes(MANIFEST_NAME) == before


def test_a_decision_replaces_another_save_and_leaves_its_own(tmp_path):
    """A decided save's manifest replaces another save's; where the directory holds the
    decided save already, nothing is written."""
    tier, body, save_id = _saved(tmp_path / "a", 1.0)
    assert not commit_manifest(tier, body, save_id, ByDecision("test"))
    other, _, _ = _saved(tmp_path / "b", 2.0)
    assert commit_manifest(other, body, save_id, ByDecision("test"))
    assert manifest_head(other).save_id == save_id


def test_a_storage_failure_at_the_commit_names_the_tier_and_the_file(tmp_path, monkeypatch):
    tier, body, save_id = _saved(tmp_path / "a", 1.0)
    other, before, _ = _saved(tmp_path / "b", 2.0)

    def full(self, root, path, tmp_name, data, *, sync):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(LocalBackend, "commit", full)
    with pytest.raises(StorageFailedError, match=f"{other.url}.*{MANIFEST_NAME}|{MANIFEST_NAME}.*{other.url}") as e:
        commit_manifest(other, body, save_id, ByDecision("test"))
    assert e.value.errno == 28
    monkeypatch.undo()
    assert other.read_bytes(MANIFEST_NAME) == before
