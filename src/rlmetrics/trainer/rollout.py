"""Sampling a step's batch, and this rank's shard of it.

The batch of step ``t`` depends only on (seed, t) and the weights: every rank samples
the whole batch from a CPU generator seeded by (seed, t) and keeps its shard, so runs
with any number of ranks and any micro-batching train on the same sequences. Sampling
uses Gumbel noise drawn on the CPU, so the batch does not depend on the device either.
Rewards and GRPO advantages are computed on the whole batch, before sharding.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from rlmetrics.trainer.model import TinyGPT
from rlmetrics.trainer.task import EOS, PAD, Task

Sequences = dict[str, Tensor]  # tensors sharing their first dimension (one row per sequence)


def step_generator(seed: int, step: int) -> torch.Generator:
    """The CPU generator of step ``step``'s rollout (the same on every rank)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


@torch.no_grad()
def sample(
    actor: TinyGPT,
    left: Tensor,
    real: Tensor,
    max_new: int,
    temperature: float,
    gen: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """Sample up to ``max_new`` tokens after left-padded prompts ``left`` (real: not pad).

    Returns (responses (B, max_new) with PAD after the end token, lengths (B,)).
    """
    B = left.size(0)
    device = left.device
    out = torch.full((B, max_new), PAD, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for t in range(max_new):
        logits = actor(left, real)[:, -1].double() / temperature
        uniform = torch.rand(logits.shape, generator=gen, dtype=torch.float64)
        gumbel = -torch.log(-torch.log(uniform.clamp(1e-300, 1.0 - 1e-16)))
        token = (logits + gumbel.to(device)).argmax(-1)
        token = torch.where(done, PAD, token)
        out[:, t] = token
        left = torch.cat((left, token[:, None]), dim=1)
        real = torch.cat((real, ~done[:, None]), dim=1)
        done = done | (token == EOS)
        if bool(done.all()):
            break
    lengths = (out != PAD).sum(-1)
    return out, lengths


def left_pad(prompts: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """Right-padded prompts as left-padded ones, with their real-token mask."""
    width = prompts.size(1)
    shift = width - lengths
    cols = torch.arange(width, device=prompts.device)
    src = (cols[None, :] - shift[:, None]).clamp_min(0)
    real = cols[None, :] >= shift[:, None]
    return torch.where(real, torch.gather(prompts, 1, src), PAD), real


def join(prompts: Tensor, prompt_lengths: Tensor, responses: Tensor, lengths: Tensor) -> Tensor:
    """[prompt | response | PAD...] rows, right-padded to the longest sequence."""
    total = prompt_lengths + lengths
    width = int(total.max())
    cols = torch.arange(width, device=prompts.device)[None, :]
    in_prompt = cols < prompt_lengths[:, None]
    resp_col = (cols - prompt_lengths[:, None]).clamp(0, responses.size(1) - 1)
    from_prompt = torch.gather(prompts, 1, cols.clamp(max=prompts.size(1) - 1).expand_as(resp_col))
    tokens = torch.where(in_prompt, from_prompt, torch.gather(responses, 1, resp_col))
    return torch.where(cols < total[:, None], tokens, PAD)


def rollout(
    actor: TinyGPT,
    task: Task,
    *,
    num_prompts: int,
    n: int,
    temperature: float,
    seed: int,
    step: int,
) -> Sequences:
    """The whole batch of ``step``: num_prompts * n sequences, n per prompt in a row.

    Returns a Batch with ``tokens`` (B, T) [prompt | response] right-padded,
    ``prompt_lengths``, ``response_lengths``, ``group`` (the prompt index), ``source``
    (the prompt's data source id, see ``Task.sources``), and the
    right-padded ``prompts`` and ``responses`` that ``add_scores`` turns into scores,
    all on the CPU.
    """
    gen = step_generator(seed, step)
    prompts, prompt_lengths = task.sample_prompts(num_prompts, gen)
    prompts = prompts.repeat_interleave(n, dim=0)
    prompt_lengths = prompt_lengths.repeat_interleave(n)
    device = next(actor.parameters()).device
    left, real = left_pad(prompts, prompt_lengths)
    responses, lengths = sample(
        actor, left.to(device), real.to(device), task.max_response_len, temperature, gen
    )
    responses, lengths = responses.cpu(), lengths.cpu()
    width = task.max_response_len
    responses = torch.nn.functional.pad(responses, (0, width - responses.size(1)), value=PAD)
    return {
        "tokens": join(prompts, prompt_lengths, responses, lengths),
        "prompt_lengths": prompt_lengths,
        "response_lengths": lengths,
        "group": torch.arange(num_prompts).repeat_interleave(n),
        "source": task.sources(prompt_lengths),  # data source ids (task.SOURCES)
        "prompts": prompts,
        "responses": responses,
    }


def add_scores(task: Task, batch: Sequences) -> None:
    """The reward stage: ``scores`` (float64) from the batch's prompts and responses,
    which it removes (they are not per-token fields of the training batch)."""
    prompts, responses = batch.pop("prompts"), batch.pop("responses")
    lengths = batch["response_lengths"]
    batch["scores"] = task.rewards(prompts, batch["prompt_lengths"], responses, lengths)


def response_mask(batch: Sequences) -> Tensor:
    """(B, T-1) True where target token ``tokens[:, 1:]`` is a response token."""
    cols = torch.arange(batch["tokens"].size(1) - 1)[None, :]
    start = batch["prompt_lengths"][:, None] - 1
    return (cols >= start) & (cols < start + batch["response_lengths"][:, None])


def select(batch: Sequences, index: Tensor) -> Sequences:
    """Rows ``index`` of every tensor of ``batch``."""
    return {key: value[index] for key, value in batch.items()}


def split_evenly(start: int, stop: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) cut into ``parts`` contiguous ranges, sizes differing by at most 1."""
    size, extra = divmod(stop - start, parts)
    bounds = [start]
    for i in range(parts):
        bounds.append(bounds[-1] + size + (1 if i < extra else 0))
    return list(itertools.pairwise(bounds))


def shard_indices(num_seqs: int, mini_batches: int, rank: int, world_size: int) -> list[Tensor]:
    """This rank's rows of each mini-batch (global indices; may be empty).

    Mini-batch k is the same rows for any world size; each is split evenly over ranks.
    """
    out = []
    for lo, hi in split_evenly(0, num_seqs, mini_batches):
        a, b = split_evenly(lo, hi, world_size)[rank]
        out.append(torch.arange(a, b))
    return out
