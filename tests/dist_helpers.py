"""Run a function on N local gloo ranks (torch.multiprocessing spawn) with the torchrun environment set."""
from __future__ import annotations

import os

import torch.multiprocessing as mp

from ports import free_port



def _rank_main(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NPU_COOKBOOK_DEVICE="cpu")
    fn(*args)


def run_ranks(fn, world: int, *args) -> None:
    """fn(*args) on `world` processes; an exception in any rank fails the caller (mp.ProcessRaisedException)."""
    mp.spawn(_rank_main, args=(world, free_port(), fn, args), nprocs=world, join=True)
