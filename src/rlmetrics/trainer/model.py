"""A tiny causal transformer (nanoGPT-shaped) with a policy or a value head.

Sequences are right-padded when training (causal attention keeps real tokens blind to
the padding after them) and left-padded when sampling, where ``pad_mask`` hides the
padding and positions count real tokens only, so a token's logits do not depend on how
much padding its batch has.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlmetrics.trainer.config import ModelConfig


class Block(nn.Module):
    """Pre-norm attention + MLP block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def attend(self, x: Tensor, allowed: Tensor) -> Tensor:
        """Masked multi-head self-attention; ``allowed`` is (B, 1, T, T) bool."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))  # (B, nh, T, T)
        att = att.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, C))

    def forward(self, x: Tensor, allowed: Tensor) -> Tensor:
        x = x + self.attend(self.ln_1(x), allowed)
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, and a head.

    Args:
        cfg: the model config.
        vocab_size: number of token ids.
        block_size: longest sequence (prompt + response).
        value_head: a scalar head (the PPO critic) instead of the language-model head.
    """

    def __init__(
        self, cfg: ModelConfig, vocab_size: int, block_size: int, *, value_head: bool = False
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, 1 if value_head else vocab_size, bias=value_head)
        self.apply(_init_weights)

    def forward(self, idx: Tensor, pad_mask: Tensor | None = None) -> Tensor:
        """Logits (B, T, V), or values (B, T) with a value head.

        Args:
            idx: token ids (B, T).
            pad_mask: True at real tokens; None when every pad is at the end (training).
        """
        B, T = idx.shape
        causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
        if pad_mask is None:
            pos = torch.arange(T, device=idx.device).expand(B, T)
            allowed = causal.expand(B, 1, T, T)
        else:  # left padding: hide pad keys, count positions from the first real token
            pos = (pad_mask.long().cumsum(-1) - 1).clamp_min(0)
            eye = torch.eye(T, dtype=torch.bool, device=idx.device)
            allowed = (causal & (pad_mask[:, None, :] | eye))[:, None]
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x, allowed)
        out = self.head(self.ln_f(x))
        return out.squeeze(-1) if out.size(-1) == 1 else out

    def num_params(self) -> int:
        """Number of parameters."""
        return sum(p.numel() for p in self.parameters())


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_models(
    cfg: ModelConfig, vocab_size: int, block_size: int, *, critic: bool, seed: int
) -> tuple[TinyGPT, TinyGPT, TinyGPT | None]:
    """(actor, frozen reference copy, critic or None), identical on every rank."""
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(seed)
    actor = TinyGPT(cfg, vocab_size, block_size).to(dtype)
    ref = copy.deepcopy(actor).requires_grad_(False).eval()
    value = TinyGPT(cfg, vocab_size, block_size, value_head=True).to(dtype) if critic else None
    return actor, ref, value


def token_log_probs(logits: Tensor, tokens: Tensor) -> Tensor:
    """log p(tokens) under ``logits`` (B, T, V) -> (B, T)."""
    return torch.gather(F.log_softmax(logits, dim=-1), -1, tokens.unsqueeze(-1)).squeeze(-1)
