"""TRL's own GRPOTrainer tests, run with trl.GRPOTrainer and with ExactGRPOTrainer.

    .venv-trl/bin/python benchmarks/trl_own_tests.py TRL_CHECKOUT --out DIR [-k EXPR]

TRL_CHECKOUT is a checkout of github.com/huggingface/trl (its ``tests/`` is copied to a
temporary directory and run from there; nothing of it enters this repository). The
tests load tiny models and a small dataset from the Hugging Face Hub; this machine has no
network, so the script saves local stand-ins into a temporary Hub cache (``HF_HOME``,
offline): each ``trl-internal-testing/tiny-<Class>`` id gets a model of that class built
from a tiny config of its architecture, with a byte-level tokenizer that has a
ChatML-style chat template, and ``trl-internal-testing/zen`` is served by
``trl_own_tests_plugin`` (prompts of the same columns and splits). Ids without a stand-in
(vision models, remote code, full-size checkpoints) stay missing, so their tests fail
with either trainer.

Both runs use the same files and seed, side by side; the second swaps ``GRPOTrainer``
for ``ExactGRPOTrainer`` in the test module (``RLMETRICS_TRAINER=exact``). A test that
sets no ``max_steps`` trains ``--max-steps`` steps (2) instead of its epochs. Outcomes go
to ``DIR/{plain,exact}.jsonl`` as tests end; the script prints each run's counts and
every test whose outcome differs between the two.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
TEST_FILE = "tests/test_grpo_trainer.py"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# a ChatML-style template: each message between <|im_start|>role and <|im_end|>
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# tiny sizes shared by every stand-in (the architectures' own defaults otherwise)
TINY = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 4,
    "max_position_embeddings": 512,
}


def tokenizer() -> Any:
    """A byte-level tokenizer (every byte a token, no merges) with ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def stand_ins(vocab_size: int, pad: int, eos: int) -> dict[str, Any]:
    """Hub id -> an untrained tiny model of the id's class."""
    import transformers as tf

    common = {**TINY, "vocab_size": vocab_size, "pad_token_id": pad, "eos_token_id": eos}
    common["bos_token_id"] = None
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    configs: dict[str, Any] = {
        "tiny-Qwen2ForCausalLM-2.5": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
        "tiny-Qwen2ForSequenceClassification-2.5": (
            tf.Qwen2Config,
            tf.Qwen2ForSequenceClassification,
            {"num_labels": 1},
        ),
        "tiny-Qwen3ForCausalLM": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {}),
        "tiny-Qwen3ForSequenceClassification": (
            tf.Qwen3Config,
            tf.Qwen3ForSequenceClassification,
            {"num_labels": 1},
        ),
        "tiny-Qwen3MoeForCausalLM": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, moe),
        "tiny-LlamaForCausalLM-3.2": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "tiny-LlamaForSequenceClassification-3.2": (
            tf.LlamaConfig,
            tf.LlamaForSequenceClassification,
            {"num_labels": 1},
        ),
        "tiny-MistralForCausalLM-0.2": (tf.MistralConfig, tf.MistralForCausalLM, {}),
        "tiny-Gemma2ForCausalLM": (tf.Gemma2Config, tf.Gemma2ForCausalLM, {}),
        "tiny-Cohere2ForCausalLM": (tf.Cohere2Config, tf.Cohere2ForCausalLM, {}),
        "tiny-GptOssForCausalLM": (
            tf.GptOssConfig,
            tf.GptOssForCausalLM,
            {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8},
        ),
        "tiny-Glm4MoeForCausalLM": (
            tf.Glm4MoeConfig,
            tf.Glm4MoeForCausalLM,
            {
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 16,
                "first_k_dense_replace": 1,
                "n_group": 1,
                "topk_group": 1,
            },
        ),
    }
    models = {}
    for name, (config_class, model_class, extra) in configs.items():
        config = config_class(**{**common, **extra})
        models[f"trl-internal-testing/{name}"] = model_class(config)
    return models


def build_hub_cache(hf_home: Path) -> list[str]:
    """Save every stand-in (model and tokenizer) where an offline ``from_pretrained`` of
    its Hub id finds it; the ids saved."""
    import torch

    tok = tokenizer()
    torch.manual_seed(0)
    pad, eos = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    saved = []
    for repo_id, model in stand_ins(len(tok), pad, eos).items():
        snapshot = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
        revision = "0" * 40
        (snapshot / "refs").mkdir(parents=True, exist_ok=True)
        (snapshot / "refs" / "main").write_text(revision)
        path = snapshot / "snapshots" / revision
        model.save_pretrained(path)
        tok.save_pretrained(path)
        saved.append(repo_id)
    return saved


def launch(tests: Path, env: dict[str, str], trainer: str, extra: list[str], out: Path) -> Any:
    """Start one pytest run of the test file; its outcomes go to ``out/<trainer>.jsonl``."""
    command = [
        *(sys.executable, "-m", "pytest", TEST_FILE, "-p", "trl_own_tests_plugin"),
        *("-p", "no:cacheprovider", "-q", "--timeout", "900"),
        *extra,
    ]
    run_env = {**env, "RLMETRICS_TRAINER": trainer}
    run_env["RLMETRICS_OUTCOMES"] = str(out / f"{trainer}.jsonl")
    log = open(out / f"{trainer}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(command, cwd=tests.parent, env=run_env, stdout=log, stderr=log)


def outcomes(path: Path) -> dict[str, dict[str, str]]:
    """Test id -> its outcome line (passed, failed, error or skipped, and the message)."""
    if not path.exists():
        return {}
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return {line["test"]: line for line in lines}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkout", type=Path, help="a checkout of huggingface/trl")
    parser.add_argument("-k", default=None, help="pytest -k expression")
    parser.add_argument("--max-steps", type=int, default=2, help="steps of a test that sets none")
    parser.add_argument("--out", type=Path, required=True, help="where the outcomes go")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="trl-own-tests-") as tmp:
        work = Path(tmp)
        tests = work / "trl" / "tests"
        shutil.copytree(args.checkout / "tests", tests)
        hf_home = work / "hf_home"
        env = {
            **os.environ,
            "HF_HOME": str(hf_home),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "HOME": str(work),
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            "RLMETRICS_MAX_STEPS": str(args.max_steps),
            "PYTHONPATH": os.pathsep.join([str(HERE), str(SRC), os.environ.get("PYTHONPATH", "")]),
        }
        os.environ.update({"HF_HOME": env["HF_HOME"], "HF_HUB_OFFLINE": "1"})
        saved = build_hub_cache(hf_home)
        print(f"stand-ins: {len(saved)} models", flush=True)
        extra = [] if args.k is None else ["-k", args.k]
        for trainer in ("plain", "exact"):
            (args.out / f"{trainer}.jsonl").unlink(missing_ok=True)
        runs = [launch(tests, env, trainer, extra, args.out) for trainer in ("plain", "exact")]
        for process in runs:
            process.wait()
    print_summary(outcomes(args.out / "plain.jsonl"), outcomes(args.out / "exact.jsonl"))


def print_summary(plain: dict[str, dict], exact: dict[str, dict]) -> None:
    """Each run's counts (over the tests both ran) and every outcome that differs."""
    both = plain.keys() & exact.keys()
    print("\n| trainer | tests | passed | failed | error | skipped |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, result in (("GRPOTrainer", plain), ("ExactGRPOTrainer", exact)):
        c = Counter(result[name]["outcome"] for name in both)
        row = (len(both), c["passed"], c["failed"], c["error"], c["skipped"])
        print(f"| {label} | " + " | ".join(map(str, row)) + " |")
    differ = sorted(n for n in both if plain[n]["outcome"] != exact[n]["outcome"])
    print(f"\noutcomes that differ: {len(differ)}")
    for name in differ:
        message = exact[name].get("message") or plain[name].get("message", "")
        print(f"- {name}: {plain[name]['outcome']} / {exact[name]['outcome']}: {message}")


if __name__ == "__main__":
    main()
