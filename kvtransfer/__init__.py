"""KV-cache handoff from prefill workers to decode workers.

Roles are split (the prefill worker builds only senders, the decode worker
only receivers) and every stage of a handoff is a ``KVPoll`` status read with
``poll()``, so neither worker loop ever blocks on a transfer.

Transports (``get_transport(name)``):
    shm       the decode worker's pool lives in a /dev/shm file the prefill
              worker maps; CPU, one host (tests, CI, CPU serving).
    cuda_ipc  the decode worker's GPU pool mapped into the prefill worker; one host.
    nccl      point-to-point pushes over a two-rank process group per
              prefill/decode pair (NCCL between GPUs, gloo between CPU pools);
              the decode side receives in a background thread and acks each chunk.
"""

from tandem.kvtransfer.base import KVPoll, Transport, get_transport
from tandem.kvtransfer.receiver import KVReceiver
from tandem.kvtransfer.sender import KVSender

__all__ = ["KVPoll", "KVReceiver", "KVSender", "Transport", "get_transport"]
