"""common.parallel: layout invariants, group membership, torchrun env handling, and a real 2x2 torchrun world."""
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from common import parallel
from common.parallel import ParallelLayout
from ports import free_port

ROOT = Path(__file__).resolve().parents[2]



def test_layout_invariants():
    assert ParallelLayout(dp=2, cfg=2, sp=2, tp=2).world_size == 16
    ParallelLayout(tp=2, dp=4, ep=8).check_world(8)
    with pytest.raises(ValueError, match="world has 6 ranks"):
        ParallelLayout(sp=4).check_world(6)
    with pytest.raises(ValueError, match="int >= 1"):
        ParallelLayout(sp=0)
    with pytest.raises(ValueError, match="cfg is 1 or 2"):
        ParallelLayout(cfg=3)
    with pytest.raises(ValueError, match="multiple of tp"):
        ParallelLayout(tp=4, dp=2, ep=2)
    with pytest.raises(ValueError, match="sp = cfg = 1"):
        ParallelLayout(sp=2, dp=2, ep=2)


def test_group_ranks():
    layout = ParallelLayout(dp=2, cfg=2, sp=2)  # mesh [dp, cfg, sp, tp] = [2, 2, 2, 1], tp fastest
    assert layout.group_ranks("sp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.group_ranks("cfg") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.group_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.group_ranks("tp") == [[r] for r in range(8)]
    assert ParallelLayout(dp=2, tp=2, ep=4).group_ranks("ep") == [[0, 1, 2, 3]]
    with pytest.raises(KeyError):
        layout.group_ranks("pp")


def test_single_process_mode(monkeypatch):
    for k in parallel.TORCHRUN_ENV:
        monkeypatch.delenv(k, raising=False)
    par = parallel.init_parallel()
    assert not dist.is_initialized() and par.world_size == 1 and par.group("sp") is None
    assert par.size("sp") == 1 and par.rank_in("sp") == 0
    x = torch.randn(2, 4, 3)
    assert parallel.all_gather(x, None, dim=1) is x
    assert parallel.all_to_all(x, None, scatter_dim=2, gather_dim=1) is x
    with pytest.raises(ValueError, match="world has 1 ranks"):
        parallel.init_parallel(ParallelLayout(sp=2))


def test_incomplete_env_names_missing_var(monkeypatch):
    for k in parallel.TORCHRUN_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set"):
        parallel.init_parallel()


WORKER = textwrap.dedent("""
    import torch
    from common import parallel
    par = parallel.init_parallel(parallel.ParallelLayout(cfg=2, sp=2), timeout_s=30)
    rank = par.rank
    assert par.rank_in("sp") == rank % 2 and par.rank_in("cfg") == rank // 2, rank
    assert par.group("tp") is None and par.group("dp") is None
    sp = par.group("sp")
    x = torch.full((1, 2), float(rank))
    assert parallel.all_gather(x, sp, dim=0).flatten().tolist() == [rank - rank % 2] * 2 + [rank - rank % 2 + 1] * 2
    assert parallel.all_gather(x, par.group("cfg"), dim=1).flatten().tolist() == [rank % 2] * 2 + [rank % 2 + 2] * 2
    y = torch.arange(8.).view(1, 2, 4) + 100 * rank  # [B, S/P, H]: heads scattered, sequence gathered
    z = parallel.all_to_all(y, sp, scatter_dim=2, gather_dim=1)  # [B, S, H/P]
    base = 100 * (rank - rank % 2)
    h = 2 * (rank % 2)
    want = torch.tensor([[[h, h + 1], [h + 4, h + 5], [h + 100, h + 101], [h + 104, h + 105]]]) + base
    assert torch.equal(z, want.float()), (rank, z)
    assert torch.equal(parallel.all_to_all(z, sp, scatter_dim=1, gather_dim=2), y)
    assert parallel.all_reduce(torch.ones(1), sp).item() == 2
    parallel.destroy_parallel()
    print(f"ok {rank}", flush=True)
""")


@pytest.mark.slow
def test_torchrun_world_of_four(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "NPU_COOKBOOK_DEVICE": "cpu", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(script)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert all(f"ok {r}" in res.stdout for r in range(4)), res.stdout  # ranks' lines may interleave


@pytest.mark.slow
def test_missing_rank_times_out_instead_of_hanging(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NPU_COOKBOOK_DEVICE": "cpu", "RANK": "0", "WORLD_SIZE": "2",
           "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    code = "from common import parallel; parallel.init_parallel(timeout_s=2)"
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and time.monotonic() - start < 30
    assert "rank 0 of 2: gloo process group at 127.0.0.1" in res.stderr and "within 2 s" in res.stderr


def _dispatch_both_ways(out_dir):
    """Each rank routes rows to 4 experts (2 a rank) with its own counts, one of them all to a single expert:
    the fixed-capacity dispatch (graph mode) hands each expert the rows the split dispatch does, and both
    combines return every row to where it came from."""
    par = parallel.init_parallel(parallel.LLMParallelLayout(world_size=2), timeout_s=60)
    try:
        group = par.group("moe_ep")
        counts = torch.tensor([[2, 0, 1, 3], [0, 0, 0, 5]][par.rank])  # rank 1: every row to expert 3 (rank 1)
        rows = torch.randn(int(counts.sum()), 3, generator=torch.Generator().manual_seed(par.rank))  # [M, D]
        split_rows, split_counts, split = parallel.dispatch_to_experts(rows, counts, group)
        fixed_rows, fixed_counts, fixed = parallel.dispatch_to_experts(rows, counts, group, capacity=6)  # every rank's
        n = int(split_counts.sum())
        assert torch.equal(fixed_counts, split_counts) and fixed_rows.shape[0] == 2 * 6 >= n
        assert torch.equal(fixed_rows[:n], split_rows)  # the same rows in the same expert order; padding after
        expert = torch.repeat_interleave(torch.arange(2), split_counts)  # [n] local expert of each row
        scale = lambda x, e: x * (10 * par.rank + e[:, None] + 1)  # noqa: E731 - an "expert" that tells them apart
        y_fixed = torch.cat([scale(fixed_rows[:n], expert), fixed_rows[n:]])
        back_split = parallel.combine_from_experts(scale(split_rows, expert), split, group)
        back_fixed = parallel.combine_from_experts(y_fixed, fixed, group)
        assert torch.equal(back_fixed, back_split)
        owner_expert = torch.repeat_interleave(torch.arange(4), counts)  # global expert of each row sent
        torch.testing.assert_close(back_split, rows * (10 * (owner_expert // 2) + owner_expert % 2 + 1)[:, None])
        with pytest.raises(ValueError, match="capacity"):
            parallel.dispatch_to_experts(rows, counts, group, capacity=4)
        (out_dir / f"ok{par.rank}").touch()
    finally:
        parallel.destroy_parallel()


@pytest.mark.slow
def test_fixed_capacity_expert_dispatch_equals_the_split_one(tmp_path):
    from dist_helpers import run_ranks
    run_ranks(_dispatch_both_ways, 2, tmp_path)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()
