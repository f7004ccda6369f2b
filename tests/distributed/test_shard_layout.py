"""Where each rank's part lies: offsets, documents that span parts, per-document state rows."""

from __future__ import annotations

import pytest
import torch

from efla.distributed import shard, shard_layout


def test_parts_are_contiguous_and_near_equal():
    layouts = [shard_layout(10, 4, r) for r in range(4)]
    assert [(x.start, x.end) for x in layouts] == [(0, 2), (2, 5), (5, 7), (7, 10)]
    x = torch.arange(20).reshape(2, 10)
    assert torch.equal(torch.cat([shard(x, lay) for lay in layouts], dim=1), x)
    assert [x.continues_previous for x in layouts] == [False, True, True, True]
    assert [x.history_length for x in layouts] == [0, 2, 5, 7]
    assert all(x.local_offsets is None and x.document_rows == slice(None) for x in layouts)


def test_documents_spanning_parts():
    cu = torch.tensor([0, 3, 20, 27, 40], dtype=torch.int32)
    layouts = [shard_layout(40, 4, r, cu) for r in range(4)]  # parts [0,10) [10,20) [20,30) [30,40)
    assert [x.local_offsets for x in layouts] == [(0, 3, 10), (0, 10), (0, 7, 10), (0, 10)]
    assert [x.continues_previous for x in layouts] == [False, True, False, True]
    assert [x.history_length for x in layouts] == [0, 7, 0, 3]
    assert [x.document_rows for x in layouts] == [slice(0, 2), slice(1, 2), slice(2, 4), slice(3, 4)]
    assert torch.equal(layouts[2].local_cu_seqlens(), torch.tensor([0, 7, 10], dtype=torch.int32))


@pytest.mark.parametrize(
    "args, match",
    [
        ((3, 4, 0), "total_length"),
        ((10, 2, 2), "rank"),
        ((10, 2, 0, [0, 4, 9]), "cu_seqlens"),
        ((10, 2, 0, [0, 4, 4, 10]), "cu_seqlens"),
    ],
)
def test_bad_layouts_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        shard_layout(*args)
