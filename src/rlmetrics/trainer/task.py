"""The built-in verifiable task: answer a prompt of symbols backwards, then stop.

A prompt is 1-5 symbols (``a c b``) followed by a separator; the right answer is the
prompt reversed and an end token (``b c a <eos>``); ``copy`` asks for it unreversed.
The rule-based reward gives partial credit, so GRPO's groups of n samples see a spread
of rewards from the first step: ``(1 - end_bonus)`` times the number of positions
answered right divided by the answer's length (or the response's, when it says more),
plus ``end_bonus`` when the end token comes exactly after the answer.
A random policy scores about ``1 / num_symbols`` per position; a perfect one scores 1.

The prompts come from two data sources (``SOURCES``): ``short`` (up to
``source_split`` symbols) and ``long`` (more), mixed in proportion to the sizes of
their length ranges. A prompt's length is drawn uniformly over the whole range, which
is the same as drawing its source in that proportion and then its length uniformly
within the source's range; the trainer reports score, response length and advantage
per source (``<name>/short``, ``<name>/long``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlmetrics.trainer.config import TaskConfig

PAD, SEP, EOS = 0, 1, 2
NUM_SPECIAL = 3
SOURCES = ("short", "long")  # data source names, by source id (``Task.sources``)


class Task:
    """Prompts, answers and rewards of the task in ``cfg``."""

    def __init__(self, cfg: TaskConfig) -> None:
        self.cfg = cfg
        self.vocab_size = NUM_SPECIAL + cfg.num_symbols
        self.max_prompt_tokens = cfg.max_prompt_len + 1  # symbols + separator
        self.max_response_len = cfg.max_prompt_len + 2  # room to overrun the end
        self.block_size = self.max_prompt_tokens + self.max_response_len

    def sample_prompts(self, num: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """``num`` prompts, right-padded with PAD: (tokens (num, P), lengths (num,)).

        Lengths count the separator; everything comes from ``generator`` on the CPU.
        """
        cfg = self.cfg
        lengths = torch.randint(
            cfg.min_prompt_len, cfg.max_prompt_len + 1, (num,), generator=generator
        )
        symbols = torch.randint(0, cfg.num_symbols, (num, cfg.max_prompt_len), generator=generator)
        cols = torch.arange(self.max_prompt_tokens)
        tokens = torch.full((num, self.max_prompt_tokens), PAD, dtype=torch.long)
        tokens[:, : cfg.max_prompt_len] = torch.where(
            cols[: cfg.max_prompt_len] < lengths[:, None], symbols + NUM_SPECIAL, PAD
        )
        tokens[torch.arange(num), lengths] = SEP
        return tokens, lengths + 1

    def sources(self, prompt_lengths: Tensor) -> Tensor:
        """Each prompt's data source id (int64, an index into ``SOURCES``), from its
        length (counting the separator, as ``sample_prompts`` returns it)."""
        return (prompt_lengths - 1 > self.cfg.source_split).long()

    def answers(self, prompts: Tensor, prompt_lengths: Tensor) -> Tensor:
        """The right answers (without the end token), padded with PAD to max_prompt_len."""
        num_symbols = prompt_lengths - 1
        cols = torch.arange(self.cfg.max_prompt_len)
        if self.cfg.task == "reverse":
            src = (num_symbols[:, None] - 1 - cols).clamp_min(0)
        else:
            src = cols.expand(len(prompts), -1)
        picked = torch.gather(prompts[:, : self.cfg.max_prompt_len], 1, src)
        return torch.where(cols < num_symbols[:, None], picked, PAD)

    def rewards(
        self, prompts: Tensor, prompt_lengths: Tensor, responses: Tensor, response_lengths: Tensor
    ) -> Tensor:
        """Reward per sequence, float64 in [0, 1].

        Args:
            prompts, prompt_lengths: as from ``sample_prompts`` (one row per sequence).
            responses: sampled tokens (B, R), PAD after the end; R >= max_prompt_len + 1.
            response_lengths: tokens per response, counting the end token if sampled.
        """
        answers = self.answers(prompts, prompt_lengths)
        num_symbols = prompt_lengths - 1
        width = answers.size(1)
        cols = torch.arange(width)
        hits = (responses[:, :width] == answers) & (cols < num_symbols[:, None])
        emitted = response_lengths - (responses == EOS).any(-1).long()  # symbols said
        credit = hits.sum(-1).double() / torch.maximum(num_symbols, emitted).double()
        stop = torch.gather(responses, 1, num_symbols[:, None]).squeeze(1)
        ended = (stop == EOS) & (response_lengths == num_symbols + 1)
        bonus = self.cfg.end_bonus
        return (1.0 - bonus) * credit + bonus * ended.double()

    def decode(self, tokens: Tensor) -> str:
        """A readable string of token ids (symbols as letters)."""
        names = {PAD: "", SEP: "|", EOS: "<eos>"}
        out = [names.get(t, chr(ord("a") + t - NUM_SPECIAL)) for t in tokens.tolist()]
        return " ".join(s for s in out if s)
