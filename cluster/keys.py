"""Every Redis key and stream name tandem uses, in one place."""

PREFIX = "tandem"
GROUP = "workers"  # the consumer group on every inbox stream


def worker(role: str, worker_id: str) -> str:
    """Registry record of one worker (a string with a TTL: expiry = death)."""
    return f"{PREFIX}:worker:{role}:{worker_id}"


def worker_pattern(role: str) -> str:
    return f"{PREFIX}:worker:{role}:*"


def liveness(role: str, worker_id: str, started_at: float) -> str:
    """The pub/sub channel one run of a worker stays subscribed to while its process lives
    (``tandem.cluster.liveness``)."""
    return f"{PREFIX}:alive:{role}:{worker_id}:{started_at!r}"


def inbox(role: str, worker_id: str) -> str:
    """A worker's inbox stream (consumer group GROUP)."""
    return f"{PREFIX}:inbox:{role}:{worker_id}"


def prefix_index(worker_id: str) -> str:
    """Set of the chained block hashes a prefill worker's prefix cache holds (``tandem.cluster.prefix_index``)."""
    return f"{PREFIX}:prefix:{worker_id}"


def prefix_host_index(worker_id: str) -> str:
    """Set of the chained block hashes a prefill worker's host KV tier holds (``tandem.cluster.prefix_index``)."""
    return f"{PREFIX}:prefix-host:{worker_id}"



def gateway_output(gateway_id: str) -> str:
    """A gateway's output stream: TokenBatches for every request it submitted."""
    return f"{PREFIX}:out:gw:{gateway_id}"


GATEWAY_OUTPUT_MAXLEN = 100_000  # entries kept (approximately) in a gateway's output stream


def sse_log(request_id: str) -> str:
    """A resumable stream's events (a stream whose entry ids are ``0-<seq + 1>``; ``tandem.gateway.stream_log``)."""
    return f"{PREFIX}:sse:{request_id}:log"


def sse_request(request_id: str) -> str:
    """Hash of what a resumable stream's request needs to be continued by any gateway."""
    return f"{PREFIX}:sse:{request_id}:request"


def sse_lease(request_id: str) -> str:
    """The gateway producing a resumable stream (its id, with a TTL it renews while it streams)."""
    return f"{PREFIX}:sse:{request_id}:lease"


def admitted(worker_id: str) -> str:
    """Hash request_id -> tokens reserved on a decode worker by admission (``tandem.cluster.admission``)."""
    return f"{PREFIX}:admitted:{worker_id}"


def reserved_tokens(worker_id: str) -> str:
    """Sum of ``admitted(worker_id)``: tokens of a decode worker's pool promised to admitted requests."""
    return f"{PREFIX}:reserved:{worker_id}"


def policy() -> str:
    """Hash of live scheduling settings (capacity / chunking policy)."""
    return f"{PREFIX}:policy"


def draining(role: str) -> str:
    """Hash worker_id -> started_at of the workers of ``role`` that take no new requests
    (``tandem.cluster.draining``; the admin API's DrainWorker)."""
    return f"{PREFIX}:draining:{role}"


def lora_adapters() -> str:
    """Hash adapter name -> JSON record of every LoRA adapter the cluster serves
    (``tandem.cluster.lora_registry``)."""
    return f"{PREFIX}:lora:adapters"
