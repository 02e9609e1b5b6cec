"""The overlap rule written once (trainer_core/storage_url.py): the config's check and LocalStore.overlaps share it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from infra.store import open_store
from trainer_core.storage_url import local_path, overlap


def test_only_a_local_url_has_a_local_path(tmp_path, monkeypatch):
    assert local_path("s3://rankflow/runs") is None
    assert local_path(f"file://{tmp_path}/a/../store") == tmp_path.resolve() / "store"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert local_path("~/store") == tmp_path.resolve() / "store"


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        ("store", "store", "same"),
        ("work/store", "work", "first_inside"),
        ("work", "work/store", "second_inside"),
        ("store", "work", None),
        ("store-a", "store", None),  # a common prefix of the names is no overlap
    ],
)
def test_overlap_names_how_two_directories_meet(tmp_path, first, second, expected):
    assert overlap(tmp_path / first, tmp_path / second) == expected


def test_a_symlink_overlaps_what_it_points_to(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "alias")
    assert overlap(tmp_path / "alias", tmp_path / "real") == "same"
    assert overlap(tmp_path / "alias" / "sub", tmp_path / "real") == "first_inside"


@pytest.mark.parametrize("staging", ["store", "store/run/export", "", "elsewhere", "store-2"])
def test_a_local_store_overlaps_exactly_where_the_rule_says(tmp_path, staging):
    store = open_store(str(tmp_path / "store"))
    path = Path(tmp_path / staging)
    assert store.overlaps(path) is (overlap(path, tmp_path / "store") is not None)
    assert store.overlaps(path) is (staging in ("store", "store/run/export", ""))
