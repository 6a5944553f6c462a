"""The cma agent's options: one typed struct, converted by kvcore; bad options are ConfigErrors naming the key."""

from importlib.metadata import PackageNotFoundError, distribution

import pytest

try:
    distribution("kvcore-cma")
except PackageNotFoundError:  # only an absent example skips; a broken install fails
    pytest.skip("install the example first: pip install ./docs/examples/kvcore-cma", allow_module_level=True)

import numpy as np
from kvcore_cma.agent import CmaAgent, CmaOptions

from kvcore import ConfigError, TransceiverConfig, TransferOp, TransferStatus, create_agent


def test_defaults() -> None:
    assert CmaAgent.options_type is CmaOptions and CmaOptions().iovecs_per_call == 1024


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"iovecs": 8}, r"cma agent option\(s\) 'iovecs': unknown; expected one of iovecs_per_call"),
        ({"iovecs_per_call": 4096}, r"cma agent option 'iovecs_per_call': expected int in 1\.\.1024, got 4096 \(int\)"),
        ({"iovecs_per_call": "8"}, r"cma agent option 'iovecs_per_call': expected int in 1\.\.1024, got '8' \(str\)"),
    ],
)
def test_bad_options_are_config_errors(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        create_agent(TransceiverConfig(backend="cma", agent_options=options), "cma-bad")


def test_iovecs_per_call_reaches_the_copy() -> None:
    """Every other 64-byte fragment, 2 iovecs per call: the bytes land as with one call for all of them."""
    a = create_agent(TransceiverConfig(backend="cma", agent_options={"iovecs_per_call": 2}), "cma-a")
    b = CmaAgent("cma-b")
    try:
        assert isinstance(a, CmaAgent) and a.opts.iovecs_per_call == 2
        src = np.arange(4096, dtype=np.uint8)
        dst = np.zeros(4096, dtype=np.uint8)
        a.register_memory(_region(src))
        b.register_memory(_region(dst))
        peer = a.load_remote_agent(b.descriptor())
        offsets = np.arange(0, 4096, 128, dtype=np.uint64)  # 32 fragments, none adjacent: nothing merges
        h = a.submit(TransferOp.WRITE, peer, src.ctypes.data + offsets, dst.ctypes.data + offsets, [64] * 32)
        assert a.wait(h, timeout=30) is TransferStatus.DONE
        a.release(h)
        expected = np.zeros(4096, dtype=np.uint8)
        for off in offsets.tolist():
            expected[off : off + 64] = src[off : off + 64]
        assert np.array_equal(dst, expected)
    finally:
        a.close()
        b.close()


def _region(array: np.ndarray) -> object:
    from kvcore import MemoryKind, MemoryRegion

    return MemoryRegion(address=array.ctypes.data, length=array.nbytes, kind=MemoryKind.DRAM)
