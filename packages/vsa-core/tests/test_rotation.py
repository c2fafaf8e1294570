"""Rotated block lists (`vsa_core.rotation`): where each list starts, that it is a rotation of
the ascending list, and which devices rotate at all."""

from __future__ import annotations

import pytest
import torch

from vsa_core import rotation


def ascending_lists(rows=9, slots=6, span=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    indices = torch.rand(2, rows, span, generator=gen).argsort(-1)[..., :slots].sort(-1).values
    counts = torch.randint(0, slots + 1, (2, rows), generator=gen)
    counts[0, 0], counts[0, 1] = 0, slots  # an empty list and a full one
    return indices.to(torch.int32), counts.to(torch.int32), span


@pytest.mark.parametrize("width", [1, 4, 7, 100])
def test_each_list_is_its_ascending_list_rotated_to_the_first_entry_past_its_start(width):
    indices, counts, span = ascending_lists()
    starts = rotation.rotation_starts(indices.shape, span, width)
    got = rotation.rotate_lists(indices, counts, starts)
    for lead in range(indices.shape[0]):
        for row in range(indices.shape[1]):
            n = int(counts[lead, row])
            order = lead * indices.shape[1] + row
            start = order * span // width % span
            plain = indices[lead, row, :n].tolist()
            first = next((i for i, x in enumerate(plain) if x >= start), 0)
            assert got[lead, row, :n].tolist() == plain[first:] + plain[:first]
            assert not got[lead, row, n:].any()


def test_starts_step_through_the_span_once_per_width_rows():
    starts = rotation.rotation_starts((1, 8, 3), span=16, width=4)
    assert starts.flatten().tolist() == [0, 4, 8, 12, 0, 4, 8, 12]
    with pytest.raises(ValueError, match="width"):
        rotation.rotation_starts((1, 8, 3), span=16, width=0)


def test_rotation_width_is_the_sm_count_on_sm90_beyond_the_l2_only(monkeypatch):
    class Props:
        multi_processor_count = 132
        major, minor = 9, 0
        L2_cache_size = 50 << 20

    assert rotation.rotation_width(torch.device("cpu")) == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    assert rotation.rotation_width(torch.device("cuda", 0)) == 132
    assert rotation.rotation_width(torch.device("cuda", 0), 64 << 20) == 132  # beyond the L2
    assert rotation.rotation_width(torch.device("cuda", 0), 47 << 20) == 0  # fits: no rotation
    Props.major = 10
    assert rotation.rotation_width(torch.device("cuda", 0)) == 0
