"""verl 0.9.1's ``RayPPOTrainer.fit()`` on the CPU: its logged metrics with and without rlmetrics.

The trainer is built as verl's ``main_ppo_v0.TaskRunner.run`` builds it (tokenizer,
``RLHFDataset``, dataloaders, ``RayPPOTrainer``, ``init_workers``, ``fit``), in the test
process, for ``STEPS`` PPO steps with a critic (GAE) on 2 Ray worker processes, each
holding the actor, its rollout adapter and the critic, as ``init_workers`` colocates
them. What verl cannot do on the CPU comes from verl's own extension points, in test
code only:

* the CPU platform and FSDP engines (``cpu_verl``, in the workers through
  ``VERL_USE_EXTERNAL_MODULES``); its engines wrap the reference policy without the
  pinned-memory offload verl gives forward-only models, which needs an accelerator;
* the rollout (``cpu_rollout``): a ``RolloutReplica`` whose server is a Ray actor
  generating with Hugging Face's ``generate``, the weights synced after each step by
  verl's naive checkpoint engine;
* the resource pools (``CPUResourcePoolManager``): verl's ``ResourcePoolManager`` asks
  Ray for GPUs; the pools are made as the worker-group test makes them, on CPUs;
* the worker environment (``ray_worker_group_cls``, a ``RayWorkerGroup`` with
  ``worker_env``).

The actor's loss has a KL term to the reference policy (``use_kl_loss``, verl's
``low_var_kl``), which the actor's workers hold too, as ``main_ppo_v0`` builds them
(``Role.ActorRolloutRef``). The reward is a toy function reward (``toy_reward``),
computed by verl's reward loop workers; the model and tokenizer are tiny and random
(``scenarios.make_models``, ``word_tokenizer``).

Four runs that differ only in the micro-batch size (``MICRO``; only the actor's takes
effect, see ``fit_config``) and in rlmetrics: installed (its plugin loads in every
process that imports verl), or switched off (``VERL_USE_EXTERNAL_PLUGINS=none`` in the
workers, the integration off in the driver). verl's file logger
(``trainer.logger=["console", "file"]``) writes each step's metrics. The rollouts of
all four are the same (the server's sampling is seeded by the prompt and the weights'
step), so a logged value that moves with the micro-batch moves because of how it is
reduced. The prompts come from two data sources (``SOURCES``) and the rlmetrics runs
have ``RLMETRICS_VERL_DETAIL=1`` in the workers and in the driver, so they also log
every update metric and the driver's data metrics per source (``<key>/<source>``);
the runs without rlmetrics have it in neither. Slow (about 2 minutes inside the verl
suite on 2 cores): part of ``make test-verl``; ``RLMETRICS_VERL_FIT=0`` skips it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(3600),
    pytest.mark.skipif(
        os.environ.get("RLMETRICS_VERL_FIT", "") == "0",
        reason="RLMETRICS_VERL_FIT=0: verl's trainer loop (minutes on the CPU) skipped",
    ),
]

WORLD_SIZE = 2
STEPS = 2
PROMPTS = 32
"""Prompts (and sequences: one response each) per step: 16 per worker."""
MINI_BATCH = 16
"""Prompts per optimizer step: two mini-batches a step, so the second sees moved weights."""
MICRO = (8, 2)
"""The micro-batch sizes compared (per worker): 8 is a worker's whole share of a
mini-batch (verl requires a micro-batch size that divides it)."""
PROMPT_LEN = 16
RESPONSE_LEN = 8
ACTOR_LR = 0.05
CRITIC_LR = 0.05
TOLERANCE = 1e-6
DRIFT = 1e-3
WORDS = [f"w{i}" for i in range(55)]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
UPDATE_METRICS = (
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/pg_clipfrac_lower",
    "actor/entropy",
    "actor/grad_norm",
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
    "critic/grad_norm",
)
"""The workers' update metrics ``fit`` logs (verl's names)."""
TOKEN_MEANS = (
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/kl_loss",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
)
"""Update metrics that are means over the step's response tokens (``kl_loss`` with
verl's default ``loss_agg_mode``, token-mean)."""
VARIANTS = ("exact", "verl")
SOURCES = ("toy_a", "toy_b")
"""The prompts' data sources: every fourth prompt is ``toy_b`` (8 of each step's 32)."""
DETAIL_ENV = {"RLMETRICS_VERL_DETAIL": "1", "RLMETRICS_VERL_SOURCES": ",".join(SOURCES)}
"""The extras' switch and the run's sources, in the rlmetrics runs' workers and driver."""
PER_SOURCE_METRICS = (
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/pg_clipfrac_lower",
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
    "critic/score/mean",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "critic/returns/mean",
    "critic/values/mean",
    "response_length/mean",
    "prompt_length/mean",
)
"""Keys the rlmetrics runs also log per source: the workers' update metrics (not the
gradient norms, which belong to no source, nor ``actor/entropy``, which the
integration does not split by source) and the driver's data metrics."""


def word_tokenizer(path: str, model_path: str) -> None:
    """A word-level tokenizer of the model's 64 ids with a ChatML template (Qwen2's
    model type makes verl's agent loop use its Qwen token builder, which needs
    ``<|im_end|>`` and a one-token newline), saved in a folder of its own (next to a
    Qwen2 config, transformers would load it as Qwen2's byte-level tokenizer); and a
    generation config for the model that stops at ``<|im_end|>``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    vocab = {
        token: i
        for i, token in enumerate([*SPECIAL, "\n", "system", "user", "assistant", "say", *WORDS])
    }
    assert len(vocab) == 64
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(" +"), behavior="removed"),
            pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
        ]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    end = vocab["<|im_end|>"]
    GenerationConfig(eos_token_id=end, pad_token_id=vocab["<|endoftext|>"]).save_pretrained(
        model_path
    )


def source_of(row: int) -> str:
    """The data source of the dataset's ``row``."""
    return SOURCES[1] if row % 4 == 3 else SOURCES[0]


def toy_dataset(path: str, rows: int) -> None:
    """``rows`` prompts "say wK wJ" (target word wK), as verl's RLHFDataset reads them,
    from the two ``SOURCES`` (``source_of``)."""
    import pandas as pd

    records = []
    for i in range(rows):
        target, other = WORDS[i % len(WORDS)], WORDS[(7 * i + 3) % len(WORDS)]
        records.append(
            {
                "data_source": source_of(i),
                "prompt": [{"role": "user", "content": f"say {target} {other}"}],
                "reward_model": {"style": "rule", "ground_truth": target},
                "extra_info": {"index": i},
            }
        )
    pd.DataFrame(records).to_parquet(path)


@dataclass
class FitFiles:
    """The models, the tokenizer, the dataset and the toy reward's file."""

    actor: str
    tokenizer: str
    critic: str
    data: str
    reward: str


@pytest.fixture(scope="module")
def fit_files(verl_home: str) -> FitFiles:
    from scenarios import make_models

    root = os.path.join(verl_home, "fit")
    make_models(root)
    tokenizer = os.path.join(root, "tokenizer")
    word_tokenizer(tokenizer, os.path.join(root, "actor"))
    data = os.path.join(root, "prompts.parquet")
    toy_dataset(data, PROMPTS * STEPS)
    reward = os.path.join(os.path.dirname(__file__), "toy_reward.py")
    return FitFiles(
        os.path.join(root, "actor"), tokenizer, os.path.join(root, "critic"), data, reward
    )


def fit_config(files: FitFiles, micro: int, log_path: str) -> Any:
    """verl's generated PPO trainer config for a CPU run (``scenarios.trainer_config``)
    of STEPS steps with GAE, a KL loss to the reference policy, the ``hf_cpu`` rollout
    and ``micro`` sequences per micro-batch."""
    from cpu_rollout import NAME
    from omegaconf import open_dict
    from scenarios import set_critic, trainer_config

    config = trainer_config(files.actor, lr=ACTOR_LR)
    set_critic(config, files.critic)
    ref, critic = config.actor_rollout_ref, config.critic
    with open_dict(config):
        config.data.train_files = files.data
        config.data.val_files = files.data
        config.data.train_batch_size = PROMPTS
        config.data.max_prompt_length = PROMPT_LEN
        config.data.max_response_length = RESPONSE_LEN
        config.data.shuffle = False
        config.data.dataloader_num_workers = 0
        config.data.filter_overlong_prompts = False
        config.algorithm.adv_estimator = "gae"
        config.algorithm.use_kl_in_reward = False
        ref.model.load_tokenizer = True
        ref.model.tokenizer_path = files.tokenizer
        ref.actor.use_kl_loss = True  # low_var_kl, coefficient 0.001 (verl's default)
        ref.actor.ppo_mini_batch_size = MINI_BATCH
        ref.actor.ppo_micro_batch_size_per_gpu = micro
        ref.actor.shuffle = False
        ref.rollout.name = NAME
        ref.rollout.mode = "async"
        ref.rollout.tensor_model_parallel_size = WORLD_SIZE
        ref.rollout.n = 1
        ref.rollout.prompt_length = PROMPT_LEN
        ref.rollout.response_length = RESPONSE_LEN
        ref.rollout.max_model_len = PROMPT_LEN + RESPONSE_LEN
        ref.rollout.load_format = "auto"
        ref.rollout.agent.num_workers = 1
        ref.rollout.log_prob_micro_batch_size_per_gpu = 8
        critic.optim.lr = CRITIC_LR
        critic.ppo_mini_batch_size = MINI_BATCH
        # verl's init_workers hands the critic's engine its token limits but not this
        # micro-batch size, and the engine's default is dynamic batching: the critic
        # runs one micro-batch per worker and mini-batch whatever it says (docs/verl.md).
        critic.ppo_micro_batch_size_per_gpu = micro
        critic.forward_micro_batch_size_per_gpu = 8
        critic.shuffle = False
        config.reward.num_workers = 1
        config.reward.custom_reward_function.path = files.reward
        config.reward.custom_reward_function.name = "compute_score"
        config.trainer.nnodes = 1
        config.trainer.n_gpus_per_node = WORLD_SIZE
        config.trainer.device = "cpu"
        config.trainer.total_epochs = 1
        config.trainer.total_training_steps = STEPS
        config.trainer.val_before_train = False
        config.trainer.test_freq = -1
        config.trainer.save_freq = -1
        config.trainer.logger = ["console", "file"]
        config.trainer.project_name = "rlmetrics_cpu_fit"
        config.trainer.experiment_name = os.path.basename(log_path)
        config.trainer.default_local_dir = os.path.join(os.path.dirname(log_path), "checkpoints")
    return config


def cpu_resource_pool_manager(config: Any, mapping: dict) -> Any:
    """verl's ``ResourcePoolManager`` whose pools hold CPUs (``use_gpu=False``) instead
    of the GPUs its ``create_resource_pool`` asks for."""
    from cpu_verl import cpu_resource_pool_manager_class

    spec = {"global_pool": [config.trainer.n_gpus_per_node] * config.trainer.nnodes}
    return cpu_resource_pool_manager_class()(resource_pool_spec=spec, mapping=mapping)


def build_trainer(config: Any, worker_env: dict[str, str]) -> Any:
    """The trainer as ``main_ppo_v0.TaskRunner.run`` builds it, with the CPU pools and
    the workers' environment."""
    import ray
    from omegaconf import OmegaConf
    from verl.single_controller.ray import RayWorkerGroup
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, Role
    from verl.trainer.ppo.utils import create_rl_dataset, create_rl_sampler, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.dataset.rl_dataset import collate_fn
    from verl.workers import engine_workers
    from verl.workers.config import HFModelConfig

    OmegaConf.resolve(config)
    # with a reference policy, the actor's workers hold it (main_ppo_v0's add_actor_rollout_worker)
    actor = Role.ActorRolloutRef if need_reference_policy(config) else Role.ActorRollout
    role_worker_mapping = {
        actor: ray.remote(engine_workers.ActorRolloutRefWorker),
        Role.Critic: ray.remote(engine_workers.TrainingWorker),
    }
    mapping = {actor: "global_pool", Role.Critic: "global_pool"}
    model_config: HFModelConfig = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    tokenizer = model_config.tokenizer
    train = create_rl_dataset(config.data.train_files, config.data, tokenizer, None, is_train=True)
    val = create_rl_dataset(config.data.val_files, config.data, tokenizer, None, is_train=False)
    return RayPPOTrainer(
        config=config,
        tokenizer=tokenizer,
        processor=None,
        role_worker_mapping=role_worker_mapping,
        resource_pool_manager=cpu_resource_pool_manager(config, mapping),
        ray_worker_group_cls=partial(RayWorkerGroup, worker_env=worker_env),
        train_dataset=train,
        val_dataset=val,
        collate_fn=collate_fn,
        train_sampler=create_rl_sampler(config.data, train),
    )


def end_actors(trainer: Any) -> None:
    """Kill every actor the trainer started and free its placement groups, so the next
    run finds the CPUs and the actor names free."""
    import ray

    actors = []
    for group_name in ("actor_rollout_wg", "critic_wg"):
        group = getattr(trainer, group_name, None)
        actors += list(getattr(group, "workers", []) or [])
    server_manager = getattr(trainer, "llm_server_manager", None)
    for replica in getattr(server_manager, "rollout_replicas", []) or []:
        actors += list(replica.servers)
    if getattr(server_manager, "global_load_balancer", None) is not None:
        actors.append(server_manager.global_load_balancer)
    actors += list(
        getattr(getattr(trainer, "async_rollout_manager", None), "agent_loop_workers", []) or []
    )
    actors += list(
        getattr(getattr(trainer, "reward_loop_manager", None), "reward_loop_workers", []) or []
    )
    for actor in actors:
        with contextlib.suppress(Exception):  # already gone
            ray.kill(actor)
    for pool in trainer.resource_pool_manager.resource_pool_dict.values():
        for placement_group in pool.pgs or ():
            ray.util.remove_placement_group(placement_group)


def worker_facts(worker: Any) -> dict[str, Any]:
    """A trainer worker's report (run in it by ``__ray_call__``): whether rlmetrics'
    integration was imported there, the class of its actor's update and critic, and
    the engine of its reference policy."""
    import sys

    inner = worker.worker_dict

    def qualified(obj: Any) -> str:
        return f"{type(obj).__module__}.{type(obj).__qualname__}"

    roles = dict(inner)
    actor = next(w for w in roles.values() if hasattr(w, "actor"))
    critic = next(w for w in roles.values() if not hasattr(w, "actor"))
    return {
        "integration_imported": "rlmetrics.integrations.verl" in sys.modules,
        "actor_update_class": qualified(actor.actor),
        "critic_class": qualified(critic),
        "rollout_class": qualified(actor.rollout),
        "ref_engine_class": qualified(actor.ref.engine),
        "pid": os.getpid(),
    }


def run_fit(files: FitFiles, folder: str, micro: int, variant: str) -> dict[str, Any]:
    """One ``fit`` of STEPS steps; what verl's file logger wrote, the workers' reports
    and the rollout server's."""
    import ray

    import rlmetrics.integrations.verl as integration

    log_path = os.path.join(folder, f"{variant}_micro{micro}.jsonl")
    env = {"VERL_USE_EXTERNAL_MODULES": "cpu_verl_worker,cpu_rollout"}
    driver_env = {"VERL_FILE_LOGGER_PATH": log_path}
    if variant == "verl":
        env["VERL_USE_EXTERNAL_PLUGINS"] = "none"
        integration.disable()
    else:
        env.update(DETAIL_ENV)
        driver_env.update(DETAIL_ENV)
        integration.enable()
    config = fit_config(files, micro, log_path)
    trainer = build_trainer(config, env)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in driver_env.items():
            patch.setenv(name, value)
        try:
            trainer.init_workers()
            trainer.fit()
            facts = ray.get(
                [w.__ray_call__.remote(worker_facts) for w in trainer.actor_rollout_wg.workers]
            )
            servers = [
                ray.get(s.stats.remote())
                for replica in trainer.llm_server_manager.rollout_replicas
                for s in replica.servers
            ]
        finally:
            end_actors(trainer)
    with open(log_path) as f:
        logged = [json.loads(line) for line in f if line.strip()]
    return {"logged": logged, "facts": facts, "servers": servers}


@pytest.fixture(scope="module")
def fits(
    fit_files: FitFiles, verl_ray: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict]:
    """Every variant's run at every micro-batch size; also written as JSON to
    $RLMETRICS_VERL_RESULTS_DIR when set (the numbers docs/verl.md quotes)."""
    import rlmetrics.integrations.verl as integration

    was_enabled = integration.is_enabled()
    folder = str(tmp_path_factory.mktemp("fit_logs"))
    out: dict[str, Any] = {}
    try:
        for variant in VARIANTS:
            for micro in MICRO:
                out[f"{variant}_micro{micro}"] = run_fit(fit_files, folder, micro, variant)
    finally:
        integration.enable() if was_enabled else integration.disable()
    results = os.environ.get("RLMETRICS_VERL_RESULTS_DIR")
    if results:
        with open(os.path.join(results, "trainer_fit.json"), "w") as f:
            json.dump(out, f, indent=1, sort_keys=True)
    yield out


def steps(run: dict[str, Any]) -> list[dict[str, float]]:
    """The metrics of each training step, in order, as verl's file logger wrote them."""
    rows = [row for row in run["logged"] if "actor/pg_loss" in row.get("data", {})]
    return [row["data"] for row in sorted(rows, key=lambda r: r["step"])]


def test_fit_runs_its_steps_with_the_cpu_rollout(fits: dict) -> None:
    """Each run logged STEPS steps; the server took the actor's weights before the first
    step and after each (verl's naive checkpoint engine), and served every sequence."""
    for name, run in fits.items():
        logged = steps(run)
        assert len(logged) == STEPS, (name, [row.get("step") for row in run["logged"]])
        assert [row["training/global_step"] for row in logged] == list(range(1, STEPS + 1))
        assert len(run["servers"]) == 1, (name, run["servers"])
        for server in run["servers"]:
            assert server["weight_loads"] == STEPS + 1, (name, server)
            assert server["global_steps"] == STEPS, (name, server)
            assert server["requests"] == PROMPTS * STEPS, (name, server)


def test_the_rollout_server_holds_the_actors_weights(fits: dict) -> None:
    """The log-probs the server sampled with equal those the actor computes for the
    same tokens (verl's ``training/rollout_probs_diff_max``), so the weights it
    generated with are the actor's, synced after every step."""
    for name, run in fits.items():
        for row in steps(run):
            assert row["training/rollout_probs_diff_max"] < 1e-6, (
                name,
                row["training/global_step"],
            )


def test_the_plugin_is_in_the_workers_of_the_rlmetrics_runs_only(fits: dict) -> None:
    for micro in MICRO:
        for fact in fits[f"exact_micro{micro}"]["facts"]:
            assert fact["integration_imported"], fact
            assert fact["actor_update_class"].endswith("ExactTrainingWorker"), fact
            assert fact["critic_class"].endswith("ExactTrainingWorker"), fact
        for fact in fits[f"verl_micro{micro}"]["facts"]:
            assert not fact["integration_imported"], fact
            assert fact["actor_update_class"] == "verl.workers.engine_workers.TrainingWorker", fact
            assert fact["critic_class"] == "verl.workers.engine_workers.TrainingWorker", fact
        for run in fits.values():
            assert {f["rollout_class"] for f in run["facts"]} == {"cpu_rollout.HFCPUServerAdapter"}
            assert {f["ref_engine_class"].rsplit(".", 1)[-1] for f in run["facts"]} == {
                "CPUFSDPEngineWithLMHead"
            }


def test_the_four_runs_train_the_same(fits: dict) -> None:
    """What the driver computes from the rollouts (scores, lengths) is the same in every
    run, and so are the updates (gradient norms, the actor's entropy): the runs differ
    in the updates' split and in how their metrics are reduced, nothing else."""
    exactly = ("critic/score/mean", "response_length/mean", "prompt_length/mean")
    close = ("actor/grad_norm", "critic/grad_norm", "actor/entropy", "critic/values/mean")
    reference = steps(fits["exact_micro8"])
    for name, run in fits.items():
        for row, ref in zip(steps(run), reference, strict=True):
            assert {n: row[n] for n in exactly} == {n: ref[n] for n in exactly}, name
            far = {
                n: (row[n], ref[n])
                for n in close
                if abs(row[n] - ref[n]) > TOLERANCE * max(1.0, abs(ref[n]))
            }
            assert not far, (name, far)


def differences(fits: dict, variant: str) -> dict[str, float]:
    """Per update metric, the largest difference over the steps between the two
    micro-batch sizes' logged values (relative above 1)."""
    small, large = (steps(fits[f"{variant}_micro{m}"]) for m in sorted(MICRO))
    return {
        n: max(abs(a[n] - b[n]) / max(1.0, abs(b[n])) for a, b in zip(small, large, strict=True))
        for n in UPDATE_METRICS
    }


def test_with_rlmetrics_the_logged_update_metrics_agree_across_micro_batches(fits: dict) -> None:
    diff = differences(fits, "exact")
    assert max(diff.values()) < TOLERANCE, diff


def test_without_rlmetrics_verls_logged_update_metrics_drift(fits: dict) -> None:
    diff = differences(fits, "verl")
    assert max(diff.values()) > DRIFT, diff


def per_source_keys(row: dict[str, float]) -> set[str]:
    """The logged keys that end in a data source's name."""
    return {key for key in row if key.rsplit("/", 1)[-1] in SOURCES}


def rows_per_source(step: int) -> dict[str, int]:
    """How many of training step ``step``'s prompts (rows ``PROMPTS * (step - 1)`` on:
    the sampler is sequential) each source has."""
    rows = range(PROMPTS * (step - 1), PROMPTS * step)
    return {source: sum(source_of(i) == source for i in rows) for source in SOURCES}


def test_with_detail_the_per_source_metrics_are_logged_and_agree_across_micro_batches(
    fits: dict,
) -> None:
    """The rlmetrics runs log every update metric and the driver's data metrics per
    source, the same at micro-batch 8 and 2; the runs without rlmetrics log none."""
    small, large = (steps(fits[f"exact_micro{m}"]) for m in sorted(MICRO))
    expected = {f"{name}/{source}" for name in PER_SOURCE_METRICS for source in SOURCES}
    for a, b in zip(small, large, strict=True):
        assert expected <= per_source_keys(b), sorted(expected - per_source_keys(b))
        assert per_source_keys(a) == per_source_keys(b)
        far = {
            key: (a[key], b[key])
            for key in per_source_keys(b)
            if abs(a[key] - b[key]) > TOLERANCE * max(1.0, abs(b[key]))
        }
        assert not far, far
    for micro in MICRO:
        for row in steps(fits[f"verl_micro{micro}"]):
            assert not per_source_keys(row), sorted(per_source_keys(row))


def test_the_per_source_means_make_up_the_whole_batch(fits: dict) -> None:
    """Each step's per-source means, weighted by the source's rows (the dataset's
    counts; for the score, the rows with a response, as verl averages it), give the
    whole batch's; the update metrics that are token means, weighted by the source's
    response tokens (rows times mean response length), give the logged value."""
    for micro in MICRO:
        for row in steps(fits[f"exact_micro{micro}"]):
            counts = rows_per_source(row["training/global_step"])
            assert sum(counts.values()) == PROMPTS

            def weighted(name: str, weights: dict[str, float], row: dict = row) -> float:
                total = sum(weights.values())
                return sum(weights[s] * row[f"{name}/{s}"] for s in SOURCES) / total

            length = weighted("response_length/mean", counts)
            assert abs(length - row["response_length/mean"]) < 1e-9, (length, row)
            answered = {
                s: n * (1.0 - row[f"response/aborted_ratio/{s}"]) for s, n in counts.items()
            }
            assert (
                abs(sum(answered.values()) - PROMPTS * (1.0 - row["response/aborted_ratio"])) < 1e-9
            )
            score = weighted("critic/score/mean", answered)
            assert abs(score - row["critic/score/mean"]) < 1e-9, (score, row)
            tokens = {s: n * row[f"response_length/mean/{s}"] for s, n in counts.items()}
            for name in TOKEN_MEANS:
                value = weighted(name, tokens)
                assert abs(value - row[name]) < TOLERANCE, (name, value, row[name])


def test_the_kl_loss_to_the_reference_policy(fits: dict) -> None:
    """Every run logs the KL term (``actor/kl_loss``, coefficient ``actor/kl_coef``).
    rlmetrics logs the step's token mean of verl's per-token KL: the same at both
    micro-batch sizes (the test above) and made up of its per-source parts (the test
    before). verl alone does not move with the micro-batch either (0.9.1 scales each
    micro-batch's term by its mini-batch's global token count), but it logs the plain
    mean of the step's two mini-batch means, which their token counts do not weigh: a
    value of its own, not the step's."""
    exact, own = (steps(fits[f"{variant}_micro{max(MICRO)}"]) for variant in VARIANTS)
    for variant in VARIANTS:
        small, large = (steps(fits[f"{variant}_micro{m}"]) for m in sorted(MICRO))
        for a, b in zip(small, large, strict=True):
            assert a["actor/kl_coef"] == b["actor/kl_coef"] == pytest.approx(0.001)
            assert a["actor/kl_loss"] > 0
            assert abs(a["actor/kl_loss"] - b["actor/kl_loss"]) < TOLERANCE * b["actor/kl_loss"]
    gap = max(abs(e["actor/kl_loss"] - v["actor/kl_loss"]) for e, v in zip(exact, own, strict=True))
    assert gap > DRIFT * max(e["actor/kl_loss"] for e in exact), (exact, own)
