"""Transfer parameters, request keys, options, and the scheduler side on vLLM's real Scheduler (one process)."""

from __future__ import annotations

from typing import Any

import pytest
from kvcore_vllm.engine_api import PARAMS_KEY, InvalidTransferParamsError, TransferParams, request_key
from kvcore_vllm.options import transceiver_config, transceiver_role

from kvcore.errors import ConfigError, KvcoreError

GOOD = {"v": 1, "ctx_endpoint": "tcp://127.0.0.1:5555", "request_id": 2**64 - 1, "prompt_len": 40, "ctx_dp_rank": 0}


def test_params_round_trip_through_json() -> None:
    import json

    p = TransferParams.from_dict(json.loads(json.dumps(GOOD)))
    assert p.to_dict() == GOOD
    assert issubclass(InvalidTransferParamsError, KvcoreError)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"v": 2}, ".v"),
        ({"request_id": -1}, "request_id"),
        ({"request_id": 2**64}, "request_id"),
        ({"prompt_len": 0}, "prompt_len"),
        ({"ctx_endpoint": "http://x"}, "ctx_endpoint"),
        ({"ctx_endpoint": "tcp://" + "a" * 300 + ":1"}, "ctx_endpoint"),
        ({"ctx_dp_rank": -1}, "ctx_dp_rank"),
        ({"prompt_len": "40"}, "prompt_len"),
        ({"extra": 1}, "extra"),
    ],
)
def test_bad_params_name_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidTransferParamsError, match=field):
        TransferParams.from_dict({**GOOD, **change})


def test_params_must_be_a_mapping() -> None:
    with pytest.raises(InvalidTransferParamsError, match="expected a mapping"):
        TransferParams.from_dict(["tcp://127.0.0.1:1"])


def test_request_key_is_stable_64_bit_and_engine_scoped() -> None:
    k = request_key("engine-a", "cmpl-1")
    assert k == request_key("engine-a", "cmpl-1") and 0 <= k < 2**64
    assert k != request_key("engine-b", "cmpl-1")
    assert k != request_key("engine-a", "cmpl-2")


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


def _scheduler(model_dir: str, kv_role: str) -> Any:
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
            kv_connector="KvcoreConnector", kv_connector_module_path="kvcore_vllm.connector", kv_role=kv_role
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
    s.add_request(_request("r", 40, {"do_remote_prefill": True, PARAMS_KEY: GOOD}))
    so = s.schedule()
    assert so.total_num_scheduled_tokens == 0
    assert s.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    meta = so.kv_connector_metadata
    (recv,) = meta.recvs.values()
    assert len(recv.block_ids) == 3  # ceil(40 / 16) blocks for the remote tokens


def test_decode_scheduler_computes_locally_with_bad_params(model_dir: str) -> None:
    s = _scheduler(model_dir, "kv_consumer")
    s.add_request(_request("r", 40, {"do_remote_prefill": True, PARAMS_KEY: {**GOOD, "v": 99}}))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"r": 40}  # a full local prefill, no load
    assert not so.kv_connector_metadata.recvs
