"""The nccl transport (gloo on the CPU) between hosts: each side's gloo device listens on an
address its peer reaches (the decode side on its endpoint's host, TANDEM_KV_HOST; the prefill
side on its own address on the route there), not on what the machine's hostname resolves to,
which is often loopback. Across a network namespace the blocks then land byte exact."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tandem.engine.kv_cache import KVCachePool
from tandem.kvtransfer.nccl import NcclTransport
from tandem.kvtransfer.nccl_pair import DECODE_RANK, PREFILL_RANK, gloo_address, local_address
from tests.e2e import netns

LAYOUT = dict(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
DST_BLOCK_IDS = [6, 1, 3]

# the prefill side, run in another network namespace: it writes three seeded blocks, then says how it went
SENDER = """
import json, sys, time
import torch
from tandem.kvtransfer import KVPoll, KVSender
from tandem.kvtransfer.nccl import NcclTransport
endpoint, dst = json.loads(sys.argv[1]), json.loads(sys.argv[2])
torch.manual_seed(7)
src = torch.randn(2, 2, 5, 4, 2, 8)
sender = KVSender(NcclTransport(timeout_s=10).connect(endpoint), dst)
sender.send_blocks(src, [4, 0, 2], 0)
sender.finish()
deadline = time.monotonic() + 30
while (status := sender.poll()) is KVPoll.TRANSFERRING and time.monotonic() < deadline:
    time.sleep(0.005)
print(json.dumps([status.value, sender.error]))
"""


def _non_loopback_address() -> str:
    try:
        address = local_address("198.51.100.1")  # any off-host address: the route out picks ours
    except OSError:
        pytest.skip("no route off this host")
    if address.startswith("127.") or address == "::1":
        pytest.skip("no address but loopback")
    return address


def test_the_decode_side_listens_on_its_endpoint_host():
    assert gloo_address(DECODE_RANK, "10.77.0.5") == "10.77.0.5"
    assert gloo_address(DECODE_RANK, "127.0.0.1") == "127.0.0.1"


def test_the_prefill_side_listens_on_its_address_towards_the_decode_host():
    assert gloo_address(PREFILL_RANK, "127.0.0.1") == "127.0.0.1"
    ours = _non_loopback_address()  # a decode host at this address: the route to it leaves from it
    assert gloo_address(PREFILL_RANK, ours) == ours


@pytest.mark.slow
def test_blocks_cross_a_network_namespace_byte_exact(tmp_path):
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"no network namespaces: {reason}")
    network = netns.Network(["prefill"])
    pool = KVCachePool(**LAYOUT, dtype=torch.float32)
    transport = NcclTransport(timeout_s=10, host=network.gateway_address)  # this process: the decode host
    try:
        endpoint = transport.export_pool(pool)
        sender = network.popen("prefill", [sys.executable, "-c", SENDER, json.dumps(endpoint),
                                           json.dumps(DST_BLOCK_IDS)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = sender.communicate(timeout=90)
        assert sender.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1]) == ["success", None], err[-3000:]
        torch.manual_seed(7)
        src = torch.randn(2, 2, 5, 4, 2, 8)
        for src_block, dst_block in zip([4, 0, 2], DST_BLOCK_IDS):
            assert torch.equal(pool.kv[:, :, dst_block], src[:, :, src_block]), dst_block
        untouched = [b for b in range(LAYOUT["num_blocks"]) if b not in DST_BLOCK_IDS]
        assert torch.count_nonzero(pool.kv[:, :, untouched]) == 0
    finally:
        transport.close()
        network.close()
