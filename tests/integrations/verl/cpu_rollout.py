"""A rollout for verl 0.9.1's trainer loop on the CPU (test support, not shipped).

verl's hybrid rollout has three parts, each reached through an extension point of its
own, and this module gives each a CPU version that generates with Hugging Face's
``generate``:

* the server (``HFCPUServer``): one Ray actor per replica, holding a copy of the policy,
  with the token-in/token-out ``generate`` verl's ``LLMServerClient`` calls (it returns
  verl's ``TokenOutput``) and the sleep / wake-up / abort calls of ``RolloutReplica``;
* the replica (``HFCPUReplica``), registered in ``RolloutReplicaRegistry``: it starts the
  server when ``LLMServerManager`` launches its replicas and hands it to the trainer
  workers of that replica;
* the adapter in each trainer worker (``HFCPUServerAdapter``), registered in
  ``verl.workers.rollout.base._ROLLOUT_REGISTRY``: verl's naive checkpoint engine hands it
  the actor's weights after each step (``ActorRolloutRefWorker.update_weights``); every
  rank gathers them (FSDP's ``full_tensor`` is collective) and the replica's first rank
  loads them into the server.

Sampling is seeded by the prompt and the weights' step, so two runs that differ only in
their micro-batches roll out the same responses. Importing the module registers both
classes under ``NAME``; the trainer workers import it through ``VERL_USE_EXTERNAL_MODULES``.
"""

from __future__ import annotations

import asyncio
import uuid
import zlib
from typing import Any

import ray
import torch
from verl.workers.rollout.base import _ROLLOUT_REGISTRY, BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

NAME = "hf_cpu"
"""The rollout's name in verl's config (``actor_rollout_ref.rollout.name``)."""


class HFCPUServer:
    """One replica's generation server: the policy in fp32 on the CPU (a Ray actor)."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        torch.set_num_threads(1)
        self.config = config
        self.replica_rank = replica_rank
        self.model = AutoModelForCausalLM.from_pretrained(
            model_config.path, torch_dtype=torch.float32, attn_implementation="eager"
        ).eval()
        self.eos_token_id = GenerationConfig.from_pretrained(model_config.path).eos_token_id
        self.global_steps: int | None = None
        self.weight_loads = 0
        self.requests = 0
        self.lock = asyncio.Lock()

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """Sample a response to ``prompt_ids`` (at most the rollout's response length),
        with the log-prob of each sampled token under the sampling distribution."""
        params = dict(sampling_params)
        limit = params.get("max_tokens", params.get("max_new_tokens"))
        max_tokens = self.config.response_length if limit is None else int(limit)
        max_tokens = max(1, min(max_tokens, self.config.response_length))
        temperature = float(params.get("temperature", 1.0))
        top_k = int(params.get("top_k", -1))
        seed = zlib.crc32(repr((self.global_steps, list(prompt_ids))).encode())
        async with self.lock:
            self.requests += 1
            torch.manual_seed(seed)
            with torch.no_grad():
                out = self.model.generate(
                    input_ids=torch.tensor([list(prompt_ids)]),
                    attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                    do_sample=temperature > 0,
                    temperature=temperature if temperature > 0 else None,
                    top_p=float(params.get("top_p", 1.0)),
                    top_k=top_k if top_k > 0 else None,
                    max_new_tokens=max_tokens,
                    eos_token_id=self.eos_token_id,
                    pad_token_id=self.eos_token_id,
                    return_dict_in_generate=True,
                    output_scores=True,
                )
        tokens = out.sequences[0, len(prompt_ids) :]
        log_probs = [
            torch.log_softmax(step_scores[0].float(), dim=-1)[token].item()
            for step_scores, token in zip(out.scores, tokens.tolist(), strict=True)
        ]
        return TokenOutput(
            token_ids=tokens.tolist(),
            log_probs=log_probs if params.get("logprobs") else None,
            stop_reason="completed",
            num_preempted=0,
            extra_fields={"global_steps": self.global_steps},
        )

    async def load_weights(
        self, weights: dict[str, torch.Tensor], global_steps: int | None
    ) -> None:
        """The trainer's weights, all of them (HF names), as the policy from now on."""
        async with self.lock:
            self.model.load_state_dict(weights, strict=True)
            self.global_steps = global_steps
            self.weight_loads += 1

    async def stats(self) -> dict[str, Any]:
        """What the server did: weight loads, requests served, the step of its weights."""
        return {
            "weight_loads": self.weight_loads,
            "requests": self.requests,
            "global_steps": self.global_steps,
        }

    async def wake_up(self, *args: Any, **kwargs: Any) -> None:
        """Nothing is freed on the CPU, so nothing to restore."""

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to free on the CPU."""

    async def abort_all_requests(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Requests are served one at a time and never left half done."""
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self) -> None:
        """Nothing was paused."""

    async def clear_kv_cache(self) -> None:
        """Hugging Face's generate keeps no cache between requests."""

    async def release_kv_cache(self) -> None:
        """No cache held between requests."""

    async def resume_kv_cache(self) -> None:
        """No cache held between requests."""

    async def wait_for_requests_to_drain(self) -> None:
        """Requests finish before ``generate`` returns."""

    async def start_profile(self, **kwargs: Any) -> None:
        """No profiler."""

    async def stop_profile(self) -> None:
        """No profiler."""


def attach_server(worker: Any, server: Any) -> int:
    """Give a trainer worker's rollout adapter its replica's server (run in the worker
    by ``__ray_call__``; the worker is verl's colocated ``WorkerDict`` or a bare
    ``ActorRolloutRefWorker``). Returns how many adapters took it."""
    inner = getattr(worker, "worker_dict", {"": worker})
    adapters = [
        w.rollout
        for w in inner.values()
        if isinstance(getattr(w, "rollout", None), HFCPUServerAdapter)
    ]
    for adapter in adapters:
        adapter.server = server
    return len(adapters)


class HFCPUReplica(RolloutReplica):
    """A replica of ``world_size`` trainer workers and one ``HFCPUServer``."""

    async def launch_servers(self) -> None:
        """Start the server next to the workers (no CPU of its own: the trainer's
        placement holds the CPUs) and give it to the workers' adapters."""
        server = (
            ray.remote(HFCPUServer)
            .options(
                num_cpus=0,
                max_concurrency=self.max_concurrency,
                name=f"hf_cpu_server_{self.replica_rank}_{uuid.uuid4().hex[:8]}",
            )
            .remote(self.config, self.model_config, self.replica_rank)
        )
        attached = await asyncio.gather(
            *[worker.__ray_call__.remote(attach_server, server) for worker in self.workers]
        )
        if self.workers and sum(attached) != len(self.workers):
            raise RuntimeError(f"{NAME}: not every worker holds an {NAME} adapter: {attached}")
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{NAME}-replica-{self.replica_rank}"


class HFCPUServerAdapter(BaseRollout):
    """The rollout inside a trainer worker: passes the actor's weights to the server."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any, **kwargs: Any):
        super().__init__(config, model_config, device_mesh)
        self.is_leader = (
            device_mesh["infer_tp"].get_local_rank() == 0
            and device_mesh["infer_pp"].get_local_rank() == 0
        )
        self.server: Any = None

    async def resume(self, tags: list[str]) -> None:
        """Nothing is released on the CPU."""

    async def release(self) -> None:
        """Nothing to release on the CPU."""

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any):
        """Gather every weight (all ranks take part), then the leader loads them into
        the server."""
        if wire_format != "named_tensors":
            raise NotImplementedError(f"{NAME}: weights as {wire_format!r}")
        state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}
        if self.is_leader:
            if self.server is None:
                raise RuntimeError(f"{NAME}: weights arrived before the replica's server")
            await self.server.load_weights.remote(state, kwargs.get("global_steps"))


def register() -> None:
    """Make ``NAME`` a rollout verl knows: the replica (driver) and the adapter (workers)."""
    RolloutReplicaRegistry.register(NAME, lambda: HFCPUReplica)
    _ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.HFCPUServerAdapter"


register()
