"""Bytes on the wire: the QUIC/HTTP3 endpoint, TLS, session tickets, the TCP listener, workers."""
