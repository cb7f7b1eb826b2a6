"""The reference trainer under torchrun (any number of nodes; NCCL on GPUs, else gloo).

    torchrun --nproc-per-node 2 -m rlmetrics.trainer --steps 100
    torchrun --nproc-per-node 8 -m rlmetrics.trainer --algo ppo --micro-batch-size 16
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m rlmetrics.trainer --num-prompts 256

Without torchrun, ``rlmetrics demo --dp 2`` spawns the ranks itself. The flags are the
demo's (``rlmetrics demo --help``); ``--dp`` is ignored: torchrun sets the world size.
"""

import sys

from rlmetrics.cli import main
from rlmetrics.trainer.launch import exit_now

if __name__ == "__main__":
    code = main(["train", *sys.argv[1:]])
    exit_now(code if isinstance(code, int) else 0)  # skip teardown: see exit_now
