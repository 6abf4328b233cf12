"""``tandem admin``: the gRPC admin API (``gateway/admin.proto``) from the command line.

    tandem admin workers [--role decode]          live workers, with drain state
    tandem admin policies                         the cluster's live policies
    tandem admin set-policy --capacity-scheduler-policy MAX_UTILIZATION
    tandem admin drain decode-0 | undrain decode-0
    tandem admin cancel cmpl-...                  end a request (finish_reason "abort")
    tandem admin lora-load NAME PATH              check a PEFT LoRA adapter and serve it as NAME
    tandem admin lora-unload NAME                 serve it no more (running requests finish)
    tandem admin loras                            the LoRA adapters served

Prints the reply as JSON; a failed call prints its gRPC status and exits 1. A gateway
started with --admin-token needs the same token (``--token``, or better TANDEM_ADMIN_TOKEN:
a flag shows in ps); one with --admin-tls-cert needs ``--tls-ca`` (the PEM that signed it).
"""

from __future__ import annotations

import argparse
import json
import sys

from tandem.cluster.policies import CAPACITY_POLICY_NAMES, CHUNKING_POLICY_NAMES
from tandem.cluster.settings import Settings

DEFAULT_ADDRESS = "127.0.0.1:50051"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="a gateway's admin API (host:port)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    parser.add_argument("--token", default=Settings.field_default("admin_token"),
                        help="the gateway's --admin-token (default: TANDEM_ADMIN_TOKEN)")
    parser.add_argument("--tls-ca", help="PEM file of the CA (or self-signed certificate) the admin port's "
                                         "certificate is checked against: connect with TLS")
    sub = parser.add_subparsers(dest="admin_command", required=True)
    workers = sub.add_parser("workers", help="list live workers")
    workers.add_argument("--role", choices=["prefill", "decode"], default="")
    sub.add_parser("policies", help="show the live scheduling policies")
    policy = sub.add_parser("set-policy", help="switch policies for the whole cluster")
    policy.add_argument("--capacity-scheduler-policy", choices=CAPACITY_POLICY_NAMES)
    policy.add_argument("--context-chunking-policy", choices=CHUNKING_POLICY_NAMES)
    for name, text in (("drain", "send a worker no new requests"), ("undrain", "give a worker new requests again")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("worker_id")
        cmd.add_argument("--role", choices=["prefill", "decode"], default="")
    cancel = sub.add_parser("cancel", help="end a request")
    cancel.add_argument("request_id")
    load = sub.add_parser("lora-load", help="check a PEFT LoRA adapter against the model and serve it "
                                           "(gateways started with --enable-lora)")
    load.add_argument("name", help="what requests name as their model")
    load.add_argument("path", help="the adapter's directory, as every worker reads it")
    unload = sub.add_parser("lora-unload", help="serve a LoRA adapter to new requests no more")
    unload.add_argument("name")
    sub.add_parser("loras", help="list the LoRA adapters served")


def call(args: argparse.Namespace):
    """The reply message of the call ``args`` names (raises grpc.RpcError)."""

    from tandem.gateway.admin import pb, pb_grpc

    with open_channel(args.address, args.tls_ca) as channel:
        stub = pb_grpc.AdminStub(channel)
        command = args.admin_command
        call_args = {"timeout": args.timeout, "metadata": auth_metadata(args.token)}
        if command == "workers":
            return stub.ListWorkers(pb.ListWorkersRequest(role=args.role), **call_args)
        if command == "policies":
            return stub.GetPolicies(pb.GetPoliciesRequest(), **call_args)
        if command == "set-policy":
            return stub.SetPolicies(pb.SetPoliciesRequest(
                capacity_scheduler_policy=args.capacity_scheduler_policy or 0,
                context_chunking_policy=args.context_chunking_policy or 0), **call_args)
        if command == "drain":
            return stub.DrainWorker(pb.DrainWorkerRequest(worker_id=args.worker_id, role=args.role), **call_args)
        if command == "undrain":
            return stub.UndrainWorker(pb.UndrainWorkerRequest(worker_id=args.worker_id, role=args.role), **call_args)
        if command == "lora-load":
            return stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name=args.name, path=args.path), **call_args)
        if command == "lora-unload":
            return stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(name=args.name), **call_args)
        if command == "loras":
            return stub.ListLoraAdapters(pb.ListLoraAdaptersRequest(), **call_args)
        return stub.CancelRequest(pb.CancelRequestRequest(request_id=args.request_id), **call_args)


def open_channel(address: str, tls_ca: str | None = None):
    """A channel to a gateway's admin port: TLS checked against ``tls_ca`` (a PEM file) when given."""
    import grpc

    if tls_ca is None:
        return grpc.insecure_channel(address)
    with open(tls_ca, "rb") as f:
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=f.read()))


def auth_metadata(token: str | None) -> list[tuple[str, str]] | None:
    return [("authorization", f"Bearer {token}")] if token else None


def main(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    try:
        reply = call(args)
    except grpc.RpcError as exc:
        print(f"tandem admin: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except OSError as exc:  # --tls-ca unreadable
        print(f"tandem admin: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(MessageToDict(reply, always_print_fields_with_no_presence=True,
                                   preserving_proto_field_name=True), indent=2))
    return 0
