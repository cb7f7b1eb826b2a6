"""Short GRPO runs on a tiny local model, recording what each trainer logged and the
per-token values it computed them from (shared by the tests and the benchmark).

A run is described by a ``RunSpec`` (a split and a GRPOConfig variant); ``run`` trains
for ``max_steps`` optimizer steps and returns, per process, the logged dicts and every
micro-batch's raw values (masks, log-probs, entropies, advantages, rewards) as numpy
arrays, from which ``reference.py`` recomputes each metric over the whole batch.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

# few words, so that <eos> is sampled often and completion lengths vary
WORDS = ["a", "b", "c", "d", "e", "f", "g", "h"]
SPECIAL = ["<pad>", "<unk>", "<eos>"]
PROMPTS = ["a b c", "d e f g", "h a", "b c d e f", "g h a", "b d f h", "c e", "a c e g"]
# the dataset's `data_source` column: a function of the prompt, so the reference can
# recover each row's source from its prompt tokens, independently of the trainer
SOURCE_COLUMN = "data_source"

# the tests' runs: beta > 0 (so `kl` is logged), num_iterations=2 (step 2 reuses step
# 1's generations, so it clips); the splits (per-device batch x accumulation) of the 8
# completions per step on one and on two processes; ExtraMetrics with every switch on
OPTIONS = {"beta": 0.04, "num_iterations": 2}
ONE_PROCESS = [(8, 1), (4, 2), (2, 4)]
TWO_PROCESSES = [(4, 1), (2, 2), (1, 4)]
EXTRA = {"by_column": SOURCE_COLUMN, "token_quantiles": True, "tokens_per_second": True}
EXTRA_SPLITS = [(2, 2), (1, 4)]
# an options entry that names a variant in RunSpec.key (taken out before GRPOConfig)
TAG = "tag"
# the "late" order: the dataset in this order, unshuffled, so that on two processes the
# first generation batch (steps 1-2) holds short prompts only and the second (steps
# 3-4) brings the first long one: a source that first turns up at step 3
LATE_PROMPTS = ["a b c", "h a", "d e f g", "g h a", "c e", "b c d e f", "b d f h", "a c e g"]
LATE_STEPS = 4


def source_of(prompt: str) -> str:
    return "short" if len(prompt.split()) <= 3 else "long"


def prompt_of(ids: np.ndarray) -> str:
    """A prompt's text from its (left-padded) token ids: the word tokens, in order."""
    return " ".join(WORDS[int(i) - len(SPECIAL)] for i in ids if i >= len(SPECIAL))


@dataclass(frozen=True)
class RunSpec:
    """One run: the trainer, the split of the 8 completions per step, the GRPO options."""

    trainer: str  # "exact" or "plain"
    per_device: int
    accumulation: int
    options: dict[str, Any] = field(default_factory=dict)
    max_steps: int = 2
    logging_steps: int = 1
    extra: dict[str, Any] | None = None  # ExtraMetrics' fields (exact only); None: off
    order: str = "shuffled"  # the dataset: PROMPTS shuffled, or "late" (LATE_PROMPTS)
    model: str = "qwen2"  # or "qwen3_moe": the tiny MoE model (MOE_SUBDIR)

    @property
    def split(self) -> str:
        return f"{self.per_device}x{self.accumulation}"

    @property
    def key(self) -> tuple[str, str]:
        """(trainer, split), the trainer marked "+extra" when ExtraMetrics is on, "+late"
        for the late order, "+<model>" for another model and "+<tag>" for the options'
        ``TAG`` entry, which names a variant (it is no GRPOConfig field)."""
        trainer = self.trainer + ("+extra" if self.extra is not None else "")
        trainer += "+late" if self.order == "late" else ""
        trainer += "" if self.model == "qwen2" else f"+{self.model}"
        trainer += f"+{self.options[TAG]}" if TAG in self.options else ""
        return (trainer, self.split)


def build_model_dir(path: Path) -> Path:
    """A word-level tokenizer and a 2-layer, 32-wide Qwen2, saved without any download;
    in ``path / MOE_SUBDIR`` the same tokenizer and a tiny Qwen3-MoE."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>"
    )
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=vocab["<pad>"],
        eos_token_id=vocab["<eos>"],
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _build_moe(path / MOE_SUBDIR, len(vocab), vocab["<pad>"], vocab["<eos>"])
    tokenizer.save_pretrained(path / MOE_SUBDIR)
    return path


# where build_model_dir saves the MoE model, under the Qwen2's directory
MOE_SUBDIR = "qwen3_moe"


def _build_moe(path: Path, vocab_size: int, pad: int, eos: int) -> None:
    """A 2-layer, 32-wide Qwen3-MoE: 4 experts, 2 per token, every layer sparse. Its
    config keeps the architecture's defaults otherwise: ``router_aux_loss_coef=0.001``
    and ``output_router_logits`` present, so TRL adds the load-balancing loss."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        pad_token_id=pad,
        eos_token_id=eos,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def reward_vowels(completions: list[str], log_metric: Any = None, **_: Any) -> list[float]:
    """Fraction of vowel words; logs the mean completion length through ``log_metric``."""
    words = [text.split() for text in completions]
    if log_metric is not None:
        log_metric("vowel_reward/mean_words", float(np.mean([len(w) for w in words])))
    return [sum(w in "aeiou" for w in ws) / max(len(ws), 1) for ws in words]


def reward_short(completions: list[str], **_: Any) -> list[float | None]:
    """Shorter is better; None (not applicable) for completions starting with 'a'."""
    return [None if text.startswith("a") else -len(text.split()) / 8 for text in completions]


# reads of a tensor's value by the host: on a GPU each one waits for the device
# (``numpy()`` is left out: it needs a CPU tensor, so a ``cpu()`` came first)
HOST_READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "cpu"})
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "gather",
    "gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter_tensor",
    "barrier",
)


class SyncCounter(torch.overrides.TorchFunctionMode):
    """Counts host reads of tensors and torch.distributed collectives, by phase (the
    trainer method running: "forward" (the model's, inside the loss or generation),
    "loss", "generation", "log"; "other" outside them).

    While counting, the Tracker sends CPU tensors down the path device tensors take
    (``Tracker.reduce_host_data_with_numpy = False``): on the CPU its host path reads them with
    numpy, which is no sync there, and on a GPU the tensor path is the one that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "other"
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.phase != "capture" and getattr(func, "__name__", "") in HOST_READS:
            self.counts[f"{self.phase}/host_reads"] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def phase_of(self, phase: str) -> Iterator[None]:
        outer, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = outer

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Wrap the public collectives (internal calls between them are not counted)."""
        import torch.distributed as dist

        saved = {name: getattr(dist, name) for name in COLLECTIVES}

        def wrap(name: str, func: Any) -> Any:
            def counted(*args: Any, **kwargs: Any) -> Any:
                self.counts[f"{self.phase}/collectives"] += 1
                return func(*args, **kwargs)

            return counted

        import pytest

        from rlmetrics import Tracker

        with pytest.MonkeyPatch.context() as patch:
            for name, func in saved.items():
                patch.setattr(dist, name, wrap(name, func))
            patch.setattr(Tracker, "reduce_host_data_with_numpy", False)
            with self:
                yield


def _capturing(base: type) -> type:
    """``base`` with hooks that record each micro-batch's raw values for the reference,
    and mark the phases a ``SyncCounter`` counts by."""

    class Capturing(base):  # type: ignore[misc, valid-type]
        counter = SyncCounter()

        def log(self, *args: Any, **kwargs: Any) -> Any:
            before = dict(self.counter.counts)
            with self.counter.phase_of("log"):
                out = super().log(*args, **kwargs)
            after = self.counter.counts
            self.log_counts.append({k: after[k] - before.get(k, 0) for k in after})
            return out

        def _generate_and_score_completions(self, *args: Any) -> Any:
            with self.counter.phase_of("generation"):
                return super()._generate_and_score_completions(*args)

        def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
            with self.counter.phase_of("forward"):
                out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            if kwargs.get("compute_entropy") and self.model.training:
                self.captured_forward = out
            return out

        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
            with self.counter.phase_of("loss"):
                loss = super()._compute_loss(model, inputs)
            logps, entropies, aux = self.captured_forward
            item = {"step": self.state.global_step + 1, "logp": logps, "entropy": entropies}
            item["aux"] = aux  # the MoE load-balancing loss (None without one)
            keys = ("completion_mask", "advantages", "old_per_token_logps", "prompt_ids")
            for key in (*keys, "prompt_mask"):
                item[key] = inputs.get(key)
            item["ref"] = inputs.get("ref_per_token_logps")
            self._capture(item)
            return loss

        def _capture(self, item: dict[str, Any]) -> None:
            with self.counter.phase_of("capture"):  # the test's own reads: not counted
                self.captures.append({k: _np(v) for k, v in item.items() if v is not None})

        def _calculate_rewards(self, *args: Any) -> Any:
            rewards = super()._calculate_rewards(*args)
            sources = np.array([source_of(prompt) for prompt in args[1]])  # this process's
            item = {"step": self.state.global_step + 1, "rewards": rewards}
            self._capture({**item, "reward_sources": sources})
            return rewards

        def _generate(self, prompts: list) -> Any:
            out = super()._generate(prompts)
            lengths = [len(ids) for ids in out[1]]
            # TRL's definition: truncated unless the last token is EOS or pad
            stops = {self.processing_class.eos_token_id, self.processing_class.pad_token_id}
            truncated = [ids[-1] not in stops for ids in out[1]]
            words = [sum(i >= len(SPECIAL) for i in ids) for ids in out[1]]
            item = {"step": self.state.global_step + 1, "lengths": np.array(lengths, float)}
            item["words"] = np.array(words, float)
            item["sources"] = np.array([source_of(prompt) for prompt in prompts])
            self._capture({**item, "truncated": np.array(truncated)})
            return out

    return Capturing


def _np(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().double().cpu().numpy()
    return value


def make_config(spec: RunSpec, out_dir: str) -> Any:
    from trl import GRPOConfig

    options = {"beta": 0.0, "learning_rate": 0.05, "num_generations": 4, **spec.options}
    options.pop(TAG, None)
    if spec.order == "late":
        options["shuffle_dataset"] = False
    return GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=spec.per_device,
        gradient_accumulation_steps=spec.accumulation,
        max_steps=spec.max_steps,
        logging_steps=spec.logging_steps,
        max_completion_length=8,
        temperature=1.0,
        seed=0,
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **options,
    )


def late_source_specs() -> list[RunSpec]:
    """The first-step comparison's runs, each the first in its own launch (so each
    starts as a job does, on a process group no tracker has synced over): the late
    order at 2x2, with and without ExtraMetrics."""
    return [
        RunSpec("exact", 2, 2, OPTIONS, LATE_STEPS, extra=extra, order="late")
        for extra in (EXTRA, None)
    ]


# TRL 1.16's other loss types and loss terms, grouped so that few runs cover them all:
# name -> (GRPOConfig options, processes, split, logging_steps). Each variant has a
# metric that plain TRL logs split-dependently: cispo's cispo_clip_ratio (a mean of
# micro-batch means), vespo's policy_loss (divided by the accumulation steps) and its
# adaptive entropy_coef (a mean over the window's steps); sapo's and luspo's entropy
# and KL. epsilon_high=1.1 gives cispo's cap a ratio that step 2 reaches; an entropy
# target above the tiny model's entropy keeps the adaptive bonus applied.
LOSS_VARIANTS: dict[str, tuple[dict[str, Any], int, tuple[int, int], int]] = {
    "cispo": (
        {
            "loss_type": "cispo",
            "epsilon_high": 1.1,
            "top_entropy_quantile": 0.5,
            "multi_objective_aggregation": "normalize_then_sum",
        },
        2,
        (1, 4),
        1,
    ),
    "vespo": (
        {
            "loss_type": "vespo",
            "use_adaptive_entropy": True,
            "entropy_coef": 0.01,
            "entropy_target": 10.0,
        },
        2,
        (1, 4),
        2,
    ),
    "sapo": ({"loss_type": "sapo", "off_policy_mask_threshold": 0.01}, 1, (4, 2), 1),
    "luspo": (
        {"loss_type": "luspo", "importance_sampling_level": "sequence", "entropy_coef": 0.01},
        1,
        (4, 2),
        1,
    ),
}


def variant_specs(processes: int) -> list[RunSpec]:
    """Both trainers on every loss variant run on ``processes`` processes."""
    specs = []
    for name, (options, procs, (per_device, accumulation), logging) in LOSS_VARIANTS.items():
        if procs == processes:
            options = {**OPTIONS, **options, TAG: name}
            specs += [
                RunSpec(t, per_device, accumulation, options, logging_steps=logging)
                for t in ("exact", "plain")
            ]
    return specs


def moe_specs(splits: list[tuple[int, int]]) -> list[RunSpec]:
    """Both trainers on the tiny MoE at every split of ``splits``."""
    return [
        RunSpec(t, p, a, OPTIONS, model="qwen3_moe") for t in ("exact", "plain") for p, a in splits
    ]


def two_process_specs() -> list[RunSpec]:
    """The specs of the tests' one torchrun launch: both trainers at every two-process
    split, on the Qwen2 and on the MoE, ExactGRPOTrainer with ExtraMetrics at
    EXTRA_SPLITS, and the loss variants run on two processes."""
    runs = [RunSpec(t, p, a, OPTIONS) for t in ("exact", "plain") for p, a in TWO_PROCESSES]
    runs += [RunSpec("exact", p, a, OPTIONS, extra=EXTRA) for p, a in EXTRA_SPLITS]
    return runs + moe_specs(TWO_PROCESSES) + variant_specs(2)


def run(
    spec: RunSpec, model_dir: Path, out_dir: str, count: bool = False, warn: bool = False
) -> dict[str, Any]:
    """Train one spec; this process's logs (``state.log_history``) and captures, and with
    ``count`` its host reads and collectives by phase. ``warn`` lets the trainer's
    construction warnings through (TRL's are many, so they are silenced otherwise)."""
    import warnings

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOTrainer

    import rlmetrics
    from rlmetrics.integrations.trl import ExactGRPOTrainer, ExtraMetrics

    base = ExactGRPOTrainer if spec.trainer == "exact" else GRPOTrainer
    extra = {} if spec.extra is None else {"extra_metrics": ExtraMetrics(**spec.extra)}
    if spec.model != "qwen2":
        model_dir = model_dir / MOE_SUBDIR
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompts = LATE_PROMPTS * 4 if spec.order == "late" else PROMPTS * 4
    sources = [source_of(prompt) for prompt in prompts]
    dataset = Dataset.from_dict({"prompt": prompts, SOURCE_COLUMN: sources})
    with warnings.catch_warnings():
        if not warn:
            warnings.simplefilter("ignore")
        trainer = _capturing(base)(
            model=model,
            reward_funcs=[reward_vowels, reward_short],
            args=make_config(spec, out_dir),
            train_dataset=dataset,
            processing_class=tokenizer,
            **extra,
        )
    trainer.captures = []
    counter = trainer.counter = SyncCounter()
    trainer.log_counts = []  # per log() call, what the whole log call counted
    with counter.counting() if count else contextlib.nullcontext():
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "entropy" in entry]
    result = {"spec": asdict(spec), "logs": logs, "captures": trainer.captures}
    result["rlmetrics_file"] = rlmetrics.__file__  # which tree the run imported
    return {**result, "counts": dict(counter.counts), "log_counts": trainer.log_counts}


def save(result: dict[str, Any], path: Path) -> None:
    """Pickle-free storage: the logs as JSON, the captures as an npz next to it."""
    arrays = {
        f"{i}/{key}": np.asarray(value)
        for i, item in enumerate(result["captures"])
        for key, value in item.items()
    }
    np.savez(path.with_suffix(".npz"), **arrays)
    keys = ("spec", "logs", "counts", "log_counts", "rlmetrics_file")
    meta = {key: result[key] for key in keys}
    path.with_suffix(".json").write_text(json.dumps(meta))


def load(path: Path) -> dict[str, Any]:
    data = json.loads(path.with_suffix(".json").read_text())
    captures: dict[int, dict[str, Any]] = {}
    with np.load(path.with_suffix(".npz")) as arrays:
        for name in arrays.files:
            index, key = name.split("/", 1)
            value = arrays[name]
            captures.setdefault(int(index), {})[key] = value.item() if key == "step" else value
    data["captures"] = [captures[i] for i in sorted(captures)]
    return data


HERE = Path(__file__).resolve().parent
SRC = HERE.parents[2] / "src"  # the tree under test, which torchrun's processes import


def launch_two_processes(specs: list[RunSpec], model_dir: Path, out: Path) -> dict:
    """Run every spec in one torchrun launch (2 processes, gloo): spec.key -> per rank.

    The processes get this directory and this tree's ``src`` first on PYTHONPATH (then
    the caller's), so they import the rlmetrics under test, whatever is installed; each
    result records the ``rlmetrics.__file__`` it imported."""
    specs_path = out / "specs.json"
    specs_path.write_text(json.dumps([vars(spec) for spec in specs]))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"),
        *("--master_addr", "127.0.0.1", "--master_port", str(port)),
        *(str(HERE / "run_dist.py"), str(specs_path), str(model_dir), str(out)),
    ]
    path = [str(HERE), str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path)}
    done = run_launch(command, env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return {
        spec.key: [load(out / f"{index}-rank{rank}.json") for rank in range(2)]
        for index, spec in enumerate(specs)
    }


def run_launch(
    command: list[str], env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run a launch (torchrun and its worker processes) in a session of its own, its
    output captured. Past ``timeout`` seconds the whole session is killed, workers
    included (killing torchrun's agent alone leaves them running), and TimeoutError
    says so with the end of what the launch wrote to stderr."""
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    ) as launch:  # fmt: skip
        try:
            out, err = launch.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(launch.pid, signal.SIGKILL)
            out, err = launch.communicate()
            message = f"the launch ran past {timeout:.0f} s and was killed:\n{err[-4000:]}"
            raise TimeoutError(message) from None
    return subprocess.CompletedProcess(command, launch.returncode, out, err)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def leave() -> None:
    """End a torchrun process whose results are saved, without tearing torch down.

    Tearing down a gloo group that DDP and accelerate used can fail after every result
    is saved: gloo's worker thread may still be releasing a finished collective's
    tensors, which needs the GIL, while the interpreter's finalization aborts the
    process ("terminate called without an active exception") or the main thread,
    holding the GIL, joins that thread (a deadlock). A barrier first, so that no rank
    leaves while another still waits for its part of a collective; then the process
    exits at once, as the reference trainer's ranks do."""
    from rlmetrics.trainer.launch import exit_now

    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    exit_now(0)
