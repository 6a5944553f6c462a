"""The session state machine: allowed transitions, terminal-once, quiescence."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvcore.errors import RequestCancelledError, SessionError
from kvcore.transceiver.peers import GenPeer
from kvcore.transceiver.sessions import (
    ReceiverTask,
    RxSession,
    SessionState,
    TaskState,
    Tombstones,
    TxSession,
    WriterState,
)


def _rx() -> RxSession:
    return RxSession(request_id=1, deadline=time.monotonic() + 10)


def test_happy_path_transitions() -> None:
    s = _rx()
    assert s.transition(SessionState.READY)
    assert s.transition(SessionState.TRANSFERRING)
    assert s.transition(SessionState.DONE)
    assert s.terminal and s.error is None and s.finished is not None


def test_terminal_state_is_committed_once() -> None:
    s = _rx()
    err = RequestCancelledError("x")
    assert s.transition(SessionState.CANCELLED, err)
    assert not s.transition(SessionState.DONE)  # late news changes nothing
    assert not s.transition(SessionState.FAILED, SessionError("late"))
    assert s.state is SessionState.CANCELLED and s.error is err


def test_illegal_transition_raises() -> None:
    s = _rx()
    s.transition(SessionState.TRANSFERRING)
    with pytest.raises(SessionError, match="TRANSFERRING -> READY"):
        s.transition(SessionState.READY)


def test_rx_quiescent_only_when_no_writer_may_still_write() -> None:
    s = _rx()
    s.writers = {0: WriterState.ASKED, 1: WriterState.OK}
    s.transition(SessionState.CANCELLED)
    assert not s.quiescent
    s.writers[0] = WriterState.FENCED
    assert s.quiescent


def test_tx_quiescent_only_when_every_task_has_its_final_answer() -> None:
    s = TxSession(request_id=2, deadline=time.monotonic() + 10)
    t = ReceiverTask(peer=GenPeer(), block_ids=np.zeros(1, np.int64), state_slot=-1, prompt_len=-1, nonce=b"n")
    s.tasks[("g", 0)] = t
    assert not s.quiescent  # asked, not answered: a receiver still waits for a final word
    t.move(TaskState.SUBMITTED)
    assert not s.quiescent
    t.move(TaskState.DONE)
    assert s.quiescent
    with pytest.raises(SessionError, match="DONE -> SUBMITTED"):
        t.move(TaskState.SUBMITTED)  # a finished task never writes again


def test_writer_moves_follow_the_table() -> None:
    s = _rx()
    s.writers = {0: WriterState.ASKED}
    assert s.settle(0, WriterState.NOT_ASKED)
    assert s.settle(0, WriterState.ASKED)  # asked again after a re-registration
    assert s.settle(0, WriterState.OK)
    assert not s.settle(0, WriterState.FAILED)  # late news changes nothing
    assert s.writers[0] is WriterState.OK


def test_tombstones_are_bounded_in_number_and_age() -> None:
    t = Tombstones(max_entries=3, ttl_s=10.0)
    for rid in range(5):
        t.put(rid, SessionState.CANCELLED)
    assert len(t) == 3 and 0 not in t and 4 in t and t.evicted == 2
    t.expire(time.monotonic() + 11)
    assert len(t) == 0


def test_session_table_holds_the_ended_sessions_until_they_leave() -> None:
    """``ended`` gets a session when it becomes terminal (once), in the order they ended, and loses it on pop."""
    from kvcore.transceiver.sessions import SessionTable

    table: SessionTable[RxSession] = SessionTable()
    sessions = {rid: RxSession(request_id=rid, deadline=time.monotonic() + 10) for rid in range(5)}
    for rid, s in sessions.items():
        table[rid] = s
    assert list(table.news()) == [] and len(table) == 5
    sessions[3].transition(SessionState.CANCELLED, RequestCancelledError("x"))
    sessions[1].transition(SessionState.DONE)
    sessions[1].transition(SessionState.FAILED)  # committed once: no second entry, no reorder
    assert [rid for rid, _ in table.news()] == [3, 1]
    assert table.pop(3) is sessions[3] and 3 not in table
    assert [rid for rid, _ in table.news()] == [1]
    # a session that was already terminal when added is news at once; one replaced under its id reports nothing
    done = RxSession(request_id=7, deadline=0.0, state=SessionState.DONE)
    table[7] = done
    stale = sessions[0]
    table[0] = RxSession(request_id=0, deadline=time.monotonic() + 10)
    stale.transition(SessionState.DONE)
    assert [rid for rid, _ in table.news()] == [1, 7]
    # a session that ended, then was replaced under its id by a live one: the id is no news any more
    table[1] = RxSession(request_id=1, deadline=time.monotonic() + 10)
    assert [rid for rid, _ in table.news()] == [7]
    table[1].transition(SessionState.FAILED)
    assert [rid for rid, _ in table.news()] == [7, 1]
    table.pop(1)
    # an id whose session left by another way is dropped from the news as it is met
    table._live.pop(7)
    assert list(table.news()) == [] and list(table.ended) == []


def test_session_table_finds_the_sessions_whose_deadline_passed() -> None:
    """``due`` returns the held, non-terminal sessions past their deadline, each once, and follows moved deadlines."""
    from kvcore.transceiver.sessions import SessionTable

    table: SessionTable[TxSession] = SessionTable()
    t0 = 1000.0
    for rid in range(10):
        table[rid] = TxSession(request_id=rid, deadline=t0 + rid)
    assert table.due(t0) == []
    assert [s.request_id for s in table.due(t0 + 2.5)] == [0, 1, 2]
    # left non-terminal by the caller: found again; once terminal, never again
    assert [s.request_id for s in table.due(t0 + 2.6)] == [0, 1, 2]
    for rid in (0, 1, 2):
        table[rid].transition(SessionState.TIMED_OUT)
    assert table.due(t0 + 2.7) == []
    # a deadline moved later is not due at its old time, but at its new one
    table[3].deadline = t0 + 20
    assert [s.request_id for s in table.due(t0 + 4.5)] == [4]
    table[4].transition(SessionState.TIMED_OUT)
    assert sorted(s.request_id for s in table.due(t0 + 20.5)) == [3, 5, 6, 7, 8, 9]
    # a deadline moved earlier (set_deadline) is due at the earlier time
    table[20] = TxSession(request_id=20, deadline=t0 + 100)
    table.set_deadline(table[20], t0 + 30)
    assert 20 in [s.request_id for s in table.due(t0 + 31)]
    # released sessions, and one replaced under its id, are not reported; the replacement keeps its own deadline
    table.pop(5)
    old = table[6]
    table[6] = TxSession(request_id=6, deadline=t0 + 500)
    due = table.due(t0 + 40)
    assert 5 not in [s.request_id for s in due] and old not in due and table[6] not in due


def test_session_table_deadline_heap_stays_bounded() -> None:
    """Entries of sessions that left are dropped once the heap outgrows the sessions held."""
    from kvcore.transceiver.sessions import SessionTable

    table: SessionTable[TxSession] = SessionTable()
    for rid in range(20_000):
        table[rid] = TxSession(request_id=rid, deadline=1e9 + rid)
        if rid >= 10:
            table.pop(rid - 10)
        table.due(0.0)
    assert len(table) == 10
    assert len(table.deadlines) <= 2 * len(table) + 1024 + 1
    assert {s.request_id for s in table.due(2e9)} == set(range(19_990, 20_000))
