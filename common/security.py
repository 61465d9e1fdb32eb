"""TLS between every pair of Tandem processes, and the bearer token on the public API.

With --tls-cert/--tls-key/--tls-ca every server requires a client certificate signed by the CA
(mutual TLS) and every client presents its own and verifies the server's: a plaintext client
or one with an unknown certificate fails the handshake and gets no data. The router can also
require `authorization: Bearer <token>` on tandem.v1.Generate (health stays open for probes).
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

import grpc

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
                   ("grpc.max_send_message_length", 64 << 20)]


@dataclass(frozen=True, slots=True)
class TLSFiles:
    cert: bytes  # this process's certificate chain (PEM)
    key: bytes  # its private key (PEM)
    ca: bytes  # the CA that signs every peer's certificate (PEM)
    # Name to verify in peers' certificates instead of the dialled host. Peers are dialled by
    # IP (DNS discovery, KV handles), so in a cluster every certificate carries one shared name.
    server_name: str | None = None

    @classmethod
    def from_paths(cls, cert: str | None, key: str | None, ca: str | None,
                   server_name: str | None = None) -> TLSFiles | None:
        """None when no TLS flag is given; ValueError naming what is missing or unreadable."""
        given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
        if not any(given.values()):
            return None
        missing = [flag for flag, value in given.items() if not value]
        if missing:
            raise ValueError(f"TLS needs --tls-cert, --tls-key and --tls-ca; missing "
                             f"{', '.join(missing)}")
        contents = {}
        for flag, value in given.items():
            try:
                contents[flag] = Path(value).read_bytes()
            except OSError as exc:
                raise ValueError(f"{flag} {value}: {exc}") from exc
        return cls(contents["--tls-cert"], contents["--tls-key"], contents["--tls-ca"],
                   server_name)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def add_port(server, address: str, tls: TLSFiles | None) -> int:
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())


def open_channel(address: str, tls: TLSFiles | None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    options = list(CHANNEL_OPTIONS)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)


def read_token(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"--auth-token-file {path}: {exc}") from exc
    if not token:
        raise ValueError(f"--auth-token-file {path} is empty")
    return token


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to the protected services without `authorization: Bearer <token>`."""

    def __init__(self, token: str, protected_prefixes: tuple[str, ...]) -> None:
        self._expected = f"Bearer {token}".encode()
        self._protected = protected_prefixes

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._protected):
            return handler
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(given.encode(), self._expected):
            return handler
        return _refusal(handler)


def _refusal(handler):
    message = "missing or wrong bearer token (metadata 'authorization: Bearer <token>')"

    async def refuse_unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, as a server-streaming handler must be

    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            refuse_stream, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(
        refuse_unary, request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer)
