"""Graph-mode decode (exe_mode "graph"): a decode step run as one compiled graph, the graph of its batch bucket.

Upstream runs decode as a captured graph (`exe_mode: npugraph_ex`) with prefill eager; vLLM-Ascend likewise (ACL
graph, FULL_DECODE_ONLY). Here a step whose every scheduled sequence computes `query_len` tokens (decodes: one;
with MTP, the token and its k drafts verified: 1 + k; a prompt chunk of that length is the same computation)
and none scores prompt positions is padded to the smallest capture size that holds it: ForwardBatch.build with
`pad_to` the bucket, block tables `max_model_len / block_size` wide and `max_seqlen_k = max_model_len`, so every
shape of the step is the bucket's alone (the model reads no tensor on the host: see ForwardBatch); on one CPU rank,
where the buckets share one graph over the batch size, the step keeps its own batch size (below). Every other
step (prefill, mixed prefill + decode, an MTP step whose drafts were cut short) runs eager.

CPU: each bucket is `torch.compile(fullgraph=True, dynamic=False)` (inductor, `compile_decode_graph`: on one
rank its C++ wrapper where the graph calls no compile_region subgraph), compiled at start-up, one bucket after the
other under a progress bar, by a step over padding alone (padding writes only to the null block). On one rank
with one token a sequence (`shape_generic`), the buckets share one graph, as vLLM compiles one graph over a
symbolic token count: the largest bucket is traced with its batch dimension marked dynamic (`mark_batch_dynamic`)
and size-oblivious (`size_oblivious`: nothing assumed of a batch of 0 or 1), the others reuse it, and a step runs it
at its own batch size, unpadded (`build`; 12 sequences padded to 16 decoded at 0.81-0.93x the unpadded rate on a
2-core Xeon without AMX, bf16, the V3 and V4 bench checkpoints, 2026-12-07: its GEMMs are compute-bound from 8
rows). Bucket 1 reuses it too where the traced graph guards nothing on the batch size being above 1 (DeepSeek-V4:
V4's 7 bench buckets compiled in 72 s cold instead of 115 s with a static graph for bucket 1, its batch-1 step
as fast or faster, Zen 4, 2026-12-06); where it does (V3: inductor's CPU lowering of a bmm whose operand has a
batch-sized dimension and a layout still its to choose guards on that size being 1), dynamo compiles bucket 1 a
static graph of its own.
With MTP (inductor failed to generate a region over T = (1 + k) B) and over several ranks (the collectives size
their buffers on the host) every bucket has its own graph. Within
a graph, the parts a model marks `compile_region` (V4's attention, MoE: common/engine/compile_region.py)
are generated once per kind of layer, not once per layer. The
GEMMs stay the oneDNN-packed ones of common/cpu_gemm.py, as opaque custom ops, and so does the MoE's expert loop
(its host split is no device sync on CPU), MoE offload's host experts (common/offload: a submit op and a sync op,
which run the host backend at every replay; a CUDA capture refuses them), and paged decode attention
(ops.paged_attention's decode rows: inside the op the step's longest kv length is read on the host, so a graph step
gathers and scores the keys its sequences hold, as eager does, not max_model_len padded ones); so do V3.2's
indexer and, past PADDED_ENTRIES_MAX entries a sequence, DeepSeek-V4's compressed entries, through opaque ops of
their models that read the width on the host (below it V4's pad to max_seqlen_k / ratio).
Inductor keeps what it compiled on disk (its FX graph cache under TORCHINDUCTOR_CACHE_DIR, default
/tmp/torchinductor_<user>), so a second start traces again but compiles nothing. That cache keys a graph by its
code, not by the vector width inductor wrote it for, and the same folder may serve another CPU kind (an AVX-512
graph rebuilt for AVX2 indexes out of bounds): the compile pins `cpp.simdlen` to the width inductor picks here
(`inductor_options`), which puts it in the key. At run time a step fails loudly instead of stalling for a compile
(`fail_on_recompile`). (A step after the model's caches were reallocated by another engine on the same model fails
before it runs: ModelRunner checks, in every mode.)

CUDA: the same compile per bucket (inductor's Triton kernels; the MoE's expert matmuls traced as
common.ops.reference.moe.static_grouped_matmul, which reads no group size on the host), then one
torch.cuda.CUDAGraph captured per bucket over fixed input buffers (`ForwardBatch.copy_` fills them each step;
the largest bucket first, the others in its memory pool). Not run in this repository's CI (no GPU there).
NPU: refused (the fused attention takes its sequence lengths as host lists, which a captured graph would freeze).

exe_mode auto: where graph mode runs (CPU, CUDA), the buckets are compiled as above, then each is timed against
eager, and only the buckets whose graph is faster run as graphs; elsewhere (NPU) auto is eager. On one rank the
timing is of real decode steps (`trial_mode` / `record`): a bucket's first steps alternate between its graph and the
eager forward until each has run TRIAL_STEPS of them, then the faster mode keeps the bucket. Over several ranks it is
a start-up timing of padding steps (`calibrate`), which every rank agrees on; a padding step has no context, so
it sees the dispatch a graph saves, not what grows with the context. Both time their runs on a chunk of CPython's
frame stack of their own, as the engine's step runs (common/frame_stack.py: without it, where the caller's depth put
a chunk boundary decided the speed, and padding steps timed outside the step read V3's graph slower than eager).

Over several ranks (TP / DP / EP, gloo on CPU) the collectives are traced into the graph (torch's functional
collectives), and every step the data-parallel ranks agree on one bucket or on eager (`step_bucket`); a graph
step is `uniform_across_ranks`, so the vocabulary-parallel gathers exchange no sizes and the expert dispatch sends
fixed-capacity buffers (common.parallel.dispatch_to_experts) instead of splits read on the host.
"""
from __future__ import annotations

import contextlib
import functools
import time

import torch
from tqdm.auto import tqdm

from common import backend, parallel as par
from common.frame_stack import call_on_fresh_chunk

from .config import EngineConfig
from .forward_batch import ForwardBatch
from .model_contract import ModelContract


RECOMPILE_LIMIT = 256  # compiled decode graphs a process may hold, all graph engines together
TRIAL_STEPS = 3  # exe_mode auto on one rank: real steps of a bucket timed in each mode before one is kept


def inductor_options(cpp_wrapper: bool = False) -> dict:
    """torch.compile options of the decode graphs: the vector width inductor picks on this CPU (it follows
    ATEN_CPU_CAPABILITY), stated so that it is part of the on-disk cache key; with cpp_wrapper, the graph's kernels
    called from generated C++ instead of a generated Python function, its wrapper compiled apart from the kernels
    (`cpp_wrapper_build_separate`: the kernels compile in parallel, the wrapper at -O1)."""
    from torch._inductor import cpu_vec_isa

    isa = cpu_vec_isa.pick_vec_isa()
    options = {"cpp.simdlen": isa.bit_width()} if isa else {}
    if cpp_wrapper:
        options |= {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}
    return options


def calls_subgraphs(gm: torch.fx.GraphModule) -> bool:
    """Whether a traced graph calls subgraphs (compile_region's regions), which inductor's C++ wrapper cannot."""
    return any(node.target is torch.ops.higher_order.invoke_subgraph for node in gm.graph.nodes)


def compile_decode_graph(gm: torch.fx.GraphModule, example_inputs, cpp_wrapper: bool):
    """The torch.compile backend of the decode graphs: inductor, with its C++ wrapper where the caller allows it (a
    CPU graph of one rank: torch's functional collectives, which multi-rank graphs call, type their group `Any`, an
    argument the C++ wrapper cannot pass) and the graph calls no subgraph (DeepSeek-V4's regions keep the Python
    wrapper). A step's hundreds of kernel and op calls then cost C++ calls, not Python lines: V3's bench checkpoint,
    bf16, Xeon, 2026-12-07, a batch-1 padding step 8.1-8.9 ms against 11.5-12.2 ms, its 2 graphs compiled cold in
    71 s against 61 s."""
    from torch._inductor.compile_fx import compile_fx

    options = inductor_options(cpp_wrapper=cpp_wrapper and not calls_subgraphs(gm))
    return compile_fx(gm, example_inputs, config_patches=options)


def graph_capable(device: torch.device) -> bool:
    """Whether exe_mode graph runs on this device (CPU and CUDA; see the module docstring)."""
    return device.type in ("cpu", "cuda")


def mark_batch_dynamic(batch: ForwardBatch) -> None:
    """Mark the batch dimension of every per-sequence and per-token input dynamic, so that dynamo traces the graph
    over a symbolic batch size instead of this batch's (traced under `size_oblivious`, bucket 1 included)."""
    for t in (batch.input_ids, batch.positions, batch.seq_ids, batch.cu_seqlens_q, batch.seq_lens,
              *batch.block_tables.values(), *batch.slot_mapping.values()):
        torch._dynamo.mark_dynamic(t, 0)


def size_oblivious():
    """The context a shape-generic graph is traced in: its batch size's symbol assumes nothing of 0 or 1 (dynamo
    otherwise specialises them, and bucket 1 would compile a graph of its own)."""
    import torch.fx.experimental._config as fx_config

    return fx_config.patch(backed_size_oblivious=True)


def decode_step(model, mtp, batch: ForwardBatch):
    """What a bucket runs: the logits of every row [T, V] (T = bucket * query_len) and, where the MTP drafts need
    them (mtp: the model's MTPDraftModel, else None), the residual streams [T, n, D]."""
    uniform = batch.uniform_across_ranks
    if mtp is not None:
        streams = mtp.residual_streams(batch)  # [T, n, D]
        return model.compute_logits(mtp.final_hidden(streams), uniform=uniform), streams
    return model.compute_logits(model(batch), uniform=uniform), None


class GraphRunner:
    def __init__(self, model, contract: ModelContract, config: EngineConfig, groups: list[str], device: torch.device,
                 keep_streams: bool, state_groups: tuple[str, ...] = ()):
        """groups: the model's cache groups (the padding sequences get an empty table in each, the null slots in a
        state group's); keep_streams: the steps return the residual streams too (contract.mtp's, for the MTP
        drafts); state_groups: those of kind "state" (tables of a read and 1 + num_speculative_tokens write slots)."""
        if not graph_capable(device):
            raise ValueError(
                f"exe_mode graph runs on CPU (torch.compile) and CUDA (torch.compile, then a CUDA graph per bucket) in "
                f"this version, not on {device.type}: an NPU graph needs the attention's host sequence lengths "
                "updated at every replay (torchair's npugraph_ex), which is not built; run exe_mode eager")
        parallel = contract.parallel
        self.dp_group = parallel.group("attn_dp") if parallel is not None else None
        self.sizes = config.graph_capture_sizes
        self.block_size, self.max_seqlen_k = config.block_size, config.max_model_len
        ahead = 2 * config.num_speculative_tokens  # MTP: blocks allocated for the drafts' lookahead
        self.table_width = -(-(config.max_model_len + ahead) // config.block_size)  # blocks of the longest sequence
        self.query_len = 1 + config.num_speculative_tokens  # tokens a sequence computes in a graph step: MTP verifies
        self.groups, self.state_groups = groups, state_groups
        self.device = device
        self.replays = dict.fromkeys(self.sizes, 0)  # bucket -> steps it ran
        self.capture_seconds: float | None = None
        self.num_graphs: int | None = None  # after `capture`: the graphs compiled for the buckets
        self.calibration: dict[int, tuple[float, float]] = {}  # exe_mode auto: bucket -> (graph, eager) seconds
        self.trials: dict[int, dict[str, list[float]]] = {}  # auto, one rank: bucket -> mode -> its steps' seconds
        # every rank of the model (its layout is the process group's world): they agree on the buckets kept
        self.world = torch.distributed.group.WORLD if parallel is not None and parallel.world_size > 1 else None
        mtp = contract.mtp if keep_streams else None
        self._mtp = mtp
        self._step = lambda batch: decode_step(model, mtp, batch)
        backend = functools.partial(compile_decode_graph, cpp_wrapper=device.type == "cpu" and self.one_rank)
        self._compiled = torch.compile(self._step, fullgraph=True, dynamic=False, backend=backend)
        self._model = model
        self._inputs: dict[int, ForwardBatch] = {}  # bucket -> the buffers its graph reads (each step copied in)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}  # CUDA: bucket -> its captured graph
        self._outputs: dict[int, tuple] = {}  # CUDA: bucket -> what its graph writes (logits, streams or None)
        self._pool = None  # CUDA: the memory pool the graphs share

    @property
    def buckets(self) -> tuple[int, ...]:
        """The buckets that run as graphs: every capture size, less those `calibrate` dropped."""
        return tuple(n for n in self.sizes if n in self._inputs)

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest capture size that holds num_seqs sequences, or None."""
        return next((n for n in self.sizes if n >= num_seqs), None)

    def step_bucket(self, num_seqs: int, fits: bool) -> int | None:
        """The bucket this step runs in, or None: eager. fits: this rank's step is one a graph runs (or it has
        nothing to run). Data-parallel ranks decide together (one all-reduce): their steps' collectives (expert
        dispatch, vocabulary-parallel gathers) meet only if all run graphs of one bucket, or all run eager; a rank
        with nothing to run then forwards padding alone. Attention-TP peers run the same requests alike."""
        refuse, most = par.all_reduce_max([int(not fits), num_seqs], self.dp_group)
        bucket = None if refuse or not most else self.bucket(most)
        return bucket if bucket in self._inputs else None  # a bucket `calibrate` dropped runs eager

    def fits(self, num_new_tokens: list[int]) -> bool:
        """Whether a step of sequences computing these many tokens each runs as a graph: every one query_len."""
        return self.bucket(len(num_new_tokens)) is not None and all(n == self.query_len for n in num_new_tokens)

    def padding(self, n: int, padded: bool = True) -> ForwardBatch:
        """A step of padding alone, n sequences (start-up compiles, and a data-parallel rank with nothing to run);
        padded=False: the same sequences as an eager step builds them (no bucket shapes)."""
        tables = {g: [0] * (1 + self.query_len) if g in self.state_groups else [] for g in self.groups}
        if not padded:
            return ForwardBatch.build([[0] * self.query_len] * n, [0] * n, [tables] * n, self.block_size,
                                      self.device, state_groups=self.state_groups)
        return self.build([[0] * self.query_len] * n, [0] * n, [tables] * n)

    def build(self, new_tokens: list[list[int]], num_computed: list[int],
              block_tables: list[dict[str, list[int]]], bucket: int | None = None) -> ForwardBatch:
        """The step's sequences (query_len tokens each) padded to `bucket` (default: the smallest that holds them);
        where the buckets share one shape-generic graph, not padded: that graph runs any batch size from 2, and
        padding rows would only add GEMM rows and expert routes (as vLLM's CPU backend runs its dynamic-shape
        graph). One sequence is still padded to its bucket: only bucket 1's graph takes a batch of 1 (the generic
        graph may guard on a batch above 1, V3's does)."""
        bucket = bucket or self.bucket(len(new_tokens))
        pad_to = len(new_tokens) if self.shape_generic and len(new_tokens) > 1 else bucket
        return ForwardBatch.build(new_tokens, num_computed, block_tables, self.block_size, self.device,
                                  pad_to=pad_to, table_width=self.table_width, max_seqlen_k=self.max_seqlen_k,
                                  state_groups=self.state_groups)

    @property
    def one_rank(self) -> bool:
        """Whether the model runs on this process alone (no collective in its steps)."""
        return self.world is None and self.dp_group is None

    @property
    def shape_generic(self) -> bool:
        """Whether the buckets share one graph over a symbolic batch size (CPU, one rank, one token a sequence, two
        or more buckets); else every bucket compiles a graph of its own."""
        return self.device.type == "cpu" and self.one_rank and self.query_len == 1 and len(self.sizes) > 1

    def compile_order(self) -> list[int]:
        """The buckets in the order `capture` compiles them: CUDA the largest first (its memory pool); shape-generic
        the largest (traced generic), then the rest (reusing it); else the smallest first."""
        if self.device.type == "cuda":
            return sorted(self.sizes, reverse=True)
        if not self.shape_generic:
            return sorted(self.sizes)
        return [max(self.sizes)] + sorted(n for n in self.sizes if n < max(self.sizes))

    @torch.inference_mode()
    def capture(self, show_progress: bool = True) -> None:
        """Compile every bucket now, by a step over padding alone; on CUDA then capture it (largest bucket first,
        the smaller ones in its memory pool, as vLLM does), after that step warmed it up."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        start = time.perf_counter()
        cuda = self.device.type == "cuda"
        compiled_before = len(_debug_get_cache_entry_list(self._step.__code__))  # every graph engine's, so far
        # one compiled graph per bucket, for every engine of the process: dynamo counts them all against the code
        # of decode_step's lambda (the default limit, 8, would turn a second graph engine's buckets eager)
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=RECOMPILE_LIMIT):
            order = self.compile_order()
            for n in tqdm(order, desc="compile decode graphs", unit="bucket", disable=not show_progress):
                self._inputs[n] = self.padding(n)
                generic = self.shape_generic and n == order[0]  # the other buckets then reuse its graph
                if generic:
                    mark_batch_dynamic(self._inputs[n])
                with size_oblivious() if generic else contextlib.nullcontext():
                    self._compiled(self._inputs[n])
                if cuda:
                    self._capture_cuda(n)
        self.num_graphs = len(_debug_get_cache_entry_list(self._step.__code__)) - compiled_before
        self.capture_seconds = time.perf_counter() - start

    @torch.inference_mode()
    def calibrate(self, repeats: int = 3) -> tuple[int, ...]:
        """exe_mode auto over several ranks, after `capture` (one rank: `start_trials`; bench_graph.py prints it too):
        time each bucket's graph against the eager forward of the same sequences
        (padding: the weights, dispatch and fused ops of a decode step; attention reads no padded keys on CPU
        either way), the best of `repeats` alternating runs each, and keep the buckets where the graph is faster;
        a dropped bucket's steps run eager. Every rank keeps a bucket only if it is faster on all of them (their
        steps' collectives meet only in the same mode). Returns the buckets kept (none: eager is faster at every
        size)."""
        def seconds(fn) -> float:
            backend.synchronize()
            start = time.perf_counter()
            call_on_fresh_chunk(fn)  # as a step runs (common/frame_stack.py)
            backend.synchronize()
            return time.perf_counter() - start

        slower = []
        for n in self.sizes:
            padded, plain = self.padding(n), self.padding(n, padded=False)  # (the buffers hold the last step's)
            runs = [(seconds(lambda: self.run(padded)), seconds(lambda: decode_step(self._model, self._mtp, plain)))
                    for _ in range(repeats)]
            self.calibration[n] = (min(g for g, _ in runs), min(e for _, e in runs))
            slower.append(int(self.calibration[n][0] >= self.calibration[n][1]))
        for n, drop in zip(self.sizes, par.all_reduce_max(slower, self.world)):
            if drop:
                self._inputs.pop(n)
                self._graphs.pop(n, None)
        self.replays = dict.fromkeys(self.sizes, 0)  # the calibration's runs are not steps
        return self.buckets

    def start_trials(self) -> None:
        """exe_mode auto on one rank, after `capture`: every bucket's first real decode steps are timed in both
        modes (`trial_mode`, `record`) before it keeps the faster one."""
        if not self.one_rank:
            raise ValueError("trials time one rank's own steps; over several ranks, calibrate")
        self.trials = {n: {"graph": [], "eager": []} for n in self.buckets}

    def trial_mode(self, bucket: int) -> str | None:
        """The mode a step of `bucket` runs while its trial lasts ("graph" or "eager", alternating), else None."""
        if (trial := self.trials.get(bucket)) is None:
            return None
        return "graph" if len(trial["graph"]) <= len(trial["eager"]) else "eager"

    def record(self, bucket: int, mode: str, seconds: float) -> None:
        """A trial step's time; after TRIAL_STEPS in each mode, the bucket runs as a graph only if its best graph
        step beat its best eager step (`calibration` keeps the two)."""
        trial = self.trials[bucket]
        trial[mode].append(seconds)
        if min(map(len, trial.values())) < TRIAL_STEPS:
            return
        self.calibration[bucket] = graph, eager = min(trial["graph"]), min(trial["eager"])
        del self.trials[bucket]
        if graph >= eager:
            self._inputs.pop(bucket)
            self._graphs.pop(bucket, None)

    def _capture_cuda(self, n: int) -> None:
        self._compiled(self._inputs[n])  # a second warm-up: what the first call allocated lazily is there now
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._outputs[n] = self._compiled(self._inputs[n])
        self._pool = graph.pool()
        self._graphs[n] = graph

    def run(self, batch: ForwardBatch, bucket: int | None = None):
        """(logits [B * query_len, V], streams [B * query_len, n, D] or None) of a batch from `build` of the
        bucket's B sequences (shape-generic: the step's own B). On CUDA the graph's own output buffers, which the
        next replay overwrites: read them before the next step."""
        n = bucket or batch.num_seqs
        self.replays[n] += 1
        inputs = batch if self.shape_generic else self._inputs[n].copy_(batch)  # shape-generic: the step's own
        if n in self._graphs:
            self._graphs[n].replay()
            return self._outputs[n]
        with torch.compiler.set_stance("fail_on_recompile"):
            return self._compiled(inputs)
