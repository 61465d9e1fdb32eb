"""Command-line flags that reach a secured router, shared by `tandem generate` and `tandem bench`.

    add_client_flags(parser)             --token-file, --tls-ca, --tls-cert, --tls-key, ...
    TandemClient(address, **client_security(args))
"""
from __future__ import annotations

import argparse

import grpc

from tandem.common.security import read_token


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("reaching a secured router")
    group.add_argument("--token-file", metavar="FILE",
                       help="send 'authorization: Bearer <token in FILE>' (the router's "
                            "--auth-token-file)")
    group.add_argument("--tls-ca", metavar="PEM", help="CA that signs the router's certificate; "
                       "turns on TLS")
    group.add_argument("--tls-cert", metavar="PEM",
                       help="this client's certificate (the router requires one with TLS)")
    group.add_argument("--tls-key", metavar="PEM", help="private key for --tls-cert")
    group.add_argument("--tls-server-name", metavar="NAME",
                       help="name to expect in the router's certificate instead of its host")


def client_security(args: argparse.Namespace) -> dict:
    """TandemClient / AsyncTandemClient keyword arguments from add_client_flags' flags;
    ValueError naming the flag when a file cannot be read or a flag lacks its partner."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_cert is not None and args.tls_ca is None:
        raise ValueError("--tls-cert needs --tls-ca (the CA that signs the router)")
    for flag, path in (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert),
                       ("--tls-key", args.tls_key)):
        if path is not None:
            try:
                open(path, "rb").close()
            except OSError as exc:
                raise ValueError(f"{flag} {path}: {exc.strerror}") from None
    return dict(token=read_token(args.token_file, "--token-file"), tls_ca=args.tls_ca,
                tls_cert=args.tls_cert, tls_key=args.tls_key,
                tls_server_name=args.tls_server_name)


def describe_rpc_error(error: grpc.RpcError, address: str) -> str:
    """One line for a failed call; a router that cannot be reached gets a hint."""
    details = error.details() or ""
    if error.code() == grpc.StatusCode.UNAVAILABLE and "failed to connect" in details.lower():
        return (f"the router at {address} is not answering; is `tandem up` running? "
                f"(UNAVAILABLE: {details})")
    return f"{error.code().name}: {details}"
