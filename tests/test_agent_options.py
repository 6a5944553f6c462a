"""Agent options are typed structs converted in one place: unknown keys and wrong types are ConfigErrors.

Every transfer agent states its options once, as a frozen msgspec struct with defaults;
``kvcore.extension.convert.convert_options`` turns ``TransceiverConfig.agent_options`` into it.
The shm agent is the core's; the plugins test their own agents' options next to them.
"""

from __future__ import annotations

import threading
from typing import Annotated, Literal

import msgspec
import pytest
import torch

from kvcore import TransceiverConfig, TransferOp, TransferStatus, create_agent
from kvcore.errors import ConfigError
from kvcore.extension.convert import convert_options, describe_type
from kvcore.transport.builtin.shm import ShmAgent, ShmOptions

MiB = 1 << 20


class Example(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    threads: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    mode: bool | Literal["auto"] = "auto"
    params: dict[str, str] = {}


def test_convert_options_fills_defaults_and_keeps_given_values() -> None:
    assert convert_options(Example, None, owner="x agent") == Example()
    assert convert_options(Example, {}, owner="x agent") == Example()
    got = convert_options(Example, {"threads": 5, "mode": False, "params": {"a": "b"}}, owner="x agent")
    assert (got.threads, got.mode, got.params) == (5, False, {"a": "b"})
    assert convert_options(Example, got, owner="x agent") is got  # already typed: unchanged


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"thread": 1}, "x agent option(s) 'thread': unknown; expected one of mode, params, threads"),
        ({"threads": "4"}, "x agent option 'threads': expected int in 1..64, got '4' (str)"),
        ({"threads": 0}, "x agent option 'threads': expected int in 1..64, got 0 (int)"),
        ({"threads": True}, "x agent option 'threads': expected int in 1..64, got True (bool)"),
        ({"mode": "sometimes"}, "x agent option 'mode': expected true or false or 'auto', got 'sometimes' (str)"),
        ({"params": ["a"]}, "x agent option 'params': expected a mapping of str to str, got ['a'] (list)"),
        (["threads"], "x agent options: expected a mapping of option names to values, got list"),
    ],
)
def test_convert_options_names_the_agent_the_key_expected_and_actual(raw: object, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        convert_options(Example, raw, owner="x agent")  # type: ignore[arg-type]
    assert str(exc.value) == message


def test_describe_type_reads_like_the_docs() -> None:
    assert describe_type(Annotated[float, msgspec.Meta(gt=0)]) == "float > 0"
    assert describe_type(Literal["auto", "none", "peer"]) == "'auto' or 'none' or 'peer'"
    assert describe_type(dict[str, str | int | bool]) == "a mapping of str to str or int or bool"


def test_shm_options_defaults() -> None:
    assert ShmAgent.options_type is ShmOptions
    assert ShmOptions().copy_threads == 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"copy_thread": 2}, "shm agent option(s) 'copy_thread': unknown; expected one of copy_threads"),
        ({"copy_threads": "2"}, "shm agent option 'copy_threads': expected int in 1..64, got '2' (str)"),
        ({"copy_threads": 65}, "shm agent option 'copy_threads': expected int in 1..64, got 65 (int)"),
    ],
)
def test_shm_agent_refuses_bad_options_through_the_config(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        create_agent(TransceiverConfig(backend="shm", agent_options=options), "opts-bad")
    assert str(exc.value) == message


def _copy_threads(agent_name: str) -> int:
    return sum(t.name.startswith(f"kvcore-shm-{agent_name}-copy") for t in threading.enumerate())


@pytest.mark.parametrize(("options", "threads"), [({}, 2), ({"copy_threads": 3}, 3), ({"copy_threads": 1}, 1)])
def test_shm_copy_threads_reach_the_agent(options: dict[str, int], threads: int) -> None:
    """Four transfers above the inline size start one copy thread each, up to ``copy_threads``."""
    name = f"opts-{threads}-{len(options)}"
    a = create_agent(TransceiverConfig(backend="shm", agent_options=options), name)
    b = ShmAgent(f"{name}-peer")
    try:
        assert isinstance(a, ShmAgent) and a.opts.copy_threads == threads
        dst = b.allocate_tensor((8 * MiB,), torch.uint8)
        b.register_memory(dst)
        b.load_remote_agent(a.descriptor())
        peer = a.load_remote_agent(b.descriptor())
        src = torch.arange(8 * MiB, dtype=torch.int64).to(torch.uint8)
        a.register_memory(src)
        handles = [
            a.submit(TransferOp.WRITE, peer, [src.data_ptr() + i * 2 * MiB], [dst.data_ptr() + i * 2 * MiB], [2 * MiB])
            for i in range(4)
        ]
        for h in handles:
            assert a.wait(h, timeout=60) is TransferStatus.DONE
            a.release(h)
        assert torch.equal(dst, src)
        assert _copy_threads(name) == threads
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    ("backend", "doc"),
    [
        ("shm", "README.md"),
        ("nixl", "plugins/nixl/README.md"),
        ("ucx", "plugins/ucx/README.md"),
        ("cma", "docs/examples/kvcore-cma/README.md"),
    ],
)
def test_every_option_is_documented(backend: str, doc: str) -> None:
    """Each agent's options struct is the one statement of its options; its page names every field."""
    from pathlib import Path

    from kvcore.extension.plugins import get_plugin_manager

    agents = get_plugin_manager().registries.transfer_agents
    if backend not in agents.names():
        pytest.skip(f"the {backend} plugin is not installed")
    options_type = agents.entry(backend).load().options_type
    assert options_type is not None, f"{backend}: no typed options"
    text = (Path(__file__).resolve().parent.parent / doc).read_text()
    missing = [f.name for f in msgspec.structs.fields(options_type) if f"`{f.name}`" not in text]
    assert missing == [], f"{doc} does not document {backend} options {missing}"
