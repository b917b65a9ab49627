"""0-RTT over real sockets: early requests, single-use tickets, the per-route policy."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis

from tests.helpers import RedisServer, settled
from tests.transport.apps import RecordingApp
from tests.transport.conftest import H3Factory
from tests.transport.h3client import fresh_ticket, h3_connect
from tests.transport.udp_holdback import UdpHoldback
from transport.early_data import EarlyDataPolicy, Mode
from transport.h3_session import H3Limits
from transport.metrics import TransportMetrics
from transport.tickets import MemoryTicketStore, RedisTicketStore

INFERENCE = "/v1/chat/completions"


def counter(metrics: TransportMetrics, result: str) -> float:
    return metrics.zero_rtt.labels(result)._value.get()


async def test_early_request_answered_before_handshake_completes(
    h3_server: H3Factory, dev_certs
) -> None:
    app = RecordingApp()
    async with h3_server(app=app) as server:
        ticket = await fresh_ticket(server.port, dev_certs.ca_cert)
        # The ticket's own connection may linger on the server for a moment: look past it.
        earlier = set(server.connections())
        relay = UdpHoldback(server.port, hold_after_reply=True)
        port = await relay.start()
        try:
            async with h3_connect(
                port, dev_certs.ca_cert, ticket=ticket, wait_connected=False
            ) as client:
                sid = client.request("POST", INFERENCE, body=b'{"x": 1}')
                client.send_now()
                r = await client.wait(sid)
                # The client's Finished is held by the relay: the server's handshake has not
                # completed, yet the response arrived.
                await asyncio.wait_for(relay.holding.wait(), 10)
                resumed = [p for p in server.connections() if p not in earlier]
                assert len(resumed) == 1
                assert not resumed[0].session.handshake_complete
                assert r.status == 200
                assert json.loads(r.body)["early_data"] is True
                relay.release()
                await asyncio.wait_for(client.handshake_done.wait(), 10)
                assert client.handshake is not None
                assert client.handshake.early_data_accepted
                assert client.handshake.session_resumed
        finally:
            relay.close()
    assert app.seen[-1].extensions["early_data"] is True
    assert server.metrics is not None
    assert counter(server.metrics, "accepted") == 1


async def test_anti_amplification_before_address_validation(
    h3_server: H3Factory, dev_certs
) -> None:
    """RFC 9000 §8.1: until the client's address is validated the server sends at most 3x
    what it received; a large early response waits for the client's handshake flight."""
    async with h3_server(policy=EarlyDataPolicy({"/big": Mode.ACCEPT})) as server:
        ticket = await fresh_ticket(server.port, dev_certs.ca_cert)
        relay = UdpHoldback(server.port, hold_after_reply=True)
        port = await relay.start()
        try:
            async with h3_connect(
                port, dev_certs.ca_cert, ticket=ticket, wait_connected=False
            ) as client:
                sid = client.request("GET", "/big")
                client.send_now()
                await asyncio.wait_for(client.responses[sid].first_data.wait(), 10)
                # Until the server stops sending: what it sends before the client's
                # handshake flight reaches it is all it may send.
                await settled(lambda: relay.bytes_down)
                assert relay.bytes_down <= 3 * relay.bytes_up
                assert len(client.responses[sid].body) < 20_000
                relay.release()
                r = await client.wait(sid)
                assert len(r.body) == 20_000
        finally:
            relay.close()


async def _resume_early(port: int, ca, ticket) -> tuple[bool, dict]:
    """Resume with ``ticket`` sending a POST in 0-RTT; (early data accepted?, app's view)."""
    async with h3_connect(port, ca, ticket=ticket, wait_connected=False) as client:
        sid = client.request("POST", INFERENCE, body=b"{}")
        client.send_now()
        r = await client.wait(sid)
        await asyncio.wait_for(client.handshake_done.wait(), 10)
        assert client.handshake is not None
        assert r.status == 200
        return client.handshake.early_data_accepted, json.loads(r.body)


async def _assert_single_use(h3_server: H3Factory, ca, store) -> None:
    app = RecordingApp()
    async with h3_server(app=app, tickets=store) as server:
        ticket = await fresh_ticket(server.port, ca)
        accepted, view = await _resume_early(server.port, ca, ticket)
        assert accepted and view["early_data"] is True
        # The same ticket again: the store no longer has it, so no resumption and no 0-RTT;
        # the request is retransmitted after the full handshake and served as a normal one.
        accepted, view = await _resume_early(server.port, ca, ticket)
        assert not accepted
        assert view["early_data"] is False
    early = [s for s in app.seen if s.extensions["early_data"]]
    assert len(early) == 1
    assert server.metrics is not None
    assert counter(server.metrics, "accepted") == 1
    assert counter(server.metrics, "replay_refused") == 1


async def test_ticket_single_use_memory(h3_server: H3Factory, dev_certs) -> None:
    await _assert_single_use(h3_server, dev_certs.ca_cert, MemoryTicketStore())


async def test_ticket_single_use_redis(
    h3_server: H3Factory, dev_certs, redis_url: str, redis_prefix: str
) -> None:
    # (a second's timeout: the 50 ms default cools the store down after a 10 ms answer, which
    # a loaded host gives, and the take then fails as Redis down would)
    store = RedisTicketStore(redis_url, prefix=redis_prefix, timeout=1.0)
    try:
        await _assert_single_use(h3_server, dev_certs.ca_cert, store)
        # Each of the 3 handshakes stored a fresh ticket; the one used for 0-RTT is gone.
        keys = redis.Redis.from_url(redis_url).keys(redis_prefix + "*")
        assert len(keys) == 2
    finally:
        store.close()


async def test_redis_down_means_full_handshakes_still_served(
    h3_server: H3Factory, dev_certs, private_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """... and its failures are counted each, but warned of once in a while: two a handshake
    wrote 250 lines in 5 s."""
    store = RedisTicketStore(private_redis.url, cooldown=0.0)
    try:
        app = RecordingApp()
        async with h3_server(app=app, tickets=store) as server:
            ticket = await fresh_ticket(server.port, dev_certs.ca_cert)
            private_redis.stop()
            accepted, view = await _resume_early(server.port, dev_certs.ca_cert, ticket)
            assert not accepted
            assert view["early_data"] is False
            # And a client without a ticket is served as usual.
            async with h3_connect(server.port, dev_certs.ca_cert) as client:
                assert (await client.fetch("GET", "/echo")).status == 200
        assert server.metrics is not None
        assert counter(server.metrics, "accepted") == 0
        assert counter(server.metrics, "rejected") == 1
        assert server.metrics.ticket_store_errors.labels("take")._value.get() == 1
        assert server.metrics.ticket_store_errors.labels("put")._value.get() >= 1
        warned = [r for r in caplog.records if "ticket store failures" in r.getMessage()]
        assert len(warned) == 1
    finally:
        store.close()


async def test_defer_holds_request_until_handshake(h3_server: H3Factory, dev_certs) -> None:
    app = RecordingApp()
    policy = EarlyDataPolicy({INFERENCE: Mode.DEFER}, Mode.DEFER)
    async with h3_server(app=app, policy=policy) as server:
        ticket = await fresh_ticket(server.port, dev_certs.ca_cert)
        calls = len(app.seen)
        relay = UdpHoldback(server.port, hold_after_reply=True)
        port = await relay.start()
        try:
            async with h3_connect(
                port, dev_certs.ca_cert, ticket=ticket, wait_connected=False
            ) as client:
                sid = client.request("POST", INFERENCE, body=b"{}")
                client.send_now()
                await asyncio.wait_for(client.handshake_done.wait(), 10)
                await asyncio.wait_for(relay.holding.wait(), 10)  # its Finished is held
                # Until the server stops sending: an app it wrongly called would be answering.
                await settled(lambda: relay.bytes_down)
                assert len(app.seen) == calls, "deferred request reached the app early"
                relay.release()
                r = await client.wait(sid)
        finally:
            relay.close()
    assert r.status == 200
    view = json.loads(r.body)
    assert view["early_data"] is False
    assert view["handshake_wait_s"] >= 0.5  # at least settled()'s quiet time
    assert server.metrics is not None
    assert server.metrics.early_requests.labels("defer")._value.get() == 1


async def test_reject_answers_425_without_app(h3_server: H3Factory, dev_certs) -> None:
    app = RecordingApp()
    policy = EarlyDataPolicy({}, Mode.REJECT)
    async with h3_server(app=app, policy=policy) as server:
        ticket = await fresh_ticket(server.port, dev_certs.ca_cert)
        calls = len(app.seen)
        async with h3_connect(
            server.port, dev_certs.ca_cert, ticket=ticket, wait_connected=False
        ) as client:
            r = await client.fetch("POST", INFERENCE, body=b"{}")
            assert r.status == 425
            # After the handshake the same request is served (RFC 8470 §5.2: retry).
            await asyncio.wait_for(client.handshake_done.wait(), 10)
            again = await client.fetch("POST", INFERENCE, body=b"{}")
            assert again.status == 200
    assert [s.path for s in app.seen[calls:]] == [INFERENCE]
    assert app.seen[-1].extensions["early_data"] is False


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
async def test_default_policy_accepts_inference_routes(
    h3_server: H3Factory, dev_certs, path: str
) -> None:
    async with h3_server() as server:
        ticket = await fresh_ticket(server.port, dev_certs.ca_cert)
        async with h3_connect(
            server.port, dev_certs.ca_cert, ticket=ticket, wait_connected=False
        ) as client:
            r = await client.fetch("POST", path, body=b"{}")
    assert json.loads(r.body)["early_data"] is True


DEADLINE = H3Limits(early_data_handshake_deadline=0.5)
HOLD_EARLY = EarlyDataPolicy({"/hold": Mode.ACCEPT, "/stream": Mode.ACCEPT})


async def test_early_request_cancelled_when_the_handshake_never_completes(
    h3_server: H3Factory, dev_certs
) -> None:
    """A client that sends its request in 0-RTT and then goes silent (the relay drops all it
    sends after the server's first reply) never completes the handshake: past the deadline the
    app sees `http.disconnect` and the client a reset stream."""
    app = RecordingApp()
    async with h3_server(app=app, policy=HOLD_EARLY, limits=DEADLINE) as server:
        ticket = await fresh_ticket(server.port, dev_certs.ca_cert)
        earlier = set(server.connections())
        relay = UdpHoldback(server.port, hold_after_reply=True)
        port = await relay.start()
        try:
            async with h3_connect(
                port, dev_certs.ca_cert, ticket=ticket, wait_connected=False
            ) as client:
                sid = client.request("GET", "/hold")
                client.send_now()
                assert await asyncio.wait_for(app.disconnects.get(), 10) == "/hold"
                r = await client.wait(sid)
                assert r.reset_code == 0x10C  # H3_REQUEST_CANCELLED
                (silent,) = [p for p in server.connections() if p not in earlier]
                assert not silent.session.handshake_complete
                assert relay.holding.is_set()
        finally:
            relay.close()
    assert app.seen[-1].extensions["early_data"] is True
    assert server.metrics is not None
    assert server.metrics.early_data_expired._value.get() == 1


async def test_early_request_outlives_the_deadline_once_the_handshake_completes(
    h3_server: H3Factory, dev_certs
) -> None:
    app = RecordingApp()
    async with h3_server(app=app, policy=HOLD_EARLY, limits=DEADLINE) as server:
        ticket = await fresh_ticket(server.port, dev_certs.ca_cert)
        async with h3_connect(
            server.port, dev_certs.ca_cert, ticket=ticket, wait_connected=False
        ) as client:
            sid = client.request("GET", "/stream?n=2")
            client.send_now()
            await asyncio.wait_for(client.handshake_done.wait(), 10)
            app.release.put_nowait(None)
            await asyncio.wait_for(client.responses[sid].first_data.wait(), 10)
            # Well past the deadline: a request whose handshake completed is not cancelled.
            await asyncio.sleep(4 * DEADLINE.early_data_handshake_deadline)
            app.release.put_nowait(None)
            r = await client.wait(sid)
    assert (r.status, r.body, r.reset_code) == (200, b"0;1;", None)
    assert app.seen[-1].extensions["early_data"] is True
    assert server.metrics is not None
    assert server.metrics.early_data_expired._value.get() == 0


def test_the_deadline_is_a_serve_setting() -> None:
    from edge import serve

    args = serve.build_parser().parse_args(["--demo"])
    loaded = serve.load_settings(args, {}, toml={"serve": {"early_data_handshake_deadline": 0.75}})
    assert serve.transport_config(loaded).limits.early_data_handshake_deadline == 0.75
    with pytest.raises(ValueError, match="early_data_handshake_deadline"):
        serve.load_settings(args, {}, toml={"serve": {"early_data_handshake_deadline": 0}})
