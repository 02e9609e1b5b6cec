"""`data.path` and `data.eval_path` naming URLs: listed and read through fsspec with the same readers and checks.

The reference is the same bytes as a local file: the same records, the same digest, and (on the SeaweedFS
fixture) the same inputs' fingerprint, and so the same plan digest, since paths never enter it. fsspec's `memory://` filesystem stands in for a store
where the store itself does not matter.
"""

from __future__ import annotations

import io
import json
import uuid

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import EXAMPLES, tiny_tree
from trainer_core.config import ConfigError, config_from_dict
from trainer_core.data import DataError
from trainer_core.data.readers import rows
from trainer_core.data_sources import data_files
from trainer_core.run.validate import input_fingerprint, validate_inputs

RECORD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.fixture
def memory_dir():
    """A fresh directory of fsspec's in-process memory filesystem: (its URL, the filesystem)."""
    fs = fsspec.filesystem("memory")
    root = f"/rankflow-{uuid.uuid4().hex[:12]}"
    yield f"memory://{root}", fs
    fs.rm(root, recursive=True)


def test_a_url_and_a_glob_of_urls_read_as_the_same_local_files(tmp_path, memory_dir):
    url, fs = memory_dir
    jsonl = (json.dumps(RECORD) + "\n\n" + json.dumps(RECORD) + "\n").encode()
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([RECORD] * 3), buffer)
    for name, data in (("a.jsonl", jsonl), ("b.parquet", buffer.getvalue())):
        fs.pipe(f"{url.removeprefix('memory://')}/{name}", data)
        (tmp_path / name).write_bytes(data)
    remote = data_files([f"{url}/*.jsonl", f"{url}/b.parquet"])
    local = data_files([str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")])
    assert [f.type for f in remote] == ["jsonl", "parquet"]
    for got, want in zip(remote, local, strict=True):
        assert got.sha256() == want.sha256()
        assert [(p, r) for p, _, r in rows(got)] == [(p, r) for p, _, r in rows(want)]
    assert [w for _, w, _ in rows(remote[0])] == [f"{remote[0].path}:1", f"{remote[0].path}:3"]  # FILE:LINE


def test_a_file_url_is_a_local_path_with_its_checks(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps(RECORD) + "\n")
    assert [f.path for f in data_files(f"file://{tmp_path}/*.jsonl")] == [tmp_path / "a.jsonl"]
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(ConfigError, match="is a directory, not a regular file"):
        data_files(f"file://{tmp_path}/dir.jsonl")[0].sha256()


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("missing.jsonl", r"data\.path='memory://.*/missing\.jsonl' does not exist"),
        ("*.parquet", r"data\.path='memory://.*/\*\.parquet' matches no object"),
        ("", r"data\.path='memory://.*/' is a directory \(a prefix\), not a file"),
        ("nope://x/y.jsonl", r"no installed fsspec filesystem reads nope:// URLs"),
    ],
)
def test_a_url_naming_no_file_is_bad_input_naming_the_key(memory_dir, name, expected):
    url, fs = memory_dir
    fs.pipe(f"{url.removeprefix('memory://')}/a.jsonl", b"{}\n")
    with pytest.raises(ConfigError, match=expected):
        data_files(name if "://" in name else f"{url}/{name}")


@pytest.mark.s3
def test_data_in_s3_plans_as_the_same_local_file_and_names_its_url_in_errors(s3_env, s3_bucket_url, tmp_path):
    fs = s3_env.filesystem()
    data_url, bad_url = f"{s3_bucket_url}/sft.jsonl", f"{s3_bucket_url}/bad.jsonl"
    head = b"".join((EXAMPLES / "tiny" / "sft.jsonl").read_bytes().splitlines(keepends=True)[:40])
    (tmp_path / "sft.jsonl").write_bytes(head)
    fs.pipe(data_url, head)
    fs.pipe(bad_url, (json.dumps(RECORD) + "\n" + '{"messages": [}\n').encode())
    remote = config_from_dict(tiny_tree(tmp_path, data={"path": data_url}), config_dir=tmp_path)
    local = config_from_dict(tiny_tree(tmp_path, data={"path": str(tmp_path / "sft.jsonl")}), config_dir=tmp_path)
    checked = validate_inputs(remote)  # every record read and checked, from the bucket
    # The same bytes as the local file: the same inputs' fingerprint, so the same plan digest (paths are not in it).
    assert checked.fingerprint == input_fingerprint(local, checked.template)
    assert checked.prepared.num_records == 40
    bad = config_from_dict(tiny_tree(tmp_path, data={"path": bad_url}), config_dir=tmp_path)
    with pytest.raises(DataError, match=rf"^{bad_url}:2"):
        validate_inputs(bad)
    with pytest.raises(ConfigError, match=rf"data\.eval_path='{s3_bucket_url}/held-out\.jsonl' does not exist"):
        config_from_dict(
            tiny_tree(tmp_path, data={"eval_path": f"{s3_bucket_url}/held-out.jsonl"}), config_dir=tmp_path
        )


@pytest.mark.parametrize(
    ("environment", "named"),
    [({}, "no usable credentials"), ({"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE"}, "AWS_SECRET_ACCESS_KEY")],
)
def test_an_s3_url_without_usable_credentials_is_bad_input_naming_the_key(tmp_path, monkeypatch, environment, named):
    """botocore's NoCredentialsError / PartialCredentialsError were a traceback and exit 1; now exit 2's message."""
    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup: nothing leaves loopback
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # never reached: credentials are resolved first
    for variable, value in environment.items():
        monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=rf"data\.path='s3://bucket/x\.jsonl' cannot be read: .*{named}"):
        data_files("s3://bucket/x.jsonl")
