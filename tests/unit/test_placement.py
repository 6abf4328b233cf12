"""Where `tandem serve` puts its workers on the GPUs."""

import pytest

from tandem.placement import plan


def test_cpu_and_one_gpu_keep_everything_together():
    for gpus, device in ((0, "auto"), (1, "auto"), (4, "cpu"), (4, "cuda:1")):
        placements = plan(gpus, device, "auto", 1, 1)
        assert [(p.role, p.env, p.kv_transport) for p in placements] == [("prefill", {}, None), ("decode", {}, None)]


def test_auto_pools_run_one_worker_for_both_where_they_would_share_a_device(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for gpus, device in ((0, "auto"), (1, "auto"), (4, "cpu"), (4, "cuda:1")):
        assert [(p.role, p.env) for p in plan(gpus, device, "auto", 1, 1, "auto")] == [("colocated", {})]
    assert [p.role for p in plan(2, "auto", "auto", 1, 1, "auto")] == ["prefill", "decode"]  # a device each
    assert [p.role for p in plan(1, "auto", "auto", 1, 1, "separate")] == ["prefill", "decode"]
    forced = plan(2, "auto", "auto", 1, 2, "colocated")
    assert [(p.role, p.env["CUDA_VISIBLE_DEVICES"]) for p in forced] == [("colocated", "0"), ("colocated", "1")]


def test_two_gpus_split_prefill_and_decode_and_use_nccl(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    prefill, decode = plan(2, "auto", "auto", 1, 1)
    assert (prefill.role, prefill.env, prefill.kv_transport) == ("prefill", {"CUDA_VISIBLE_DEVICES": "0"}, "nccl")
    assert (decode.role, decode.env, decode.kv_transport) == ("decode", {"CUDA_VISIBLE_DEVICES": "1"}, "nccl")


def test_explicit_transport_wins_and_visible_devices_are_respected(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    placements = plan(4, "cuda", "cuda_ipc", 2, 3)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in placements] == ["4", "5", "6", "7", "6"]
    assert all(p.kv_transport is None for p in placements)


def test_a_split_model_s_worker_gets_a_gpu_per_rank(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    workers = plan(4, "auto", "auto", 1, 2, "auto", tp_size=2)  # auto: a split model's pools are colocated
    assert [(p.role, p.env) for p in workers] == [("colocated", {"CUDA_VISIBLE_DEVICES": "0,1"}),
                                                   ("colocated", {"CUDA_VISIBLE_DEVICES": "2,3"})]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    assert plan(2, "auto", "auto", 1, 1, "auto", tp_size=2)[0].env == {"CUDA_VISIBLE_DEVICES": "5,7"}
    with pytest.raises(ValueError, match="need 4 GPUs; 2 are visible"):
        plan(2, "auto", "auto", 1, 2, "auto", tp_size=2)
    assert [(p.role, p.env) for p in plan(0, "cpu", "auto", 1, 1, "auto", tp_size=2)] == [("colocated", {})]
