"""vLLM's model interface over a recipe model (one process), through the model contract alone
(common/engine/model_contract.py): the constructor vLLM calls, vLLM cache layers for the cache tensors the model
declares (`cache_tensor_specs()`: a `CacheSlot` per tensor of a paged group; the tensors of a state group packed
into `StateSlot`s, vLLM's mamba-type layers), the model's caches bound to vLLM's tensors (`bind_caches`, each tensor
read through the table of its vLLM group), and each step's flattened batch and attention metadata as the recipe's
ForwardBatch (a state group's table: each request's (read, write) slot, from vLLM's state block indices).

A family subclass says how to build and load its model and, where the defaults do not fit, which vLLM spec each
of its paged cache tensors gets and which table the model reads it through.
"""
from __future__ import annotations

import functools
import json
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

import common
from common import cpu_gemm
from common.engine.forward_batch import ForwardBatch
from common.frame_stack import call_on_fresh_chunk
from common.kv_cache import CacheTensorSpec
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor
from vllm.v1.kv_cache_interface import KVCacheSpec

from .cache import CacheSlot, StateSlot, equal_page_specs

RECIPES = Path(common.__file__).resolve().parents[1] / "recipes"


def use_recipe(name: str) -> Path:
    """Put recipes/<name> on sys.path (recipe folders are not packages: their modules import each other by name;
    their module names do not clash across recipes) and return it."""
    folder = RECIPES / name
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return folder


RECIPE_DIR = use_recipe("deepseek")


class RecipeForCausalLM(nn.Module):
    """Subclasses set `family` (a name for messages) and implement build_model and load_into; cache_specs and
    table_of where the defaults (equal pages; each tensor through its recipe group's table) do not fit."""

    family = "recipe"

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        model_config = vllm_config.model_config
        self.path = Path(model_config.model)
        if vllm_config.parallel_config.world_size != 1:
            raise ValueError(f"the npu-cookbook {self.family} plugin runs one process (tensor / pipeline parallel 1)")
        if not (self.path / "config.json").is_file():
            raise ValueError(f"the npu-cookbook {self.family} plugin reads a local checkpoint folder; "
                             f"{self.path} has no config.json")
        self.model = self.build_model(json.loads((self.path / "config.json").read_text()))
        self.contract = self.model.engine_contract()
        self.block_size, self.dtype = vllm_config.cache_config.block_size, model_config.dtype
        self.mamba_cache_mode = "none"
        tensors = self.model.cache_tensor_specs()
        state_groups = {g.name for g in self.model.cache_specs(self.block_size) if g.is_state}
        name = lambda n: f"{prefix}.{n}" if prefix else n  # noqa: E731
        self.slots = [CacheSlot(name(t.name), t, self._paged_spec(t.name), self._bind)
                      for t in tensors if t.group not in state_groups]
        packs = self.state_packs([t for t in tensors if t.group in state_groups], len(self.slots))
        # a state layer is named after its first module ("layers.0.attention.states"): vLLM orders cache layers by
        # the layer index in their names, and some platforms refuse two cache layers with one index
        self.state_slots = [StateSlot(name(f"{pack[0].name.rsplit('.', 1)[0]}.states"), pack, self.dtype,
                                      self._paged_page, self._bind) for pack in packs]

    # -- what a family provides
    @classmethod
    def build_model(cls, config: dict) -> nn.Module:
        raise NotImplementedError

    def cache_specs(self, tensors: list[CacheTensorSpec], block_size: int,
                    dtype: torch.dtype) -> dict[str, KVCacheSpec]:
        """A vLLM spec per paged cache tensor, by name (default: cache.equal_page_specs)."""
        return equal_page_specs(tensors, block_size, dtype)

    def table_of(self, tensor: CacheTensorSpec) -> str:
        """The ForwardBatch block table (and slot mapping) key the model reads this tensor through (bind_caches'
        `tables`); default: its recipe group's, which vLLM must then give one cache group."""
        return tensor.group

    @classmethod
    def state_packs(cls, tensors: list[CacheTensorSpec], num_paged: int) -> list[list[CacheTensorSpec]]:
        """The state tensors, as vLLM layers (one MambaSpec page each). vLLM's hybrid allocator gives every group as
        many layers as the smallest kind has, and each group its own block table (kv_cache_utils'
        `_get_kv_cache_groups_uniform_page_size`), while the recipe's model reads all of a state group's tensors
        through one table: so the layers (their modules' tensors kept together) are packed into as many vLLM
        layers as there are paged ones, one vLLM group for each kind. ValueError where they do not divide evenly."""
        modules: dict[str, list[CacheTensorSpec]] = {}
        for t in tensors:
            modules.setdefault(t.name.rsplit(".", 1)[0], []).append(t)
        if not modules:
            return []
        n = min(len(modules), max(num_paged, 1))
        if len(modules) % n:
            raise ValueError(f"{len(modules)} state layers do not pack evenly into {n} vLLM layers")
        per = len(modules) // n
        layers = list(modules.values())
        return [[t for module in layers[i * per: (i + 1) * per] for t in module] for i in range(n)]

    def load_into(self) -> None:
        raise NotImplementedError

    # -- the cache layers' specs (asked once vLLM has fixed its block size)
    def _paged_specs(self, vllm_config: VllmConfig) -> dict[str, KVCacheSpec]:
        self.block_size = vllm_config.cache_config.block_size
        self.mamba_cache_mode = vllm_config.cache_config.mamba_cache_mode
        return self.cache_specs([s.tensor for s in self.slots], self.block_size, self.dtype)

    def _paged_spec(self, name: str):
        return lambda vllm_config: self._paged_specs(vllm_config)[name]

    def _paged_page(self, vllm_config: VllmConfig) -> int | None:
        """The page of the paged tensors (which the state slots' pages are padded to); None: no paged tensor."""
        pages = {spec.page_size_bytes for spec in self._paged_specs(vllm_config).values()}
        if len(pages) > 1:
            raise ValueError(f"the {self.family} plugin's paged caches have pages of {sorted(pages)} bytes: a hybrid "
                             "model's state pages need one")
        return pages.pop() if pages else None

    # -- vLLM's hybrid-model interface (IsHybrid, for the families that set is_hybrid): the largest state layer's
    #    states, for vLLM's block-size alignment, and how vLLM copies a state slot (prefix caching, "align" mode)
    @classmethod
    @functools.cache
    def _state_layout_of(cls, path: str, dtype: torch.dtype) -> tuple[tuple, tuple]:
        """(shapes, dtypes) of the largest state layer of the checkpoint at `path` (the model built on the meta
        device: nothing allocated)."""
        config = json.loads((Path(path) / "config.json").read_text())
        with torch.device("meta"):
            model = cls.build_model(config)
        tensors = model.cache_tensor_specs()
        state_groups = {g.name for g in model.cache_specs(1) if g.is_state}
        packs = cls.state_packs([t for t in tensors if t.group in state_groups],
                                sum(t.group not in state_groups for t in tensors))
        pack = max(packs, key=lambda p: sum(t.rows * t.width * (t.dtype or dtype).itemsize for t in p))
        return tuple((t.rows, 1, t.width) for t in pack), tuple(t.dtype or dtype for t in pack)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple:
        return cls._state_layout_of(vllm_config.model_config.model, vllm_config.model_config.dtype)[0]

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple:
        return cls._state_layout_of(vllm_config.model_config.model, vllm_config.model_config.dtype)[1]

    def get_mamba_state_copy_funcs(self, mamba_types) -> dict:
        """Each state copied whole from the source slot (no speculative decoding: one state per slot)."""
        funcs = (get_temporal_copy_spec,) * len(self.state_slots[0].tensors)
        return {mamba_type: funcs for mamba_type in mamba_types}

    # -- vLLM's model interface
    def _bind(self) -> None:
        """Once vLLM has bound every slot: the model's caches are vLLM's tensors."""
        if all(s.cache is not None for s in self.slots) and all(s.caches is not None for s in self.state_slots):
            tensors = {s.tensor.name: s.cache for s in self.slots}
            for s in self.state_slots:
                tensors.update(s.caches)
            specs = [s.tensor for s in self.slots] + [t for s in self.state_slots for t in s.tensors]
            self.model.bind_caches(tensors, tables={t.name: self.table_of(t) for t in specs})

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)  # [T, D]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """input_ids, positions [T] (vLLM's flattened step) -> hidden states [T, D]."""
        if inputs_embeds is not None:
            raise ValueError(f"the npu-cookbook {self.family} plugin takes token ids, not inputs_embeds")
        metadata = get_forward_context().attn_metadata
        T = input_ids.shape[0]
        if not metadata or any(s.prefix not in metadata for s in [*self.slots, *self.state_slots]):
            # a dummy step (no request, no cache; vLLM's profile run builds no state metadata): nothing to attend to
            return torch.zeros(T, self.contract.hidden_size, dtype=self.contract.dtype, device=input_ids.device)
        # [n, D]; on a chunk of CPython's frame stack of its own, as the engine's step (common/frame_stack.py)
        hidden = call_on_fresh_chunk(self.model, self.forward_batch(input_ids, positions, metadata))
        if hidden.shape[0] < T:  # vLLM padded the step: padding rows are never sampled
            hidden = torch.cat([hidden, hidden.new_zeros(T - hidden.shape[0], hidden.shape[1])])
        return hidden

    def forward_batch(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      metadata: dict[str, CommonAttentionMetadata]) -> ForwardBatch:
        """vLLM's step (its tokens and each cache group's attention metadata) as the recipe's packed ForwardBatch:
        each paged tensor's block table and slot mapping are its vLLM group's; a state group's table [B, 2] is each
        request's (read, write) slot: vLLM's state block of the request this step (in "align" mode the block its
        last token falls in, into which vLLM has copied the previous step's state), read as the null slot 0 (a zero
        state) by a request with nothing computed yet (one write slot: no speculative decoding)."""
        first = metadata[(self.slots or self.state_slots)[0].prefix]
        n, B = first.num_actual_tokens, first.num_reqs
        cu = first.query_start_loc[: B + 1].to(torch.int32)  # [B+1]
        seq_lens = first.seq_lens[:B].to(torch.int32)  # [B]
        seq_ids = torch.repeat_interleave(torch.arange(B, device=cu.device), cu.diff())  # [n]
        tables, slots, source = {}, {}, {}
        for slot in self.slots:
            m, key = metadata[slot.prefix], self.table_of(slot.tensor)
            if source.setdefault(key, m) is not m:
                raise RuntimeError(f"{slot.prefix}: the model reads it through block table {key!r}, which vLLM gave "
                                   "another cache group (the specs put them in different groups)")
            tables[key] = m.block_table_tensor[:B].to(torch.int32)  # [B, max_blocks]
            slots[key] = m.slot_mapping[:n].long()  # [n]
        fresh = seq_lens == cu.diff()  # [B] nothing computed before this step
        for slot in self.state_slots:
            m, key = metadata[slot.prefix], slot.group
            if source.setdefault(key, m) is not m:
                raise RuntimeError(f"{slot.prefix}: vLLM gave the {key!r} state layers more than one cache group "
                                   "(their block tables differ); the model reads them through one")
            index = mamba_get_block_table_tensor(m.block_table_tensor[:B], m.seq_lens[:B], slot.spec,
                                                 self.mamba_cache_mode)[:, 0].to(torch.int32)  # [B]
            tables[key] = torch.stack([torch.where(fresh, 0, index), index], dim=1)  # [B, 2] (read, write)
        return ForwardBatch(
            input_ids=input_ids[:n].long(), positions=positions[:n].long(), seq_ids=seq_ids, cu_seqlens_q=cu,
            seq_lens=seq_lens, block_size=self.block_size, block_tables=tables, slot_mapping=slots,
            max_seqlen_q=int(first.max_query_len), max_seqlen_k=int(first.max_seq_len))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_states)  # [N, V] fp32

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Read the checkpoint folder through the recipe's loader (publisher or transformers names, FP8 / MXFP4
        dequantized); vLLM's own iterator is left unread. Returns the names of every parameter filled. Then, on CPU,
        the bf16 / fp32 weights are packed into oneDNN's layout as the recipe's engine packs them
        (common/cpu_gemm.py; vLLM packs only its own linear layers)."""
        self.load_into()
        filled = {f"model.{n}" for n, _ in self.model.named_parameters()}
        if self.contract.device.type == "cpu":
            cpu_gemm.pack_model(self.model)
        return filled
