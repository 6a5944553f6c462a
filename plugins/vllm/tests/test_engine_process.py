"""The engine processes themselves: a failure in one comes back as the rank harness's typed error, never a hang."""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.runtime import RankFailedError


def test_an_engine_that_cannot_start_reports_why(engines: Any, model_dir: str) -> None:
    with pytest.raises(RankFailedError) as err:
        engines(role="prefill", backend="no-such-backend", model_dir=model_dir).up()
    e = err.value
    # Raised by kvcore inside the child's Engine(...), reported with its traceback and the engine's log.
    assert e.op == "main" and e.error_type == "UnknownBackendError" and "no-such-backend" in e.message
    assert "Traceback" in e.trace and "vllm_engine.py" in e.trace
    assert any(note.startswith("log of vllm-prefill") for note in e.__notes__)


def test_an_unknown_command_is_a_typed_error_and_the_engine_serves_on(engines: Any, model_dir: str) -> None:
    p = engines(role="prefill", backend="shm", model_dir=model_dir, shm_backing=True)
    p.send("bogus", x=1)  # told (no reply): its failure comes back on the next read
    with pytest.raises(RankFailedError) as err:
        p.state()
    assert err.value.op == "bogus" and err.value.error_type == "ValueError" and "unknown command" in err.value.message
    s = p.state()
    assert s["requests"] == 0 and s["free_blocks"] == p.ready["free_blocks"] and s["leaks"] == {}, s
    p.close()
    assert p.rank.exitcode == 0
