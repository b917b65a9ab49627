"""Transport metrics, registered on the process's one registry (passed in, never the global)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Handshakes on loopback take ~1 ms; across the Internet 1-3 RTT (10-300 ms).
_HANDSHAKE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# An idle loop reads within ~0.1 ms; a busy one can keep a socket waiting for milliseconds.
_READ_DELAY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05,
                       0.1, 0.25, 1.0)  # fmt: skip
# A deferred HTTP/3 transmit waits out the rest of its loop turn: microseconds to a millisecond.
_FLUSH_DELAY_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025,
                        0.005, 0.01, 0.025)  # fmt: skip
_GC_PAUSE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                     0.1, 0.25)  # fmt: skip


class TransportMetrics:
    """The transport's Prometheus series.

    ``quicedge_zero_rtt_total{result}``: ``accepted`` (0-RTT keys installed on a single-use
    ticket), ``replay_refused`` (ticket unknown, expired or already used: full handshake),
    ``rejected`` (the ticket store could not answer: full handshake, fail closed).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.zero_rtt = Counter(
            "quicedge_zero_rtt",
            "Resumption attempts with 0-RTT by outcome",
            ["result"],
            registry=registry,
        )
        for result in ("accepted", "rejected", "replay_refused"):
            self.zero_rtt.labels(result)
        self.cert_expiry = Gauge(
            "quicedge_tls_certificate_expiry_timestamp_seconds",
            "When the served certificate (the chain's leaf) expires, Unix seconds",
            registry=registry,
        )
        self.cert_reloads = Counter(
            "quicedge_tls_reloads",
            "Certificate reloads (SIGHUP, or changed files with cert_poll_interval) by outcome:"
            " applied, or refused (the files did not load; the old certificate stays)",
            ["outcome"],
            registry=registry,
        )
        for outcome in ("applied", "refused"):
            self.cert_reloads.labels(outcome)
        self.handshake_seconds = Histogram(
            "quicedge_handshake_seconds",
            "QUIC handshake duration, first datagram to handshake completion (server side)",
            buckets=_HANDSHAKE_BUCKETS,
            registry=registry,
        )
        self.handshakes = Counter(
            "quicedge_handshakes",
            "Completed QUIC handshakes",
            ["resumed"],
            registry=registry,
        )
        for resumed in ("true", "false"):
            self.handshakes.labels(resumed)
        self.ticket_store_errors = Counter(
            "quicedge_ticket_store_errors",
            "Ticket store operations that failed (resumption refused / ticket not kept)",
            ["op"],
            registry=registry,
        )
        self.address_tokens = Counter(
            "quicedge_quic_address_tokens",
            "Address-validation tokens (NEW_TOKEN) in new connections' Initials: accepted (the"
            " address is validated at once), replayed (accepted before) or invalid (expired,"
            " another address or key)",
            ["outcome"],
            registry=registry,
        )
        for outcome in ("accepted", "replayed", "invalid"):
            self.address_tokens.labels(outcome)
        self.stateless_resets = Counter(
            "quicedge_quic_stateless_resets",
            "Short-header datagrams of a connection this listener does not have: sent (answered"
            " with a stateless reset) or not_sent (too short to answer, or over the reset rate)",
            ["outcome"],
            registry=registry,
        )
        for outcome in ("sent", "not_sent"):
            self.stateless_resets.labels(outcome)
        self.qlog_traces = Counter(
            "quicedge_qlog_traces",
            "qlog traces of ended QUIC connections (--qlog-dir): written, dropped (too many"
            " waiting for the writer) or failed (the write raised)",
            ["outcome"],
            registry=registry,
        )
        for outcome in ("written", "dropped", "failed"):
            self.qlog_traces.labels(outcome)
        self.early_requests = Counter(
            "quicedge_early_requests",
            "Requests received in 0-RTT, by the early-data policy applied",
            ["action"],
            registry=registry,
        )
        self.early_data_expired = Counter(
            "quicedge_early_data_expired",
            "Requests accepted in 0-RTT and cancelled because their handshake did not complete"
            " within early_data_handshake_deadline (a replayed flight, or a vanished client)",
            registry=registry,
        )
        self.read_delay = Histogram(
            "quicedge_loop_read_delay_seconds",
            "How long a byte waits on a socket before this process's event loop reads it,"
            " sampled ~10 times a second (transport.read_delay): the wait before a request's or"
            " a token's read, which the per-request histograms start after",
            buckets=_READ_DELAY_BUCKETS,
            registry=registry,
        )
        self.gc_pauses = Histogram(
            "quicedge_gc_pause_seconds",
            "How long each garbage collection stopped this process (transport.gc_pauses), by"
            " generation: every request in flight waits it out",
            ["generation"],
            buckets=_GC_PAUSE_BUCKETS,
            registry=registry,
        )
        for generation in ("0", "1", "2"):
            self.gc_pauses.labels(generation)
        self.worker_starts = Gauge(
            "quicedge_worker_starts",
            "Times this worker's place among the serve's workers has been started: above 1, a"
            " worker there died and was started again",
            registry=registry,
        )
        self.h3_flush_delay = Histogram(
            "quicedge_h3_flush_delay_seconds",
            "HTTP/3 connections with several responses in flight send once per loop turn: from"
            " the first write a transmit waited for to that transmit (a chunk's wait after the"
            " relay handed it over, which the relay delay does not include)",
            buckets=_FLUSH_DELAY_BUCKETS,
            registry=registry,
        )
        self.connections_refused = Counter(
            "quicedge_connections_refused",
            "connections refused as they opened (TCP: closed as accepted; QUIC:"
            " CONNECTION_REFUSED): over the listener's cap (listener_cap) or one client"
            " address's (client_cap), or its rate of new connections (client_rate); or"
            " closed for resetting most of their requests (rapid_reset), for HTTP/2 control"
            " frames or HTTP/3 frames and streams that carry nothing, out of all proportion"
            " to their requests (control_flood), or, on HTTP/3, for a handshake not complete"
            " within handshake_timeout (handshake_timeout)",
            ["listener", "reason"],
            registry=registry,
        )
        self.requests_refused = Counter(
            "quicedge_requests_refused",
            "HTTP/1.1 requests answered with an error before the app saw them, by listener and"
            " status: malformed or ambiguous (400), a head or chunk framing too large (431), a"
            " transfer coding other than chunked (501), pipelined past the limit (503), a"
            " version other than 1.0 and 1.1 (505); cut-off ones (408) are request_timeouts",
            ["listener", "status"],
            registry=registry,
        )
        self.request_timeouts = Counter(
            "quicedge_request_timeouts",
            "Requests cut off (408, a close or a reset) because their head or body did not"
            " arrive within its deadline, or the client took none of the response within"
            " send_timeout (phase send)",
            ["listener", "phase"],
            registry=registry,
        )
        self.stream_errors = Counter(
            "quicedge_h3_stream_errors",
            "HTTP/3 requests refused by the transport",
            ["reason"],
            registry=registry,
        )
