"""`free_port` never gives one port twice in a process, and parallel test runners (pytest-xdist
workers) draw from slices of their own: a test's stand-in and its edge drew the same port now
and then, and the edge's workers failed with "Address already in use"."""

from __future__ import annotations

import pytest

from bench import children


def test_a_port_is_given_once() -> None:
    ports = [children.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


def test_each_parallel_runner_draws_from_its_own_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    slices = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(children._share())
    (low0, high0), (low1, high1) = slices
    assert high0 < low1 and high1 < children._EPHEMERAL_LOW
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    assert all(low1 <= children.free_port() <= high1 for _ in range(50))
