"""Bad-input cases: storage and output locations."""

from __future__ import annotations

from .common import DUMMY_CREDENTIALS, NO_CREDENTIALS, Case

CASES: list[Case] = [
    # Retention (issue 17): a count that would remove every checkpoint, or a key that would do nothing.
    Case(
        "keep_last_zero",
        "storage",
        r"storage\.keep_last = 0 is not a positive count: it would remove every checkpoint",
        r"set storage\.keep_last = 1 or more",
        config={"storage": {"keep_last": 0}},
    ),
    Case(
        "keep_last_negative",
        "storage",
        r"storage\.keep_last = -3 is not a positive count",
        r"or remove the key to keep every checkpoint",
        config={"storage": {"keep_last": -3}},
    ),
    Case(
        "keep_every_zero",
        "storage",
        r"storage\.keep_every = 0 is not a positive count",
        r"set storage\.keep_every = K >= 1",
        config={"storage": {"keep_last": 2, "keep_every": 0}},
    ),
    Case(
        "keep_every_without_keep_last",
        "storage",
        r"storage\.keep_every = 5 has no effect without storage\.keep_last",
        r"set storage\.keep_last = N to keep the N newest",
        config={"storage": {"keep_every": 5}},
    ),
    Case(
        "s3_no_bucket",
        "storage",
        r": storage\.url: storage\.url='s3://' names no bucket",
        r"write s3://BUCKET/PREFIX",
        config={"storage": {"url": "s3://"}},
    ),
    Case(
        "s3_empty_bucket",
        "storage",
        r": storage\.url: storage\.url='s3:///runs' names no bucket",
        r"write s3://BUCKET/PREFIX",
        config={"storage": {"url": "s3:///runs"}},
    ),
    Case(
        "s3_bad_bucket_name",
        "storage",
        r"'my bucket' is not a valid S3 bucket name",
        r"bucket names are 3-63",
        config={"storage": {"url": "s3://my bucket/runs"}},
    ),
    Case(
        "s3_empty_segment",
        "storage",
        r"storage\.url='s3://rankflow//runs' has an empty",
        r"plain names joined by single '/'",
        config={"storage": {"url": "s3://rankflow//runs"}},
    ),
    # The storage pre-flight (infra/store/preflight.py) runs before anything is written: a setting no retry can fix is bad input.
    Case(
        "s3_no_credentials",
        "storage",
        r"storage\.url='s3://rankflow/runs' at http://127\.0\.0\.1:9: no AWS credentials",
        r"set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        config={"storage": {"url": "s3://rankflow/runs"}},
        env={**NO_CREDENTIALS, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"},
    ),
    Case(  # issue 31: half a key pair was reported as a signature mismatch (a wrong key)
        "s3_secret_missing",
        "storage",
        r"AWS_SECRET_ACCESS_KEY is not set, but AWS_ACCESS_KEY_ID is \(the credentials of storage\.url='s3://rankflow/runs'\)",
        r"set AWS_SECRET_ACCESS_KEY too",
        config={"storage": {"url": "s3://rankflow/runs"}},
        env={**NO_CREDENTIALS, "AWS_ACCESS_KEY_ID": "AKIAIOSFODNN7EXAMPLE", "AWS_ENDPOINT_URL": "http://127.0.0.1:9"},
    ),
    Case(
        "s3_endpoint_not_a_url",
        "storage",
        r"AWS_ENDPOINT_URL='not-a-url' \(the endpoint of storage\.url='s3://rankflow/runs'\) "
        r"is not an S3 endpoint URL",
        r"set AWS_ENDPOINT_URL to http://HOST:PORT or https://HOST:PORT",
        config={"storage": {"url": "s3://rankflow/runs"}},
        env={**DUMMY_CREDENTIALS, "AWS_ENDPOINT_URL": "not-a-url"},
    ),
    Case(
        "s3_endpoint_with_a_path",
        "storage",
        r"AWS_ENDPOINT_URL='http://127\.0\.0\.1:9/s3' .* has a path \('/s3'\)",
        r"without a path",
        config={"storage": {"url": "s3://rankflow/runs"}},
        env={**DUMMY_CREDENTIALS, "AWS_ENDPOINT_URL": "http://127.0.0.1:9/s3"},
    ),
    Case(
        "storage_unknown_scheme",
        "storage",
        r"storage\.url='gs://bucket/runs': unsupported scheme 'gs'",
        r"use a local path, file://PATH or s3://BUCKET/PREFIX",
        config={"storage": {"url": "gs://bucket/runs"}},
    ),
    Case(
        "storage_empty",
        "storage",
        r": storage\.url: storage\.url is empty",
        r"set a local path",
        config={"storage": {"url": ""}},
    ),
    Case(
        "storage_file_url_without_path",
        "storage",
        r"storage\.url='file://' has no path",
        r"write file:///absolute/path",
        config={"storage": {"url": "file://"}},
    ),
    Case(
        "storage_is_a_file",
        "storage",
        r"storage\.url='{dir}/store' cannot be a directory: it is a regular file",
        r"point storage\.url at a directory",
        files={"store": "not a directory"},
    ),
    Case(
        "work_dir_is_a_file",
        "storage",
        r"run\.work_dir='{dir}/work' cannot be a directory: it is a regular file",
        r"point run\.work_dir at a directory",
        files={"work": "not a directory"},
    ),
    Case(
        "work_dir_under_a_file",
        "storage",
        r"run\.work_dir='{dir}/file/work' cannot be a directory \(its parent '{dir}/file' is a regular file\)",
        r"point run\.work_dir at a directory",
        files={"file": "x"},
        config={"run": {"work_dir": "{dir}/file/work"}},
    ),
]
