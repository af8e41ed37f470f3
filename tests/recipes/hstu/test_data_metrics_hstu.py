"""Synthetic KuaiRand-shaped files, the reader, and AUC against a brute-force pair count and scikit-learn."""
import itertools

import pytest
import torch
from sklearn.metrics import roc_auc_score

from data_hstu import CONTEXTUAL, LOG_FILE, TASKS, USERS_FILE, read_dataset, write_synthetic
from metrics_hstu import auc


def test_synthetic_files_are_deterministic_and_read_back(tmp_path):
    a, b = write_synthetic(tmp_path / "a", num_users=5, num_days=3), write_synthetic(tmp_path / "b", num_users=5, num_days=3)
    for f in (USERS_FILE, LOG_FILE):
        assert (a / f).read_bytes() == (b / f).read_bytes()
    header = (a / LOG_FILE).read_text().splitlines()[0].split(",")
    assert header[:5] == ["user_id", "video_id", "date", "hourmin", "time_ms"] and header[5:] == list(TASKS)
    users, dates = read_dataset(a)
    assert len(users) == 5 and dates == [20220408, 20220409, 20220410] and len(TASKS) == 8
    for u in users:
        assert len(u.contextual) == len(CONTEXTUAL) and u.events
        assert [e.day for e in u.events] == sorted(e.day for e in u.events)
        assert all(0 <= e.action < 256 for e in u.events)


def test_reader_names_the_file_and_column(tmp_path):
    d = write_synthetic(tmp_path, num_users=2, num_days=2)
    text = (d / LOG_FILE).read_text().replace("is_click", "clicked")
    (d / LOG_FILE).write_text(text)
    with pytest.raises(ValueError, match="is_click"):
        read_dataset(d)
    with pytest.raises(ValueError, match="missing"):
        read_dataset(tmp_path / "nowhere")


def brute_auc(scores, labels):
    pos = [s for s, l in zip(scores, labels) if l]
    neg = [s for s, l in zip(scores, labels) if not l]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(5))
def test_auc_equals_the_pair_count_with_ties(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 6, (40,), generator=g).float()  # many ties
    labels = torch.rand(40, generator=g) < 0.4
    assert auc(scores, labels) == pytest.approx(brute_auc(scores.tolist(), labels.tolist()), abs=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_auc_equals_scikit_learn_with_ties(seed):
    g = torch.Generator().manual_seed(100 + seed)
    n = [7, 50, 333, 2000][seed % 4]
    levels = [3, 20, 1000, 10**6][seed // 2 % 4]  # from almost all ties to almost none
    scores = torch.randint(0, levels, (n,), generator=g).double() / levels - 0.5
    labels = torch.rand(n, generator=g) < [0.05, 0.3, 0.5, 0.9][seed % 4]
    labels[0], labels[1] = True, False  # both classes present
    assert auc(scores, labels) == pytest.approx(roc_auc_score(labels.numpy(), scores.numpy()), abs=1e-12)
    if n <= 50:  # and the pair count, where it is cheap
        assert auc(scores, labels) == pytest.approx(brute_auc(scores.tolist(), labels.tolist()), abs=1e-12)


def test_auc_edge_cases():
    assert auc(torch.tensor([0.1, 0.9]), torch.tensor([0, 1])) == 1.0
    assert auc(torch.tensor([0.1, 0.9]), torch.tensor([1, 0])) == 0.0
    assert auc(torch.tensor([0.5, 0.5]), torch.tensor([1, 0])) == 0.5
    assert auc(torch.tensor([0.1, 0.9]), torch.tensor([1, 1])) != auc(torch.tensor([0.1, 0.9]), torch.tensor([1, 1]))  # nan
