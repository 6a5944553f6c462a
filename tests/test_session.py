"""The session state machine: allowed transitions, terminal-once, quiescence."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvcore.errors import RequestCancelledError, SessionError
from kvcore.session import ReceiverTask, RxSession, SessionState, TxSession, WriterState


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


def test_tx_quiescent_tracks_submitted_tasks() -> None:
    s = TxSession(request_id=2, deadline=time.monotonic() + 10)
    t = ReceiverTask(
        gen_key=("g", 0), endpoint="tcp://127.0.0.1:1", block_ids=np.zeros(1, np.int64), state_slot=-1, prompt_len=-1
    )
    s.tasks[t.gen_key] = t
    assert s.quiescent
    t.state = "submitted"
    assert not s.quiescent
    t.state = "done"
    assert s.quiescent
