"""Two ranks with uneven shares and micro-batches log what one process with the whole
batch would: run with ``torchrun --nproc-per-node 2 docs/examples/two_ranks.py``."""

import torch
import torch.distributed as dist

from rlmetrics import Tracker

dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
rank = dist.get_rank()

torch.manual_seed(0)  # the same batch on every rank; each rank takes its own rows
loss = torch.rand(10, 6, dtype=torch.float64)  # per-token losses of 10 responses
mask = (torch.arange(6) < torch.randint(1, 7, (10, 1))).double()  # response tokens
rows = torch.arange(10).split([7, 3])[rank]  # uneven shares: 7 rows and 3 rows

tracker = Tracker()
micro_means = []  # what a per-micro-batch logger would keep
for micro in rows.split(2):  # micro-batches of 2 rows (the last may hold 1)
    tracker.mean("pg_loss", loss[micro], weight=mask[micro])
    tracker.max("response_length", mask[micro].sum(-1))
    micro_means.append((loss[micro] * mask[micro]).sum() / mask[micro].sum())
metrics = tracker.compute()  # one packed collective; every rank gets the same dict

naive = torch.stack(micro_means).mean()  # this rank's mean of micro-batch means,
dist.all_reduce(naive)  # then the mean over ranks
naive /= dist.get_world_size()
whole = (loss * mask).sum() / mask.sum()  # one process, the whole batch
if rank == 0:
    print(f"pg_loss          {metrics['pg_loss']:.12f}")
    print(f"  whole batch    {whole.item():.12f}")
    print(f"  naive          {naive.item():.12f}")
    print(f"response_length  {metrics['response_length']:g}")
dist.destroy_process_group()
