"""The driver's data metrics per source (``RLMETRICS_VERL_DETAIL=1``) on verl 0.9.1's own
``compute_data_metrics``, run on a real ``DataProto`` as the driver holds it after the
update: every ``<key>/<source>`` equals numpy over the whole batch's rows of that source.
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch

import rlmetrics.integrations.verl as integration
from rlmetrics.integrations.verl import data_metrics

ROWS, PROMPT, RESPONSE = 10, 5, 6
SOURCES = ("a", "b", "a", "b", "a", "a", "b", "a", "a", "a")
ABORTED_ROW = 4  # a row of "a" whose response is empty (verl's aborted sample)
TOLERANCE = 1e-6


def make_batch(sources: tuple[str, ...] | None = SOURCES, seed: int = 0):  # -> DataProto
    """Prompts (left-padded), responses (right-padded, one empty), per-token scores,
    rewards, advantages, returns and values, and each row's ``data_source``."""
    from verl import DataProto

    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, PROMPT + 1, (ROWS,), generator=gen)
    response_lens = torch.randint(1, RESPONSE + 1, (ROWS,), generator=gen)
    response_lens[ABORTED_ROW] = 0
    response_lens[1] = RESPONSE  # a clipped response in "b"
    positions = torch.arange(max(PROMPT, RESPONSE))
    prompt_mask = positions[None, :PROMPT] >= (PROMPT - prompt_lens)[:, None]
    response_mask = positions[None, :RESPONSE] < response_lens[:, None]
    ids = torch.randint(0, 50, (ROWS, PROMPT + RESPONSE), generator=gen)
    shape = (ROWS, RESPONSE)
    scores = torch.zeros(shape)
    last = (response_lens - 1).clamp(min=0)
    scores[torch.arange(ROWS), last] = torch.randn(ROWS, generator=gen)  # at the last token
    tensors = {
        "prompts": ids[:, :PROMPT],
        "responses": ids[:, PROMPT:],
        "attention_mask": torch.cat((prompt_mask, response_mask), dim=1).long(),
        "response_mask": response_mask.long(),
        "token_level_scores": scores,
        "token_level_rewards": scores - 0.1 * torch.rand(shape, generator=gen) * response_mask,
        "advantages": torch.randn(shape, generator=gen) * response_mask,
        "returns": torch.randn(shape, generator=gen) * response_mask,
        "values": torch.randn(shape, generator=gen) * response_mask,
    }
    non_tensors = {} if sources is None else {"data_source": np.array(sources, dtype=object)}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def numpy_metrics(batch, rows: np.ndarray) -> dict[str, float]:
    """verl's data metrics over ``rows`` of ``batch``, in numpy (float64)."""
    b = {key: batch.batch[key].double().numpy()[rows] for key in batch.batch.keys()}  # noqa: SIM118
    attention = b["attention_mask"].astype(bool)
    response_len = attention[:, -RESPONSE:].sum(-1).astype(float)
    prompt_len = attention[:, :-RESPONSE].sum(-1).astype(float)
    kept = response_len > 0
    mask = b["response_mask"].astype(bool)
    out: dict[str, float] = {}

    def stats(name: str, values: np.ndarray) -> None:
        out.update({f"{name}/mean": values.mean(), f"{name}/max": values.max()})
        out[f"{name}/min"] = values.min()

    stats("critic/score", b["token_level_scores"].sum(-1)[kept])
    stats("critic/rewards", b["token_level_rewards"].sum(-1)[kept])
    stats("critic/advantages", b["advantages"][mask])
    stats("critic/returns", b["returns"][mask])
    stats("critic/values", b["values"][mask])
    returns, values = b["returns"][mask], b["values"][mask]
    explained = 1.0 - np.var(returns - values, ddof=1) / (np.var(returns, ddof=1) + 1e-5)
    out["critic/vf_explained_var"] = explained
    stats("response_length", response_len)
    out["response_length/clip_ratio"] = np.mean(response_len == RESPONSE)
    stats("response_length_non_aborted", response_len[kept])
    out["response_length_non_aborted/clip_ratio"] = np.mean(response_len[kept] == RESPONSE)
    out["response/aborted_ratio"] = np.mean(~kept)
    stats("prompt_length", prompt_len)
    out["prompt_length/clip_ratio"] = np.mean(prompt_len == PROMPT)
    return out


def verl_function():  # -> verl's compute_data_metrics, unwrapped
    from verl.trainer.ppo import metric_utils

    function = metric_utils.compute_data_metrics
    return getattr(function, "__rlmetrics_wrapped__", function)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=TOLERANCE, abs_tol=TOLERANCE)


@pytest.mark.parametrize(
    "sources",
    [SOURCES, ("a",) * ROWS, tuple("abcaabcaaa")],
    ids=["two-sources", "one-source-absent", "three-sources"],
)
def test_every_key_per_source_equals_numpy_over_the_whole_batch(sources: tuple) -> None:
    batch = make_batch(sources)
    by_source = data_metrics.data_metrics_by_source(batch, use_critic=True)
    verl_keys = set(verl_function()(batch=batch, use_critic=True))
    present = sorted(set(sources))
    assert set(by_source) == {f"{key}/{source}" for key in verl_keys for source in present}
    labels = np.asarray(sources)
    for source in present:
        want = numpy_metrics(batch, labels == source)
        assert set(want) <= verl_keys
        wrong = {
            key: (by_source[f"{key}/{source}"], value)
            for key, value in want.items()
            if not _close(by_source[f"{key}/{source}"], value)
        }
        assert not wrong, f"{source}: (logged, numpy) {wrong}"


def test_the_whole_batch_numpy_is_verls_own_value() -> None:
    """The reference itself: over every row, numpy gives verl's own keys."""
    batch = make_batch()
    got = verl_function()(batch=batch, use_critic=True)
    for key, value in numpy_metrics(batch, np.ones(ROWS, dtype=bool)).items():
        assert _close(got[key], value), key


def test_no_data_source_no_keys() -> None:
    assert data_metrics.data_metrics_by_source(make_batch(None)) == {}


def test_without_a_critic_no_value_keys() -> None:
    keys = data_metrics.data_metrics_by_source(make_batch(), use_critic=False)
    assert "critic/score/mean/a" in keys
    assert not [key for key in keys if key.startswith(("critic/values", "critic/vf_"))]


def test_the_trainer_calls_the_wrapper_which_adds_keys_only_with_the_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``RayPPOTrainer.fit`` calls its module's ``compute_data_metrics``: with the
    integration enabled that is the wrapper. Switch off: verl's dict, exactly. On:
    verl's dict and the per-source keys. ``disable()`` puts verl's function back."""
    integration.enable()
    ray_trainer = importlib.import_module("verl.trainer.ppo.ray_trainer")
    metric_utils = importlib.import_module("verl.trainer.ppo.metric_utils")
    wrapper = ray_trainer.compute_data_metrics
    original = wrapper.__rlmetrics_wrapped__
    assert metric_utils.compute_data_metrics is wrapper
    batch = make_batch()
    monkeypatch.delenv("RLMETRICS_VERL_DETAIL", raising=False)
    assert wrapper(batch=batch, use_critic=True) == original(batch=batch, use_critic=True)
    monkeypatch.setenv("RLMETRICS_VERL_DETAIL", "1")
    on = wrapper(batch=batch, use_critic=True)
    by_source = data_metrics.data_metrics_by_source(batch)
    assert on == original(batch=batch, use_critic=True) | by_source
    assert "critic/score/mean/b" in on and "response_length/mean/a" in on
    integration.disable()
    try:
        assert ray_trainer.compute_data_metrics is original
        assert metric_utils.compute_data_metrics is original
    finally:
        integration.enable()
    assert ray_trainer.compute_data_metrics.__rlmetrics_wrapped__ is original
