"""The one HTTP client of the end-to-end tests and the benchmarks.

Every ordinary request goes through ``request()`` (httpx): a fresh connection per request by
default, as a client retrying after a failure would open, or a ``session()`` to keep one.
Header values may be bytes, sent byte for byte, and headers may be a list of pairs to repeat
a name: the filter's answers to malformed and repeated headers are part of what is tested.

``RawExchange`` is for the few tests that must hold the socket themselves: hang up with a
reset while Envoy still answers, or shrink the receive buffer so Envoy cannot write the
whole response. h11, the HTTP/1.1 codec under httpx, writes the request and reads the
response; the test only owns the socket.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from dataclasses import dataclass
from typing import Iterable, Mapping, Union

import h11
import httpx

TIMEOUT = 20.0

Response = httpx.Response
Session = httpx.Client
# What a request that never got an answer raises (refused, reset, timed out).
HTTPError = httpx.HTTPError
Headers = Union[Mapping[str, Union[str, bytes]], Iterable[tuple[str, Union[str, bytes]]]]

# A client loads the CA bundle when built (tens of milliseconds, enough to skew a burst of
# concurrent requests); all share this one. Everything here is plain HTTP on loopback.
_TLS = ssl.create_default_context()


def session(timeout: float = TIMEOUT) -> Session:
    """A client that keeps its connections between requests; close it when done."""
    return httpx.Client(verify=_TLS, timeout=timeout)


def request(
    method: str,
    url: str,
    *,
    body: bytes | str | None = None,
    headers: Headers | None = None,
    params: Mapping[str, str] | None = None,
    timeout: float = TIMEOUT,
    client: Session | None = None,
) -> Response:
    """One request, its body read whole; on ``client`` if given, else on a new connection."""
    if client is not None:
        return client.request(method, url, content=body, headers=headers, params=params, timeout=timeout)
    with session(timeout) as fresh:
        return fresh.request(method, url, content=body, headers=headers, params=params)


def get(url: str, **kwargs) -> Response:
    return request("GET", url, **kwargs)


def post(url: str, **kwargs) -> Response:
    return request("POST", url, **kwargs)


# --------------------------------------------------------------------------
# a socket the test holds
# --------------------------------------------------------------------------


@dataclass
class Head:
    status: int
    headers: dict[str, str]  # lower-case names


class RawExchange:
    """One HTTP/1.1 request written on a socket the caller keeps (sent on construction).

    ``recv_buffer`` shrinks SO_RCVBUF first, so a large response stalls in Envoy instead of
    landing in this process's kernel buffer. ``body_bytes_sent`` writes only that many bytes
    of the body (its content-length still announces all of it), so the request stays
    unfinished: a client that dies in the middle of its upload.
    """

    def __init__(
        self,
        host: str,
        port: int,
        method: str,
        target: str,
        headers: Iterable[tuple[str, str | bytes]],
        body: bytes = b"",
        *,
        timeout: float = 10.0,
        recv_buffer: int | None = None,
        body_bytes_sent: int | None = None,
    ) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        if recv_buffer is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, recv_buffer)
        self._h11 = h11.Connection(h11.CLIENT)
        # h11 frames the body by the content-length it is given.
        headers = [*headers, ("content-length", str(len(body)))]
        out = self._h11.send(h11.Request(method=method, target=target, headers=headers))
        if body_bytes_sent is not None:
            out += self._h11.send(h11.Data(data=body[:body_bytes_sent]))
        else:
            if body:
                out += self._h11.send(h11.Data(data=body))
            out += self._h11.send(h11.EndOfMessage())
        self.sock.sendall(out)

    def _next(self, deadline: float) -> h11.Event:
        while True:
            event = self._h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no complete answer in time")
            self.sock.settimeout(remaining)
            self._h11.receive_data(self.sock.recv(65536))

    def read_head(self, timeout: float) -> Head:
        """Waits for the status line and headers (1xx answers skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            event = self._next(deadline)
            if isinstance(event, h11.Response):
                return Head(event.status_code, {k.decode(): v.decode("latin-1") for k, v in event.headers})
            if isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("closed before the response head")

    def read_body(self, timeout: float) -> bytes:
        """The rest of the response body, after ``read_head``."""
        deadline = time.monotonic() + timeout
        body = b""
        while True:
            event = self._next(deadline)
            if isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return body
            else:
                raise ConnectionError(f"{type(event).__name__} before the end of the body")

    def abort(self) -> None:
        """Closes with RST (SO_LINGER 0), the way a crashed client or a killed pod goes away."""
        if self.sock.fileno() != -1:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.sock.close()

    def __enter__(self) -> "RawExchange":
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()
