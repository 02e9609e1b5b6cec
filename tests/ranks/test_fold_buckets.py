"""How the overlapped fold cuts a model's gradients into buckets (`trainer_core/ranks/fold_buckets.py`).

Its messages over processes are tested in `test_logical_ranks.py` (bitwise the plain fold's at W = 2 and 4); here
the layout every process must compute alike: backward's order, one dtype per bucket, the byte cap.
"""

from __future__ import annotations

import torch

from trainer_core.ranks.fold_buckets import _Member, buckets_of


def _member(name: str, numel: int, dtype: torch.dtype = torch.float32) -> _Member:
    param = torch.nn.Parameter(torch.zeros(numel, dtype=dtype))
    return _Member(("base", name), param, param)


def _names(buckets) -> list[list[str]]:
    return [[member.key[1] for member in bucket.members] for bucket in buckets]


def test_buckets_run_in_backward_order_and_close_at_the_cap():
    members = [_member("embed", 300), _member("layer0", 100), _member("layer1", 100), _member("head", 300)]
    # 4 bytes an element: a bucket closes once it holds 800 bytes (200 elements) or more.
    assert _names(buckets_of(members, bucket_bytes=800)) == [["head"], ["layer1", "layer0"], ["embed"]]
    assert _names(buckets_of(members, bucket_bytes=10**9)) == [["head", "layer1", "layer0", "embed"]]


def test_a_bucket_holds_one_dtype():
    members = [_member("a", 10), _member("b", 10, torch.float64), _member("c", 10, torch.float64), _member("d", 10)]
    buckets = buckets_of(members, bucket_bytes=10**9)
    assert _names(buckets) == [["d"], ["c", "b"], ["a"]]
    assert [bucket.dtype for bucket in buckets] == [torch.float32, torch.float64, torch.float32]
