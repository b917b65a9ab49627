"""A backend's model, version and hardware group agree with its isolation-domain labels: the URL's
`#model=...&hardware=...` places it in a pool, `[[models.backends]]` and discovery relabel it,
and the circuit breakers' domains follow, so pools and breakers see the same model."""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry

from backends.backend import Backend
from backends.labels import model_label_of, parse_labels, split_model_label
from edge.models import ModelsConfig
from edge.models.catalog import ModelCatalog
from edge.models.config import BackendModel
from edge.models.pools import ModelPools
from edge.routing.breakers import BreakerConfig, Breakers
from tests.edge.conftest import client, fast_config, run_edge
from tests.edge.models.test_pools_e2e import chat, netloc, sim, sims


def labelled(fragment: str, name: str = "b") -> Backend:
    url, labels = parse_labels(f"http://{name}:1#{fragment}")
    return Backend(name=name, url=url, labels=labels)


def test_the_url_labels_are_the_model_version_and_hardware_group() -> None:
    b = labelled("model=llama@v2&hardware=h100")
    assert (b.model, b.model_version, b.hw_group) == ("llama", "v2", "h100")
    plain = labelled("model=llama3-v2")
    assert (plain.model, plain.model_version, plain.hw_group) == ("llama3-v2", None, "default")
    assert plain.labels == {"model": "llama3-v2"}
    none = labelled("")
    assert (none.model, none.model_version, none.hw_group, none.labels) == (
        None, None, "default", {},
    )  # fmt: skip
    none.set_model("m", "v3")
    none.set_hw_group("a100")
    assert none.labels == {"model": "m@v3", "hardware": "a100"}
    none.set_model("m", "default")  # SGLang's version of a server given none: no `@`
    assert none.labels["model"] == "m"
    assert split_model_label("m@v3") == ("m", "v3") and split_model_label("m") == ("m", None)
    assert model_label_of("m", None) == "m"


def test_models_config_relabels_and_the_breakers_follow() -> None:
    a = labelled("hardware=h200", "a")
    b = labelled("model=old", "b")
    breakers = Breakers(BreakerConfig().validate(), [a, b], registry=CollectorRegistry())
    first = breakers.started(b, "gold")
    assert first is not None and first.key == ("old", "gold", "default")
    breakers.release(first)
    config = ModelsConfig(
        backends=[BackendModel("http://a:1", model="m", version="v1"),
                  BackendModel("http://b:1", model="m", version="v2", hardware_group="a100")],
    )  # fmt: skip
    catalog = ModelCatalog(backends=[a, b], pool=None, ttl=60.0, timeout=1.0)
    ModelPools(config, backends=[a, b], catalog=catalog)
    # The config names no hardware group for `a`: its label's stays.
    assert (a.model, a.model_version, a.hw_group) == ("m", "v1", "h200")
    assert a.labels == {"model": "m@v1", "hardware": "h200"}
    assert (b.model, b.model_version, b.hw_group) == ("m", "v2", "a100")
    breakers.relabel()
    after = breakers.started(b, "gold")
    assert after is not None and after.key == ("m@v2", "gold", "a100")


async def test_a_labelled_backend_is_its_pool_and_a_discovered_one_moves_its_domain() -> None:
    async with sims(sim("alpha"), sim("beta", model_version="v2")) as (a, b):
        # `a` is labelled with another name and version than it reports: the label wins.
        config = fast_config([f"{a.url}#model=gamma@v7&hardware=h200", b.url])
        async with run_edge(config, breakers=BreakerConfig()) as edge, client(edge) as http:
            backends = {x.name: x for x in edge.wiring.registry.backends}
            ga, gb = backends[netloc(a)], backends[netloc(b)]
            assert (ga.model, ga.model_version, ga.hw_group) == ("gamma", "v7", "h200")
            # discovered at start: /v1/models' first card and /get_model_info's weight_version
            assert (gb.model, gb.model_version) == ("beta", "v2")
            assert gb.labels["model"] == "beta@v2"
            for model, server in (("gamma", a), ("beta", b)):
                r = await http.post("/v1/chat/completions", json=chat(model))
                assert r.status_code == 200, r.text
                assert r.headers["x-quicedge-backend"] == netloc(server)
            breakers = edge.wiring.breakers
            assert breakers is not None
            assert breakers.state_of("gamma@v7", "bronze", "h200") == "closed"
            assert breakers.state_of("beta@v2", "bronze", "default") == "closed"
            assert breakers.state_of("default", "bronze", "default") is None
            async with httpx.AsyncClient() as admin:
                shown = (await admin.get(edge.admin_url + "/backends")).json()
            labels = {x["name"]: x["labels"] for x in shown["backends"]}
            assert labels[netloc(b)] == {"model": "beta@v2"}
            assert {d["model"] for d in shown["breakers"]} >= {"gamma@v7", "beta@v2"}
