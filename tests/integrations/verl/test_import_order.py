"""The integration is on, and verl's workers can be created, whatever imports first.

The switch runs when ``verl.workers.engine_workers`` finishes loading and imports
``rlmetrics.integrations.verl.worker``, which itself imports ``engine_workers``. Two
ways a process imports the worker module first, each in a fresh process here:

* directly (``import rlmetrics.integrations.verl.worker``);
* by unpickling verl's colocated worker class (``create_colocated_worker_cls``, as
  ``PPOTrainer._setup`` builds it) whose first entry is the critic: Ray sends an actor
  class to its worker process with cloudpickle, and the critic's class,
  ``ExactTrainingWorker`` in a driver with the plugin, is pickled by reference, so
  loading it imports the worker module before verl's. verl's trainers list the actor
  first; a critic in its own resource pool, or a recipe's layout, does not.

Each process reports whether the integration is on and which classes verl builds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

EXACT = "rlmetrics.integrations.verl.worker.ExactTrainingWorker"

REPORT = """
import json
import sys

import rlmetrics.integrations.verl as integration
from verl.trainer.ppo.v1 import trainer_base
from verl.workers import engine_workers


def qualified(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


facts = {
    "enabled": integration.is_enabled(),
    "actor_worker_cls": qualified(engine_workers.ActorRolloutRefWorker.actor_worker_cls),
    "critic_cls": qualified(engine_workers.TrainingWorker),
    "v1_critic_cls": qualified(trainer_base.TrainingWorker),
}
"""

WORKER_FIRST = (
    """
import rlmetrics.integrations.verl.worker
"""
    + REPORT
    + """
print(json.dumps(facts))
"""
)

UNPICKLE_FIRST = (
    """
import sys

import cloudpickle

with open(sys.argv[1], "rb") as f:
    worker_dict = cloudpickle.loads(f.read())
"""
    + REPORT
    + """
from verl.single_controller.ray.base import _unwrap_ray_remote

# the classes the colocated class instantiates, in order (``cls_dict`` in its __init__)
init = worker_dict.__init__
free = dict(zip(init.__code__.co_freevars, (c.cell_contents for c in init.__closure__)))
roles = free["cls_dict"]
facts["roles"] = {role: qualified(_unwrap_ray_remote(cls)) for role, cls in roles.items()}
print(json.dumps(facts))
"""
)


def critic_first_colocated_class(path: str) -> None:
    """verl's colocated worker class with the critic before the actor, as this
    process (the plugin on) builds it, cloudpickled into ``path`` as Ray sends it."""
    import cloudpickle
    import ray
    from verl.single_controller.ray.base import RayClassWithInitArgs, create_colocated_worker_cls
    from verl.workers import engine_workers

    import rlmetrics.integrations.verl as integration

    integration.enable()
    classes = {
        "critic": RayClassWithInitArgs(cls=ray.remote(engine_workers.TrainingWorker)),
        "actor_rollout": RayClassWithInitArgs(
            cls=ray.remote(engine_workers.ActorRolloutRefWorker), role="actor"
        ),
    }
    assert list(classes) == ["critic", "actor_rollout"]
    colocated = create_colocated_worker_cls(class_dict=classes)
    with open(path, "wb") as f:
        f.write(cloudpickle.dumps(colocated.cls.__ray_actor_class__))


@pytest.fixture(scope="module")
def fresh_processes(verl_home: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Both fresh processes' reports (run side by side: each is mostly verl's import)."""
    folder = tmp_path_factory.mktemp("import_order")
    pickled = str(folder / "worker_dict.pkl")
    critic_first_colocated_class(pickled)
    env = {**os.environ, "HOME": verl_home, "TMPDIR": verl_home}
    scripts = {"worker_first": [WORKER_FIRST], "unpickle_first": [UNPICKLE_FIRST, pickled]}
    running = {
        name: subprocess.Popen(
            [sys.executable, "-c", *args],
            cwd=str(folder),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in scripts.items()
    }
    reports = {}
    for name, process in running.items():
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, f"{name}: exit {process.returncode}\n{err[-3000:]}"
        reports[name] = json.loads(out.strip().splitlines()[-1])
    return reports


def test_importing_the_worker_module_first_turns_the_integration_on(fresh_processes) -> None:
    facts = fresh_processes["worker_first"]
    assert facts["enabled"], facts
    assert facts["actor_worker_cls"] == EXACT, facts
    assert facts["critic_cls"] == EXACT, facts
    assert facts["v1_critic_cls"] == EXACT, facts


def test_a_colocated_class_with_the_critic_first_loads_in_a_fresh_process(
    fresh_processes,
) -> None:
    facts = fresh_processes["unpickle_first"]
    assert facts["roles"] == {
        "critic": EXACT,
        "actor_rollout": "verl.workers.engine_workers.ActorRolloutRefWorker",
    }, facts
    assert facts["enabled"], facts
    assert facts["actor_worker_cls"] == EXACT, facts
    assert facts["critic_cls"] == EXACT, facts
    assert facts["v1_critic_cls"] == EXACT, facts
