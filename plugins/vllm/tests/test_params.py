"""Transfer parameters in kv_transfer_params, options, and the scheduler side on vLLM's real Scheduler (one process)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kvcore_vllm.engine_api import (
    PARAMS_KEY,
    InvalidTransferParamsError,
    LoadFailure,
    classify_load_failure,
    parse_params,
)
from kvcore_vllm.options import DEFAULT_MODE, connector_options, transceiver_config, transceiver_role

from kvcore import errors as E
from kvcore.errors import ConfigError, KvcoreError
from kvcore.params import TransferParams

PULL = TransferParams.make(
    "r", "tcp://127.0.0.1:5555", mode="pull", prompt_len=40, block_ids=[4, 5, 6], incarnation="abc"
).to_dict()
PUSH = TransferParams.make("r", "tcp://127.0.0.1:5555", prompt_len=40).to_dict()


@pytest.mark.parametrize("good", [PULL, PUSH])
def test_kvcore_params_round_trip_through_json(good: dict[str, Any]) -> None:
    p = parse_params(json.loads(json.dumps({"do_remote_prefill": True, PARAMS_KEY: good})))
    assert p.to_dict() == good and p.request_id == "r" and p.prompt_len == 40
    assert issubclass(InvalidTransferParamsError, KvcoreError)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"version": 2}, "version"),
        ({"request_id": ""}, "request_id"),
        ({"prompt_len": 0}, "prompt_len"),
        ({"prompt_len": "40"}, "prompt_len"),
        ({"ticket": "zz"}, "ticket"),
        ({"ticket": "ab"}, "ticket"),
        ({"mode": "teleport"}, "mode"),
        ({"dp_rank": -1}, "dp_rank"),
        ({"mode": "pull", "incarnation": ""}, "incarnation"),
        ({"endpoint": 5}, "endpoint"),
    ],
)
def test_bad_params_name_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidTransferParamsError, match=field):
        parse_params({PARAMS_KEY: {**PUSH, **change}})


def test_the_kvcore_request_id_is_the_prefills_and_need_not_equal_the_decode_requests() -> None:
    """vLLM gives the decode request an id of its own; the parameters name the prefill's request."""
    p = parse_params({"remote_request_id": "r", PARAMS_KEY: PUSH})
    assert p.request_id == "r"
    with pytest.raises(InvalidTransferParamsError, match=r"remote_request_id 'other' and kvcore\.request_id 'r'"):
        parse_params({"remote_request_id": "other", PARAMS_KEY: PUSH})


def test_params_must_be_a_mapping() -> None:
    with pytest.raises(InvalidTransferParamsError, match="expected a mapping"):
        parse_params({PARAMS_KEY: ["tcp://127.0.0.1:1"]})
    with pytest.raises(InvalidTransferParamsError, match="expected a mapping"):
        parse_params({})


def test_deeply_nested_params_are_a_typed_error() -> None:
    nested: Any = 1
    for _ in range(5000):
        nested = {"x": nested}
    with pytest.raises(InvalidTransferParamsError):
        parse_params({PARAMS_KEY: {**PUSH, "block_ids": nested}})


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (InvalidTransferParamsError("x"), LoadFailure.INVALID_PARAMS),
        (E.TicketError("x"), LoadFailure.TICKET_REFUSED),
        (E.LeaseExpiredError("x"), LoadFailure.LEASE_EXPIRED),
        (E.PeerLostError("x"), LoadFailure.PREFILL_LOST),
        (E.NotRegisteredError("x"), LoadFailure.PREFILL_LOST),
        (E.TransferFailedError("x"), LoadFailure.TRANSFER_FAILED),
        (E.TransferTimeoutError("x"), LoadFailure.TRANSFER_FAILED),
        (E.IncompatiblePeerError("x"), LoadFailure.REFUSED),
        (E.MappingError("x"), LoadFailure.REFUSED),
        (None, LoadFailure.REFUSED),
    ],
)
def test_every_kvcore_error_has_one_load_failure_reason(error: Any, reason: LoadFailure) -> None:
    assert classify_load_failure(error) is reason


def test_metrics_port_is_a_connector_option() -> None:
    assert connector_options({"metrics_port": 9400, "backend": "nixl"}).metrics_port == 9400
    assert connector_options({}).metrics_port is None
    for bad in (0, 70000, "9400", True):
        with pytest.raises(ConfigError, match="metrics_port"):
            connector_options({"metrics_port": bad})


def test_mode_option_defaults_to_pull(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.delenv("KVCORE_TRANSFER_MODE", raising=False)
    monkeypatch.delenv("KVCORE_CONFIG", raising=False)
    assert DEFAULT_MODE == "pull" and transceiver_config({}).transfer_mode == "pull"
    assert transceiver_config({"mode": "push"}).transfer_mode == "push"
    assert transceiver_config({"transfer_mode": "push"}).transfer_mode == "push"
    f = tmp_path / "kvcore.toml"
    f.write_text('transfer_mode = "push"\n')
    assert transceiver_config({"config_file": str(f)}).transfer_mode == "push"
    with pytest.raises(ConfigError, match="mode: expected 'pull' or 'push', got 'teleport'"):
        transceiver_config({"mode": "teleport"})
    monkeypatch.setenv("KVCORE_TRANSFER_MODE", "push")
    assert transceiver_config({}).transfer_mode == "push"


def test_options_are_transceiver_config_fields(tmp_path: Any) -> None:
    f = tmp_path / "kvcore.toml"
    f.write_text('backend = "shm"\nrequest_timeout_s = 5.0\n')
    c = transceiver_config({"config_file": str(f), "request_timeout_s": 7.5})
    assert c.backend == "shm" and c.request_timeout_s == 7.5
    with pytest.raises(ConfigError, match="bakend"):
        transceiver_config({"bakend": "nixl"})
    assert transceiver_role("kv_producer") == "context" and transceiver_role("kv_consumer") == "generation"
    with pytest.raises(ConfigError, match="kv_both"):
        transceiver_role("kv_both")


def _scheduler(model_dir: str, kv_role: str, policy: str = "fail") -> Any:
    import torch
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.structured_output import StructuredOutputManager

    vc = VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=512),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=512, max_model_len=512, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvcoreConnector",
            kv_connector_module_path="kvcore_vllm.connector",
            kv_role=kv_role,
            kv_load_failure_policy=policy,
        ),
        device_config=DeviceConfig("cpu"),
    )
    vc.cache_config.kv_cache_layout = "LBHNC"
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32)
    groups = get_kv_cache_groups(vc, {"model.layers.0.self_attn.attn": spec})
    kcc = get_kv_cache_config_from_groups(vc, groups, spec.page_size_bytes * 32)
    vc.cache_config.num_gpu_blocks = kcc.num_blocks
    return Scheduler(vc, kcc, StructuredOutputManager(vc), block_size=16)


def _request(rid: str, n: int, params: dict[str, Any] | None) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    r = Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=2), None)
    r.kv_transfer_params = params
    return r


def test_decode_scheduler_waits_for_remote_kv_with_good_params(model_dir: str) -> None:
    from vllm.v1.request import RequestStatus

    s = _scheduler(model_dir, "kv_consumer")
    s.add_request(_request("r", 40, {"do_remote_prefill": True, PARAMS_KEY: PULL}))
    so = s.schedule()
    assert so.total_num_scheduled_tokens == 0
    assert s.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    meta = so.kv_connector_metadata
    (recv,) = meta.recvs.values()
    assert len(recv.block_ids) == 3  # ceil(40 / 16) blocks for the remote tokens
    assert recv.params == PULL  # kvcore's parameters, as the router forwarded them
    assert not meta.expects  # allocated in the same step: nothing to announce


def test_decode_scheduler_expects_a_request_that_waits_for_blocks(model_dir: str) -> None:
    from vllm.v1.request import RequestStatus

    s = _scheduler(model_dir, "kv_consumer")
    big = TransferParams.make("big", "tcp://127.0.0.1:5555", prompt_len=400).to_dict()
    s.add_request(_request("big", 400, {"do_remote_prefill": True, PARAMS_KEY: big}))  # 25 of 31 blocks
    s.add_request(_request("r", 200, {"do_remote_prefill": True, PARAMS_KEY: {**PUSH, "prompt_len": 200}}))
    meta = s.schedule().kv_connector_metadata
    assert set(meta.recvs) == {"big"} and set(meta.expects) == {"r"}, (meta.recvs, meta.expects)
    assert s.requests["r"].status == RequestStatus.WAITING
    assert not s.schedule().kv_connector_metadata.expects  # announced once
    s.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    meta = s.schedule().kv_connector_metadata
    assert set(meta.drops) == {"r"}  # the worker turns the expectation into a release of the prefill


def test_decode_scheduler_computes_locally_with_bad_params_under_recompute(model_dir: str) -> None:
    """kv_load_failure_policy recompute: a full local prefill, and the worker is told why (it logs and counts)."""
    s = _scheduler(model_dir, "kv_consumer", policy="recompute")
    s.add_request(_request("r", 40, {"do_remote_prefill": True, PARAMS_KEY: {**PUSH, "ticket": "00"}}))
    so = s.schedule()
    meta = so.kv_connector_metadata
    assert so.num_scheduled_tokens == {"r": 40}  # a full local prefill, no load
    assert not meta.recvs and not meta.expects and not meta.fails
    assert set(meta.fallbacks) == {"r"} and "ticket" in meta.fallbacks["r"]
    assert not s.schedule().kv_connector_metadata.fallbacks  # said once


def test_decode_scheduler_fails_a_request_with_bad_params_under_fail(model_dir: str) -> None:
    """kv_load_failure_policy fail (vLLM's default): no local prefill; the worker reports the load failed."""
    from vllm.v1.request import RequestStatus

    s = _scheduler(model_dir, "kv_consumer", policy="fail")
    s.add_request(_request("r", 40, {"do_remote_prefill": True, PARAMS_KEY: {**PUSH, "version": 7}}))
    so = s.schedule()
    meta = so.kv_connector_metadata
    assert so.total_num_scheduled_tokens == 0
    assert s.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not meta.recvs and not meta.fallbacks
    (fail,) = meta.fails.values()
    assert len(fail.block_ids) == 3 and "version" in fail.error
