"""KuaiRand-1K shaped data: a deterministic synthetic writer, the reader, and per-user day-by-day sequences.

The files follow the KuaiRand-1K release (https://kuairand.com): `user_features_1k.csv` (one row per user, the
categorical columns the recipe uses as contextual features) and `log_standard_1k.csv` (one row per impression:
user_id, video_id, date YYYYMMDD, hourmin, time_ms and the action flags). The 8 tasks are the 8 action flags;
an action token is their bitmask (task i = bit i). The real release reads the same way (the real log is split into
several files by date: concatenate them, or point --data at a folder holding one log_standard_1k.csv).
"""
from __future__ import annotations

import csv
import random
from dataclasses import dataclass, field
from pathlib import Path

TASKS = ("is_click", "is_like", "is_follow", "is_comment", "is_forward", "is_hate", "long_view", "is_profile_enter")
CONTEXTUAL = ("user_active_degree", "follow_user_num_range", "fans_user_num_range", "friend_user_num_range",
              "register_days_range")
USERS_FILE, LOG_FILE = "user_features_1k.csv", "log_standard_1k.csv"
LOG_COLUMNS = ("user_id", "video_id", "date", "hourmin", "time_ms", *TASKS)
_VALUES = {
    "user_active_degree": ("full_active", "high_active", "middle_active", "low_active"),
    "follow_user_num_range": ("0", "(0,10]", "(10,50]", "(50,100]", "(100,150]", "(150,250]", "250+"),
    "fans_user_num_range": ("0", "[1,10)", "[10,100)", "[100,1k)", "[1k,5k)", "[5k,1w)", "[1w,10w)"),
    "friend_user_num_range": ("0", "[1,5)", "[5,30)", "[30,60)", "[60,120)", "[120,250)", "250+"),
    "register_days_range": ("15-30", "31-60", "61-90", "91-180", "181-365", "366-730", "730+"),
}
_RATES = (0.45, 0.03, 0.01, 0.01, 0.01, 0.005, 0.3, 0.04)  # per-task base rates, roughly KuaiRand's


def write_synthetic(path, num_users: int = 24, num_videos: int = 400, num_days: int = 5,
                    events_per_day: tuple[int, int] = (2, 6), seed: int = 0) -> Path:
    """Write the two CSV files under `path`; same arguments, same bytes. Labels follow a hidden user x video
    affinity, so a trained model could beat AUC 0.5 (a random one does not)."""
    rng = random.Random(seed)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / USERS_FILE, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("user_id", *CONTEXTUAL))
        for u in range(num_users):
            w.writerow((u, *(rng.choice(_VALUES[c]) for c in CONTEXTUAL)))
    taste = [rng.random() for _ in range(num_users)]
    with open(path / LOG_FILE, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(LOG_COLUMNS)
        for day in range(num_days):
            date = 20220408 + day
            for u in range(num_users):
                for _ in range(rng.randint(*events_per_day)):
                    video = rng.randrange(num_videos)
                    hourmin = rng.randrange(24) * 100 + rng.randrange(60)
                    time_ms = 1649376000000 + day * 86_400_000 + (hourmin // 100 * 60 + hourmin % 100) * 60_000
                    affinity = 1.0 - abs(taste[u] - video / num_videos)  # in [0, 1]
                    flags = [int(rng.random() < min(1.0, r * 2 * affinity)) for r in _RATES]
                    w.writerow((u, video, date, hourmin, time_ms + rng.randrange(60_000), *flags))
    return path


@dataclass(slots=True)
class Event:
    video_id: int
    action: int  # bitmask of TASKS
    day: int  # index of the date among the log's dates


@dataclass(slots=True)
class User:
    user_id: int
    contextual: list[int]  # one id per CONTEXTUAL column (index into that column's sorted vocabulary)
    events: list[Event] = field(default_factory=list)  # by time


def read_dataset(path) -> tuple[list[User], list[int]]:
    """-> (users with their time-ordered events, the sorted dates). Raises ValueError with the file name when a
    file is missing or lacks a column."""
    path = Path(path)
    users_rows, log_rows = _read_csv(path / USERS_FILE, ("user_id", *CONTEXTUAL)), _read_csv(path / LOG_FILE, LOG_COLUMNS)
    vocab = {c: sorted({r[c] for r in users_rows}) for c in CONTEXTUAL}
    users = {int(r["user_id"]): User(int(r["user_id"]), [vocab[c].index(r[c]) for c in CONTEXTUAL]) for r in users_rows}
    dates = sorted({int(r["date"]) for r in log_rows})
    day_of = {d: i for i, d in enumerate(dates)}
    for r in sorted(log_rows, key=lambda r: (int(r["user_id"]), int(r["time_ms"]))):
        user = users.get(int(r["user_id"]))
        if user is None:
            raise ValueError(f"{path / LOG_FILE}: user_id {r['user_id']} is not in {USERS_FILE}")
        action = sum(int(r[t]) << i for i, t in enumerate(TASKS))
        user.events.append(Event(int(r["video_id"]), action, day_of[int(r["date"])]))
    return [users[u] for u in sorted(users)], dates


def _read_csv(file: Path, columns) -> list[dict[str, str]]:
    if not file.is_file():
        raise ValueError(f"{file}: missing")
    with open(file, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{file}: missing columns {missing}")
        return list(reader)
