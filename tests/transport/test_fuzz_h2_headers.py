"""Generated HTTP/2 request headers: whatever names and values a client sends (pseudo-headers
missing, repeated, unknown or misplaced, uppercase and connection-specific names, empty names,
control characters, any text), the request is answered or reset with PROTOCOL_ERROR, and the
connection goes on: a request already in flight on it and the next one are answered whole.
A `content-length` among them promises a body that never comes, or is not a number."""

from __future__ import annotations

import asyncio

import h2.errors
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from certs import DevCertificates
from tests.edge.fuzzing import FUZZ
from tests.transport.test_h2_malformed import sent_beside_a_request_in_flight
from transport.tls import TlsMaterial

BASE = [(":method", "GET"), (":path", "/x"), (":scheme", "https"), (":authority", "x")]
NAMES = st.one_of(
    st.sampled_from(
        [
            ":method",
            ":path",
            ":scheme",
            ":authority",
            ":status",
            ":protocol",
            "host",
            "te",
            "cookie",
            "x-a",
            "X-B",
            "connection",
            "upgrade",
            "transfer-encoding",
            "content-length",
            "",
            " x",
            "x y",
        ]
    ),  # fmt: skip
    st.text(max_size=12),
)
VALUES = st.one_of(
    st.sampled_from(
        ["GET", "POST", "/", "*", "https", "", " a", "a\r\nb", "trailers", "\0", "é", "0", "5"]
    ),
    st.text(max_size=20),
)


@settings(FUZZ, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(extra=st.lists(st.tuples(NAMES, VALUES), max_size=8), with_base=st.booleans())
def test_any_request_headers_leave_the_connection_serving(
    tls: TlsMaterial,
    dev_certs: DevCertificates,
    extra: list[tuple[str, str]],
    with_base: bool,
) -> None:
    fields = [(n.encode(), v.encode()) for n, v in (BASE + extra if with_base else extra)]
    assume(fields)  # python-h2 cannot send a HEADERS frame with no field at all

    code = asyncio.run(sent_beside_a_request_in_flight(tls, dev_certs, fields)).reset
    assert code in (None, h2.errors.ErrorCodes.PROTOCOL_ERROR)
