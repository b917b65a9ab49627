"""Backend URLs: what a `--backend` URL may be, and that a secret in one never gets further."""

from __future__ import annotations

import pytest

from backends.pool import UpstreamPool
from backends.registry import BackendRegistry
from edge.config import ProxyConfig


def config_error(*urls: str) -> str:
    with pytest.raises(ValueError) as caught:
        ProxyConfig(backends=list(urls)).validate()
    return str(caught.value)


def registry_error(*urls: str) -> str:
    with pytest.raises(ValueError) as caught:
        BackendRegistry(list(urls), pool=None)
    return str(caught.value)


SECRET = "s3cr3t-pass"


@pytest.mark.parametrize(
    "url",
    [
        f"http://user:{SECRET}@127.0.0.1:8000",
        f"http://{SECRET}@127.0.0.1:8000/",
        f"http://user:{SECRET}@127.0.0.1:8000#model=llama",
        f"http://user:{SECRET}@127.0.0.1:8000#bad-label",
        f"ftp://user:{SECRET}@127.0.0.1:8000",
    ],
)
def test_credentials_in_a_backend_url_are_refused_without_showing_them(url: str) -> None:
    for message in (config_error(url), registry_error(url)):
        assert SECRET not in message
        assert "user:" not in message


@pytest.mark.parametrize("cut", ["#", "/", "?", "&"])
def test_a_password_with_a_delimiter_in_it_is_not_shown_either(cut: str) -> None:
    first, second = SECRET[:5], SECRET[5:]
    url = f"http://user:{first}{cut}{second}@127.0.0.1:8000"
    for message in (config_error(url), registry_error(url)):
        assert first not in message and second not in message, message
        assert "backend_api_key_file" in message
    assert "backend_api_key_file" in config_error(f"http://user:{SECRET}@127.0.0.1:8000")


async def test_a_backend_added_at_run_time_with_credentials_is_refused() -> None:
    registry = BackendRegistry(["http://127.0.0.1:8000"], pool=None)
    with pytest.raises(ValueError) as caught:
        registry.add(f"http://user:{SECRET}@127.0.0.1:8001")
    assert SECRET not in str(caught.value)
    assert "backend_api_key_file" in str(caught.value)
    assert [b.name for b in registry.backends] == ["127.0.0.1:8000"]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://127.0.0.1:99999", "port"),
        ("http://127.0.0.1:0", "port"),
        ("http://127.0.0.1:http", "port"),
        ("http://127.0.0.1:8000?x=1", "query"),
        ("http://127.0.0.1:8000/v1", "path"),
        ("https://127.0.0.1:8000", "https"),
        ("http://::1:8000", "brackets"),
    ],
)
def test_bad_backend_urls_are_refused_at_validation(url: str, says: str) -> None:
    assert says in config_error(url)
    assert says in registry_error(url)


@pytest.mark.parametrize(
    "pair",
    [
        ("http://HOST.example:8000", "http://host.example:8000"),
        ("http://10.0.0.5", "http://10.0.0.5:80"),
        ("http://10.0.0.5:8000", "http://10.0.0.5:08000"),
        ("http://[::1]:8000", "http://[0:0::1]:8000/"),
    ],
)
def test_one_backend_under_two_spellings_is_refused(pair: tuple[str, str]) -> None:
    assert "twice" in config_error(*pair)
    assert "twice" in registry_error(*pair)


async def test_a_second_spelling_added_at_run_time_is_refused() -> None:
    registry = BackendRegistry(["http://10.0.0.5:8000"], pool=None)
    with pytest.raises(ValueError, match="already"):
        registry.add("http://10.0.0.5:08000")
    assert len(registry.backends) == 1


@pytest.mark.parametrize(
    ("url", "name"),
    [
        ("http://[::1]:8000", "[::1]:8000"),
        ("http://[::1]", "[::1]"),
        ("http://127.0.0.1:8000/", "127.0.0.1:8000"),
        ("http://127.0.0.1:8000//", "127.0.0.1:8000"),
    ],
)
def test_good_backend_urls_pass(url: str, name: str) -> None:
    ProxyConfig(backends=[url]).validate()
    assert BackendRegistry([url], pool=None).backends[0].name == name


async def test_an_ipv6_backend_without_a_port_is_reached_on_port_80() -> None:
    pool = UpstreamPool()
    try:
        assert pool._host("http://[::1]").port == 80
    finally:
        await pool.aclose()


def test_credentials_in_a_dns_discovery_name_are_refused_without_showing_them() -> None:
    from backends.discovery import DiscoveryConfig

    with pytest.raises(ValueError) as caught:
        DiscoveryConfig(mode="dns", names=[f"user:{SECRET}@sglang.internal:30000"]).validate()
    assert SECRET not in str(caught.value)
    assert "backend_api_key_file" in str(caught.value)


async def test_a_backend_both_listed_and_found_under_another_spelling_is_one_backend() -> None:
    from backends.discovery import Discovery, DiscoveryConfig, DnsSource
    from tests.deploy.dns_server import dns_server

    with dns_server() as (zone, server):
        zone.set("sglang.fleet.test", "A", ["127.0.0.1"])
        zone.set("sglang.fleet.test", "AAAA", ["::1"])
        config = DiscoveryConfig(
            mode="dns", names=["sglang.fleet.test:30000"], nameservers=[server]
        ).validate()
        discovery = Discovery(config, DnsSource(config))
        urls = await discovery.initial(["http://[0:0:0:0:0:0:0:1]:30000/"])
    registry = BackendRegistry(urls, pool=None)
    assert sorted(b.url for b in registry.backends) == [
        "http://127.0.0.1:30000",
        "http://[0:0:0:0:0:0:0:1]:30000",
    ]


@pytest.mark.parametrize("name", ["sglang.internal:0", "sglang.internal:65536", "sglang.internal"])
def test_a_dns_name_without_a_usable_port_is_refused(name: str) -> None:
    from backends.discovery import DiscoveryConfig

    with pytest.raises(ValueError, match="is not HOST:PORT"):
        DiscoveryConfig(mode="dns", names=[name]).validate()


@pytest.mark.parametrize("cut", ["", "#", "/", "?"])
def test_a_key_file_named_by_a_url_with_credentials_is_refused_without_them(
    tmp_path: object, cut: str
) -> None:
    from pathlib import Path

    from backends.credentials import BackendCredentials

    key = Path(str(tmp_path)) / "key"
    key.write_text("k")
    first, second = SECRET[:5], SECRET[5:]
    with pytest.raises(ValueError) as caught:
        BackendCredentials.from_files(None, {f"http://u:{first}{cut}{second}@h:1": str(key)})
    assert first not in str(caught.value) and second not in str(caught.value)
    assert "proxy.backend_api_key_files" in str(caught.value)
