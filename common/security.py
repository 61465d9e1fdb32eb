"""TLS between every pair of Tandem processes, the bearer token on the public API, and the
internal token between the router and the workers.

With --tls-cert/--tls-key/--tls-ca every server requires a client certificate signed by the CA
(mutual TLS) and every client presents its own and verifies the server's: a plaintext client
or one with an unknown certificate fails the handshake and gets no data. The router can also
require `authorization: Bearer <token>` on tandem.v1.Generate. With --internal-token-file the
workers require `tandem-internal-token: <token>` on tandem.v1.Worker and tandem.v1.KVTransfer,
and every internal channel (open_channel with a token) sends it on each call. Health and
reflection stay open for probes.
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


INTERNAL_TOKEN_KEY = "tandem-internal-token"


def open_channel(address: str, tls: TLSFiles | None, token: str | None = None,
                 extra_options: tuple[tuple[str, int], ...] = ()) -> grpc.aio.Channel:
    """A channel to another Tandem process; with `token`, every call carries the internal
    token (INTERNAL_TOKEN_KEY metadata). `extra_options` are added grpc channel options."""
    interceptors = _metadata_interceptors(((INTERNAL_TOKEN_KEY, token),)) if token else None
    options = [*CHANNEL_OPTIONS, *extra_options]
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options,
                                   interceptors=interceptors)


def read_token(path: str | None, flag: str = "--auth-token-file") -> str | None:
    """The token in `path` (surrounding whitespace dropped), None without a path; ValueError
    naming `flag` when the file is unreadable or empty."""
    if path is None:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc}") from exc
    if not token:
        raise ValueError(f"{flag} {path} is empty")
    return token


class _AddsMetadata:
    """Adds fixed metadata to every call of a grpc.aio channel. A grpc.aio channel files each
    interceptor under the first call shape it implements, so each shape gets its own class."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _with_metadata(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._metadata)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                          details.credentials, details.wait_for_ready)


class _UnaryUnaryMetadata(_AddsMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._with_metadata(details), request)


class _UnaryStreamMetadata(_AddsMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._with_metadata(details), request)


class _StreamUnaryMetadata(_AddsMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._with_metadata(details), request_iterator)


class _StreamStreamMetadata(_AddsMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._with_metadata(details), request_iterator)


def _metadata_interceptors(metadata: tuple[tuple[str, str], ...]) -> list:
    return [shape(metadata) for shape in (_UnaryUnaryMetadata, _UnaryStreamMetadata,
                                          _StreamUnaryMetadata, _StreamStreamMetadata)]


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to the protected services unless metadata `key` equals `expected`
    (UNAUTHENTICATED); other services (health, reflection) pass."""

    def __init__(self, key: str, expected: str, protected_prefixes: tuple[str, ...]) -> None:
        self._key, self._expected = key, expected.encode()
        self._protected = protected_prefixes

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._protected):
            return handler
        given = dict(handler_call_details.invocation_metadata or ()).get(self._key, "")
        if hmac.compare_digest(given.encode(), self._expected):
            return handler
        return _refusal(handler, f"missing or wrong token (metadata '{self._key}')")


class BearerTokenInterceptor(TokenInterceptor):
    """Refuses calls to the protected services without `authorization: Bearer <token>`."""

    def __init__(self, token: str, protected_prefixes: tuple[str, ...]) -> None:
        super().__init__("authorization", f"Bearer {token}", protected_prefixes)


class InternalTokenInterceptor(TokenInterceptor):
    """Refuses calls to the protected services without the internal token."""

    def __init__(self, token: str, protected_prefixes: tuple[str, ...]) -> None:
        super().__init__(INTERNAL_TOKEN_KEY, token, protected_prefixes)


def _refusal(handler, message: str):
    """A handler of the same shape as `handler` that aborts with UNAUTHENTICATED (every
    protected RPC takes a single request message)."""

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
