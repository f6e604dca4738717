"""A consumer rank's routes to producer ranks of another TP size, and one load's transfers
read as one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from disagg.consumer.routes import Part, Routes, status
from disagg.transport.dataplane import TransferState, TransferStatus


def _svc(kv: int | None, tp: int, rank: int) -> SimpleNamespace:
    return SimpleNamespace(num_kv_heads=kv, tp_size=tp, tp_rank=rank)


def test_parts_split_merge_and_replicated():
    split = Routes(4, 4, 3, [2])  # consumer rank 3 of 4: head 3, half of producer rank 1's
    assert split.parts == [[Part(1, range(3, 4), False)]]
    merge = Routes(4, 1, 0, [2])  # one consumer page from both producer ranks, whole
    assert merge.parts == [[Part(0, range(0, 2), True), Part(1, range(2, 4), True)]]
    assert merge.ranks_linked(0, leader=True) == [0, 1]
    replicated = Routes(2, 4, 3, [2, 4])  # head 1 on consumer ranks 2 and 3
    assert replicated.parts == [[Part(1, range(1, 2), True)], [Part(2, range(1, 2), True)]]
    assert replicated.ranks_linked(1, leader=False) == [2]


def test_of_is_head_blind_without_a_head_count_and_refuses_a_bad_producer_tp():
    assert Routes.of(_svc(None, 2, 0), [2]) is None
    with pytest.raises(ValueError, match=r"consumer.producers\[1\] lists 3 rank endpoints"):
        Routes.of(_svc(4, 2, 0), [2, 3])


def test_status_lands_when_every_part_did_and_fails_when_one_did():
    def plane(*states: TransferStatus) -> SimpleNamespace:
        return SimpleNamespace(poll=lambda tid: states[tid])

    done = TransferStatus(TransferState.DONE, pages=6)
    part = TransferStatus(TransferState.RECEIVING, pages=2)
    failed = TransferStatus(TransferState.FAILED, error="peer gone")
    assert status(plane(done, done), [0, 1]).state is TransferState.DONE
    mixed = status(plane(done, part), [0, 1])
    assert mixed.state is TransferState.RECEIVING and mixed.pages == 2  # the slower part
    assert status(plane(done, failed), [0, 1]).error == "peer gone"
