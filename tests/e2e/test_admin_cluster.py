"""The gRPC admin API on a real local cluster: `tandem admin` lists the workers, a policy switch
reaches the decode worker, a cancelled stream ends with finish_reason "abort" and frees the
worker, a drained prefill worker gets no jobs until it is undrained."""

import json
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest

from tandem.gateway.admin import pb, pb_grpc

pytestmark = pytest.mark.slow


def _admin_cli(cluster, *args) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "tandem", "admin", "--address", cluster.admin_address, *args],
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout, proc.stderr


def _wait(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def stub(cluster):
    with grpc.insecure_channel(cluster.admin_address) as channel:
        yield pb_grpc.AdminStub(channel)


def test_the_cli_lists_workers_and_switches_policies(cluster):
    code, out, err = _admin_cli(cluster, "workers")
    assert code == 0, err
    listed = json.loads(out)["workers"]
    assert {(w["role"], w["worker_id"]) for w in listed} == {("decode", "decode-0"), ("prefill", "prefill-0")}
    assert all(isinstance(w["num_total_blocks"], int) and w["num_total_blocks"] > 0 for w in listed)
    code, out, err = _admin_cli(cluster, "set-policy", "--capacity-scheduler-policy", "MAX_UTILIZATION")
    assert code == 0 and json.loads(out)["capacity_scheduler_policy"] == "MAX_UTILIZATION", err
    try:  # the decode worker re-reads it between steps and reports the policy it admits under
        assert _wait(lambda: cluster.worker("decode", "decode-0").capacity_scheduler_policy == "MAX_UTILIZATION")
    finally:
        assert _admin_cli(cluster, "set-policy", "--capacity-scheduler-policy", "GUARANTEED_NO_EVICT")[0] == 0
    code, _out, err = _admin_cli(cluster, "drain", "nobody")
    assert code == 1 and "NOT_FOUND" in err


def test_a_cancelled_stream_ends_with_abort(cluster, stub):
    body = {"model": cluster.settings.model_name, "prompt": "Count with me:", "max_tokens": 240,
            "temperature": 0.0, "stream": True, "ignore_eos": True}
    chunks = []
    with httpx.stream("POST", f"{cluster.base_url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                chunks.append("[DONE]")
                break
            chunks.append(json.loads(line[len("data: "):]))
            if len(chunks) == 1:
                assert stub.CancelRequest(pb.CancelRequestRequest(request_id=chunks[0]["id"])).worker_id == "decode-0"
    assert chunks[-1] == "[DONE]"
    assert chunks[-2]["choices"][0]["finish_reason"] == "abort"
    assert len(chunks) - 1 < 240  # it stopped early
    assert _wait(lambda: cluster.worker("decode", "decode-0").num_running == 0)
    with pytest.raises(grpc.RpcError) as info:  # it is gone
        stub.CancelRequest(pb.CancelRequestRequest(request_id=chunks[0]["id"]))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_drained_prefill_worker_gets_no_jobs_until_undrained(cluster, stub):
    assert stub.DrainWorker(pb.DrainWorkerRequest(worker_id="prefill-0")).draining
    time.sleep(1.0)  # the decode worker re-reads its peers every 0.5 s
    result = {}
    body = {"model": cluster.settings.model_name, "prompt": "Hello", "max_tokens": 4, "temperature": 0.0}
    thread = threading.Thread(target=lambda: result.update(
        response=httpx.post(f"{cluster.base_url}/v1/completions", json=body, timeout=60)))
    thread.start()
    thread.join(timeout=2.0)
    assert thread.is_alive() and "response" not in result  # waiting for a prefill worker that takes jobs
    assert not stub.UndrainWorker(pb.UndrainWorkerRequest(worker_id="prefill-0")).draining
    thread.join(timeout=30)
    assert result["response"].status_code == 200, result["response"].text
