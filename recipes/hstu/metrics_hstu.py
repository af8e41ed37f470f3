"""Ranking metrics without scikit-learn: AUC by the rank (Mann-Whitney) formula, ties given their average rank."""
from __future__ import annotations

import torch


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """P(score of a random positive > score of a random negative), ties counting one half; nan without both
    classes."""
    scores, labels = scores.double().flatten().cpu(), labels.flatten().cpu().bool()
    n_pos = int(labels.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    average_rank = counts.cumsum(0).double() - (counts.double() - 1) / 2  # 1-based ranks, ties averaged
    rank_sum = average_rank[inverse][labels].sum().item()
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)
