"""After `rankflow checkpoints gc`, an orphan it emptied is gone from `rankflow checkpoints list` (local and SeaweedFS).

The reference is the store's own listing: what is left under the orphan's
prefix (no object), and what the CLI lists afterwards (only the committed
checkpoints, none NOT VERIFIED).
"""

from __future__ import annotations

import json

import pytest

from flows.cli import main
from infra.publication.commit import commit_checkpoint
from infra.store import open_store
from infra.store.objects import list_files, put_small
from tests.publication_helpers import RUN, random_files, stage


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store_url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store")
    request.getfixturevalue("s3_env")
    return request.getfixturevalue("s3_bucket_url")


def _listed(store_url, capsys) -> dict:
    assert main(["checkpoints", "list", RUN, "--store", store_url, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_an_orphan_emptied_by_gc_is_no_longer_listed(store_url, tmp_path, capsys):
    store = open_store(store_url)
    commit_checkpoint(stage(tmp_path, 10, random_files(1, 2000)), store, RUN)
    orphan = store.path(RUN, "checkpoints", "step-00000030")  # a commit that died before its manifest
    put_small(store, f"{orphan}/model-00000-of-00001.safetensors", b"half an upload" * 10)
    before = _listed(store_url, capsys)
    assert [(c["checkpoint"], c["verified"]) for c in before["checkpoints"]] == [
        ("step-00000010", True),
        ("step-00000030", False),
    ]  # an orphan with objects is listed, not verified

    assert main(["checkpoints", "gc", RUN, "--store", store_url]) == 0
    assert "removed 1 objects" in capsys.readouterr().out
    assert list_files(store, orphan) == {}, "gc left objects under the orphan"
    after = _listed(store_url, capsys)
    assert [(c["checkpoint"], c["verified"]) for c in after["checkpoints"]] == [("step-00000010", True)]
    assert after["latest"] == "step-00000010"
    assert main(["checkpoints", "list", RUN, "--store", store_url]) == 0
    assert "NOT VERIFIED" not in capsys.readouterr().out


def test_a_checkpoint_directory_with_no_object_is_not_listed(store_url, tmp_path, capsys):
    # What an older gc (or a person) left: the objects removed, the directory kept by the store.
    store = open_store(store_url)
    commit_checkpoint(stage(tmp_path, 10, random_files(1, 2000)), store, RUN)
    emptied = store.path(RUN, "checkpoints", "step-00000030")
    put_small(store, f"{emptied}/shards/model.safetensors", b"gone soon")
    store.fs.rm([f"{emptied}/shards/model.safetensors"])
    store.fs.invalidate_cache()
    assert "step-00000030" in [
        e["name"].rstrip("/").rsplit("/", 1)[-1] for e in store.fs.ls(store.path(RUN, "checkpoints"), detail=True)
    ]
    listed = _listed(store_url, capsys)
    assert [c["checkpoint"] for c in listed["checkpoints"]] == ["step-00000010"]
