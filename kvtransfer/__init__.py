"""KV-cache handoff from prefill workers to decode workers.

Roles are split (the prefill worker builds only senders, the decode worker
only receivers) and every stage of a handoff is a ``KVPoll`` status read with
``poll()``, so neither worker loop ever blocks on a transfer.

Transports (``get_transport(name)``):
    shm       the decode worker's pool lives in a /dev/shm file the prefill
              worker maps; CPU, one host (tests, CI, CPU serving).
"""

from kvtransfer.base import KVPoll, Transport, get_transport
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender

__all__ = ["KVPoll", "KVReceiver", "KVSender", "Transport", "get_transport"]
