"""Which routed experts are resident on the device: N fixed slots per MoE layer, the rest on the host.

Policies pick each layer's resident experts: `PrefixPlacement` (experts 0..N-1), `FrequencyPlacement` (the N most
routed, from a routing-count file), `DynamicPlacement` (after a request's prefill, the N its prompt routed most,
swapped into the slots in place). `ResidentExperts` keeps the tables (slot -> expert, expert -> slot) as tensors
updated in place, so a captured graph that reads them stays valid, and splits a router's output in two:

- device side: a resident pair becomes (its slot, its weight); any other pair becomes (slot 0, weight 0), never
  -1, which Ascend's routing kernels reject. Slot 0's expert runs on those rows, times 0.
- host side: a non-resident pair keeps (expert, weight); a resident one becomes (-1, 0), which host backends skip.

Routing-count file (JSON), what `RoutingCounter.save` writes and `load_routing_counts` reads:

    {"format": "expert-routing-counts", "num_experts": E, "tokens": {"<layer>": n, ...},
     "counts": {"<layer>": [c_0, ..., c_{E-1}], ...}}

layer: the model's layer index of each MoE layer (V4's hash-routed layers included); c_e: how many (token, expert)
pairs routed to expert e; tokens: how many tokens the layer saw.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

COUNTS_FORMAT = "expert-routing-counts"


def top_experts(counts: torch.Tensor, n: int, prefer: Iterable[int] = ()) -> list[int]:
    """The n experts with the most routed pairs; ties go to an expert in `prefer` (already resident), then the
    lower id."""
    prefer = set(prefer)
    order = sorted(range(len(counts)), key=lambda e: (-int(counts[e]), e not in prefer, e))
    return order[:n]


def _check_slots(num_slots: int) -> None:
    if not isinstance(num_slots, int) or num_slots < 0:
        raise ValueError(f"num_slots must be an int >= 0, got {num_slots!r}")


def _check_counts(counts: Mapping[int, torch.Tensor]) -> None:
    if not counts:
        raise ValueError("routing counts have no layer")
    sizes = {tuple(c.shape) for c in counts.values()}
    if len(sizes) != 1 or len(next(iter(sizes))) != 1:
        raise ValueError(f"routing counts must be one [E] vector per layer, got shapes {sorted(sizes)}")
    if any(int(c.min()) < 0 for c in counts.values()):
        raise ValueError("routing counts must be >= 0")


@dataclasses.dataclass(frozen=True)
class PrefixPlacement:
    """Experts 0..N-1 of every layer resident."""

    num_slots: int

    def __post_init__(self):
        _check_slots(self.num_slots)

    def choose(self, layer: int, num_experts: int) -> list[int]:
        return list(range(self.num_slots))


@dataclasses.dataclass(frozen=True)
class FrequencyPlacement:
    """The N most routed experts of each layer resident, from per-layer routing counts {layer: [E]}."""

    num_slots: int
    counts: Mapping[int, torch.Tensor]

    def __post_init__(self):
        _check_slots(self.num_slots)
        _check_counts(self.counts)

    @classmethod
    def from_file(cls, num_slots: int, path) -> "FrequencyPlacement":
        return cls(num_slots, load_routing_counts(path))

    def choose(self, layer: int, num_experts: int) -> list[int]:
        if layer not in self.counts:
            raise ValueError(f"routing counts have no layer {layer} (they have {sorted(self.counts)})")
        if len(self.counts[layer]) != num_experts:
            raise ValueError(f"routing counts of layer {layer} have {len(self.counts[layer])} experts, "
                             f"the model {num_experts}")
        return top_experts(self.counts[layer], self.num_slots)


@dataclasses.dataclass(frozen=True)
class DynamicPlacement:
    """Starts as `start` places them; at the end of each request's prefill, the N experts its prompt routed most
    in each layer become that layer's resident set (ResidentExperts.after_prefill)."""

    num_slots: int
    start: PrefixPlacement | FrequencyPlacement | None = None

    def __post_init__(self):
        _check_slots(self.num_slots)
        if self.start is not None and self.start.num_slots != self.num_slots:
            raise ValueError(f"start placement has {self.start.num_slots} slots, this one {self.num_slots}")

    def choose(self, layer: int, num_experts: int) -> list[int]:
        return (self.start or PrefixPlacement(self.num_slots)).choose(layer, num_experts)


Placement = PrefixPlacement | FrequencyPlacement | DynamicPlacement


@dataclasses.dataclass
class RoutedSplit:
    """A router's [T, k] output split between device slots and host experts (see the module docstring)."""

    device_ids: torch.Tensor      # [T, k] slot in 0..N-1
    device_weights: torch.Tensor  # [T, k] 0 where the pair is on the host
    host_ids: torch.Tensor        # [T, k] expert id, -1 where the pair is resident
    host_weights: torch.Tensor    # [T, k] 0 where the pair is resident


class ResidentExperts:
    """The resident experts of every MoE layer: `experts[layer]` [N] (slot -> expert) and `slot_of[layer]` [E]
    (expert -> slot, -1 on the host), on `device`."""

    def __init__(self, placement: Placement, layers: Iterable[int], num_experts: int, device=None):
        if placement.num_slots > num_experts:
            raise ValueError(f"{placement.num_slots} resident slots for {num_experts} experts")
        self.placement, self.num_experts, self.num_slots = placement, num_experts, placement.num_slots
        self.experts: dict[int, torch.Tensor] = {}
        self.slot_of: dict[int, torch.Tensor] = {}
        for layer in layers:
            chosen = placement.choose(layer, num_experts)
            self._check_set(layer, chosen)
            self.experts[layer] = torch.tensor(chosen, dtype=torch.int64, device=device)
            slot_of = torch.full((num_experts,), -1, dtype=torch.int64, device=device)
            slot_of[self.experts[layer]] = torch.arange(self.num_slots, device=device)
            self.slot_of[layer] = slot_of

    def _check_set(self, layer: int, experts: list[int]) -> None:
        if len(experts) != self.num_slots or len(set(experts)) != len(experts):
            raise ValueError(f"layer {layer}: {self.num_slots} distinct resident experts needed, got {experts}")
        if any(not 0 <= e < self.num_experts for e in experts):
            raise ValueError(f"layer {layer}: resident experts {experts} out of range 0..{self.num_experts - 1}")

    def split(self, layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> RoutedSplit:
        """Router output topk_ids / topk_weights [T, k] -> the device and host halves (no host sync)."""
        slot = self.slot_of[layer][topk_ids.long()]                                    # [T, k]
        resident = slot >= 0
        zero = torch.zeros((), dtype=topk_weights.dtype, device=topk_weights.device)
        return RoutedSplit(device_ids=torch.where(resident, slot, 0).to(topk_ids.dtype),
                           device_weights=torch.where(resident, topk_weights, zero),
                           host_ids=torch.where(resident, -1, topk_ids.long()).to(topk_ids.dtype),
                           host_weights=torch.where(resident, zero, topk_weights))

    def set_resident(self, layer: int, experts: list[int]) -> list[tuple[int, int]]:
        """Make `experts` layer's resident set, in place: those already resident keep their slots, the others take
        the freed ones. Returns the (slot, expert) pairs whose weights the device must now copy in."""
        self._check_set(layer, experts)
        current = self.experts[layer].tolist()
        incoming = [e for e in experts if e not in current]
        freed = [s for s, e in enumerate(current) if e not in set(experts)]
        moves = list(zip(freed, incoming))
        if moves:
            slots = torch.tensor([s for s, _ in moves], dtype=torch.int64, device=self.experts[layer].device)
            new = torch.tensor([e for _, e in moves], dtype=torch.int64, device=slots.device)
            self.slot_of[layer][self.experts[layer][slots]] = -1
            self.experts[layer][slots] = new
            self.slot_of[layer][new] = slots
        return moves

    def after_prefill(self, counts: Mapping[int, torch.Tensor]) -> dict[int, list[tuple[int, int]]]:
        """A request's prefill ended with per-layer routing counts {layer: [E]}: under DynamicPlacement each
        layer's resident set becomes its top N (set_resident's moves by layer); other placements keep theirs."""
        if not isinstance(self.placement, DynamicPlacement):
            return {}
        _check_counts(counts)
        moves = {}
        for layer, c in counts.items():
            if layer not in self.experts:
                raise ValueError(f"routing counts for layer {layer}, which has no resident slots")
            if len(c) != self.num_experts:
                raise ValueError(f"layer {layer}: {len(c)} counts for {self.num_experts} experts")
            moves[layer] = self.set_resident(layer, top_experts(c, self.num_slots, self.experts[layer].tolist()))
        return moves


class RoutingCounter:
    """Per-layer counts of routed (token, expert) pairs: for a routing-count file, or one request's prefill."""

    def __init__(self, num_experts: int):
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        self.num_experts = num_experts
        self.counts: dict[int, torch.Tensor] = {}
        self.tokens: dict[int, int] = {}

    def add(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Count a router's topk_ids [T, k] (ids < 0 are not counted)."""
        ids = topk_ids.flatten().long().cpu()
        if ids.numel() and int(ids.max()) >= self.num_experts:
            raise ValueError(f"expert id {int(ids.max())} out of range: {self.num_experts} experts")
        c = torch.bincount(ids[ids >= 0], minlength=self.num_experts)
        self.counts[layer] = self.counts.get(layer, torch.zeros(self.num_experts, dtype=torch.int64)) + c
        self.tokens[layer] = self.tokens.get(layer, 0) + topk_ids.shape[0]

    def save(self, path) -> None:
        data = {"format": COUNTS_FORMAT, "num_experts": self.num_experts,
                "tokens": {str(l): n for l, n in sorted(self.tokens.items())},
                "counts": {str(l): c.tolist() for l, c in sorted(self.counts.items())}}
        Path(path).write_text(json.dumps(data))


def load_routing_counts(path) -> dict[int, torch.Tensor]:
    """A routing-count file -> {layer: counts [E] int64}; ValueError naming what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable routing-count file: {e}") from None
    if not isinstance(data, dict) or data.get("format") != COUNTS_FORMAT:
        raise ValueError(f"{path}: not a routing-count file (format must be {COUNTS_FORMAT!r})")
    E, counts = data.get("num_experts"), data.get("counts")
    if not isinstance(E, int) or E < 1 or not isinstance(counts, dict) or not counts:
        raise ValueError(f"{path}: needs num_experts >= 1 and a non-empty counts object")
    out = {}
    for key, c in counts.items():
        if not key.isdigit():
            raise ValueError(f"{path}: layer key {key!r} is not a layer index")
        if not isinstance(c, list) or len(c) != E or not all(isinstance(v, int) and v >= 0 for v in c):
            raise ValueError(f"{path}: layer {key} needs {E} counts (integers >= 0)")
        out[int(key)] = torch.tensor(c, dtype=torch.int64)
    return out
