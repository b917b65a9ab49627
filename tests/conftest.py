"""Suite-wide fixtures: a real Redis server and generated development certificates."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from certs import DevCertificates, ensure_dev_certificates
from tests.helpers import RedisServer


@pytest.fixture(scope="session")
def redis_server_url() -> Iterator[str]:
    """URL of a real Redis server.

    `make test` starts one and exports QUICEDGE_TEST_REDIS_URL. A bare `pytest` starts its own
    redis-server when the binary exists. Redis is mandatory to test, so its absence fails.
    Each process of a parallel run (pytest-xdist) starts its own: the edges the tests start use
    the default key prefixes and pub/sub channels (which no database number separates), and
    two tests' fleets must not hear each other's rollbacks and drains.
    """
    url = os.environ.get("QUICEDGE_TEST_REDIS_URL")
    if url and not os.environ.get("PYTEST_XDIST_WORKER"):
        yield url
        return
    try:
        server = RedisServer()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server_url: str) -> str:
    """The test Redis URL; tests isolate themselves with `redis_prefix`, not by flushing."""
    return redis_server_url


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix unique to one test, so tests can share one Redis in any order."""
    return f"quicedge-test:{uuid.uuid4().hex[:12]}:"


@pytest.fixture(scope="session")
def dev_certs(tmp_path_factory: pytest.TempPathFactory) -> DevCertificates:
    """A development PKI generated once per test session in a temporary folder."""
    return ensure_dev_certificates(Path(tmp_path_factory.mktemp("certs")))
