"""Between the workers of one `serve`: a transition one worker's ramp takes is handed to the
others (`edge.worker_admin`), here two in-process edges with their real admin sockets."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from edge.fleet_metrics import FleetPlan
from edge.models import ModelsConfig
from edge.worker_admin import WorkerAdmin, call
from tests.edge.conftest import Edge, fast_config, run_edge
from tests.edge.models.test_pools_e2e import sim, sims
from tests.edge.models.test_rollout_e2e import rollout
from tests.helpers import wait_until


@contextlib.asynccontextmanager
async def workers(edges: list[Edge], directory: Path) -> AsyncIterator[list[WorkerAdmin]]:
    plan = FleetPlan(str(directory), len(edges))
    admins = [
        WorkerAdmin(plan.for_worker(i), e.wiring.admin_app, models=e.wiring.models)
        for i, e in enumerate(edges)
    ]
    for admin in admins:
        await admin.start()
    try:
        yield admins
    finally:
        for admin in admins:
            await admin.aclose()


async def test_a_worker_does_not_take_what_another_canary_version_went_through(
    tmp_path: Path,
) -> None:
    """A reload reaches the workers one by one: worker 0 still ramps canary v2 while worker 1
    was given v3. What v2's ramp goes through (an advance, a pause) says nothing of v3; once
    worker 0 has v3 too, its advance is followed."""
    async with sims(
        sim("m", model_version="v1"), sim("m", model_version="v2"), sim("m", model_version="v3")
    ) as (s1, s2, s3):
        config = fast_config([s1.url, s2.url, s3.url])
        steps = {"steps": [5.0, 50.0, 100.0]}
        old = ModelsConfig(rollouts=[rollout(**steps)])
        new = ModelsConfig(rollouts=[rollout(canary="v3", **steps)])
        async with (
            run_edge(config, models=old) as w0,
            run_edge(config, models=new) as w1,
            workers([w0, w1], tmp_path) as (a0, _),
        ):
            first, second = w0.wiring.models, w1.wiring.models
            first.ramps["m"].promote()
            first.ramps["m"].pause()
            await wait_until(lambda: not a0._tasks)  # both handed over, and answered
            follower = second.ramps["m"]
            assert [t.action for t in follower.history] == [], follower.snapshot()
            assert (follower.rollout.state, follower.step, follower.rollout.percent) == (
                "ramping", 0, 5.0,
            )  # fmt: skip
            await first.reconfigure(new)  # the reload reaches worker 0
            first.ramps["m"].promote()
            await wait_until(lambda: second.ramps["m"].step == 1)
            assert second.ramps["m"].rollout.percent == 50.0


async def test_a_worker_does_not_take_an_advance_through_steps_it_was_not_given(
    tmp_path: Path,
) -> None:
    """A reload that keeps both versions and changes the steps reaches the workers one by one:
    worker 0 still ramps through [5, 50, 100], worker 1 was given [5, 10, 20, 50, 100]. Worker
    0's step 1 (50 %) is not worker 1's step 1 (10 %): it is not taken; once worker 0 has the
    new steps too, its advance is followed."""
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
        config = fast_config([s1.url, s2.url])
        old = ModelsConfig(rollouts=[rollout(steps=[5.0, 50.0, 100.0])])
        new = ModelsConfig(rollouts=[rollout(steps=[5.0, 10.0, 20.0, 50.0, 100.0])])
        async with (
            run_edge(config, models=old) as w0,
            run_edge(config, models=new) as w1,
            workers([w0, w1], tmp_path) as (a0, _),
        ):
            first, second = w0.wiring.models, w1.wiring.models
            first.ramps["m"].promote()
            await wait_until(lambda: not a0._tasks)  # handed over, and answered
            follower = second.ramps["m"]
            assert [t.action for t in follower.history] == [], follower.snapshot()
            assert (follower.step, follower.rollout.percent) == (0, 5.0)
            await first.reconfigure(new)  # the reload reaches worker 0
            first.ramps["m"].promote()
            await wait_until(lambda: second.ramps["m"].step == 1)
            assert second.ramps["m"].rollout.percent == 10.0


async def test_a_promote_from_the_admin_port_leaves_every_worker_at_one_step(
    tmp_path: Path,
) -> None:
    """Workers apart for a moment (one advanced while the other had not heard yet): a promote
    runs on each from its own step, so each hands its advance on too, and the one behind
    follows the one ahead rather than staying a step apart for the rest of the ramp."""
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
        config = fast_config([s1.url, s2.url])
        models = ModelsConfig(rollouts=[rollout(steps=[5.0, 25.0, 50.0, 100.0])])
        async with run_edge(config, models=models) as w0, run_edge(config, models=models) as w1:
            first, second = w0.wiring.models, w1.wiring.models
            first.ramps["m"].promote()  # before the workers hear each other: 1 and 0
            async with workers([w0, w1], tmp_path) as (a0, a1):
                app = a1.wrap(w1.wiring.admin_app)
                status, _ = await call(app, "POST", "/rollouts/m/promote")
                assert status == 200
                await wait_until(lambda: not a0._tasks and not a1._tasks)
                await wait_until(lambda: second.ramps["m"].step == 2)
                assert [first.ramps["m"].step, second.ramps["m"].step] == [2, 2]
                assert second.ramps["m"].rollout.percent == 50.0
