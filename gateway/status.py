"""``tandem status``: the cluster at a glance, through a gateway's admin API.

    tandem status [--address host:port] [--token ...] [--tls-ca ...]

One line per live worker (role, model, load, KV blocks, restarts, drain state) and
the live policies; exits 1 when the admin API does not answer.
"""

from __future__ import annotations

import argparse
import sys

from tandem.gateway.admin_client import DEFAULT_ADDRESS, auth_metadata, open_channel

COLUMNS = ("worker", "role", "model", "running", "waiting", "free/total blocks", "restarts", "state")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tandem.cluster.settings import Settings

    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="a gateway's admin API (host:port)")
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--token", default=Settings.field_default("admin_token"),
                        help="the gateway's --admin-token (default: TANDEM_ADMIN_TOKEN)")
    parser.add_argument("--tls-ca")


def rows(workers) -> list[tuple[str, ...]]:
    out = []
    for w in sorted(workers, key=lambda w: (w.role, w.worker_id)):
        state = "drained" if w.drained else "draining" if w.draining else "serving"
        out.append((w.worker_id, w.role, w.model, str(w.num_running), str(w.num_waiting),
                    f"{w.num_free_blocks}/{w.num_total_blocks}", str(w.num_restarts), state))
    return out


def table(lines: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in [COLUMNS, *lines]) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                     for row in [COLUMNS, *lines])


def main(args: argparse.Namespace) -> int:
    import grpc

    from tandem.gateway.admin import pb, pb_grpc

    metadata = auth_metadata(args.token)
    try:
        with open_channel(args.address, args.tls_ca) as channel:
            stub = pb_grpc.AdminStub(channel)
            workers = stub.ListWorkers(pb.ListWorkersRequest(), timeout=args.timeout, metadata=metadata).workers
            policies = stub.GetPolicies(pb.GetPoliciesRequest(), timeout=args.timeout, metadata=metadata)
    except grpc.RpcError as exc:
        print(f"tandem status: {args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"tandem status: {exc}", file=sys.stderr)
        return 1
    print(table(rows(workers)))
    capacity = pb.CapacitySchedulerPolicy.Name(policies.capacity_scheduler_policy)
    chunking = pb.ContextChunkingPolicy.Name(policies.context_chunking_policy)
    print(f"\npolicies: capacity {capacity}, context chunking {chunking}")
    return 0
