"""Optional cuDNN backend for paged attention: prefill chunks through cuDNN's fused paged
SDPA (the `nvidia-cudnn-frontend` package), decodes through the Triton kernel.

cuDNN reads K/V straight from the paged cache through the block tables (its "paged
attention" containers: one layer's strided view, no gather) with a bottom-right aligned
causal mask, so a chunk after a prefix attends exactly as `kernels.paged_attention` does.
It runs long prefill chunks and short ragged batches faster than the Triton kernel
(docs/KERNELS.md, "Prefill"). A step goes to cuDNN when it is prefill-shaped
(`routes_to_cudnn`); decode steps, float32 and anything cuDNN refuses stay on Triton, which
also keeps CUDA graph capture of decode steps on the Triton path.

A cuDNN graph is built once per `GraphShape` (the first, which loads cuDNN's kernels, takes
seconds; docs/KERNELS.md) and replayed with the step's lengths and tables: shapes are
bucketed so that few graphs serve every step, and `build_graphs` lets warm-up build them
before the first request.

cuDNN reads a request's last block whole, masking the slots past its length: those slots
must hold finite values (0 x NaN is NaN; measured: NaN there turns cuDNN's rows NaN where
the Triton kernel, which never loads them, is unaffected). The engine guarantees it: with
this backend the model runner zeroes every block before a step first writes it
(`ModelRunner._zero_started_blocks`), whatever an earlier owner left there.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass

import torch
from kvtier.kernels._attention_checks import check_args, looks_valid
from kvtier.kernels.paged_attention import paged_attention as triton_paged_attention

logger = logging.getLogger(__name__)

#: cuDNN 9.6 is the first with a bottom-right causal mask at any length (earlier: multiples
#: of 64) beside page tables.
MIN_CUDNN_VERSION = 90600
#: A step goes to cuDNN when it has at least this many query tokens. Below, attention is a
#: small part of the step and cuDNN's gain with it: a whole 1K-token prompt was no faster,
#: and a short chunk after a long context is slower on cuDNN (the Triton kernel splits long
#: contexts over more programs; docs/KERNELS.md, "Prefill").
MIN_STEP_TOKENS = 2048
#: ... its longest query has at least this many ...
MIN_QUERY_LEN = 64
#: ... and it has at most this many requests (cuDNN's grid is requests x heads x query tiles
#: of the longest query, so many short requests beside one chunk waste it).
MAX_REQS = 16
#: Graph buckets: the longest query and the block-table width round up to a power of two, at
#: least these. Loose buckets cost nothing measurable (an 8K-query, 128K-token graph ran
#: every case from a 512-token chunk to 8K after 24K as fast as a tight one), and they keep
#: the graphs an engine needs to one per request bucket.
MIN_QUERY_BUCKET = 8192
MIN_PAGES_BUCKET = 8192


@functools.lru_cache(maxsize=1)
def cudnn_available() -> bool:
    """True when an Ampere or newer GPU is present, nvidia-cudnn-frontend imports and cuDNN
    is >= 9.6 (asked once per process, of the current device)."""
    if not torch.cuda.is_available() or importlib.util.find_spec("cudnn") is None:
        return False
    if torch.cuda.get_device_capability()[0] < 8:  # cuDNN's fused attention: Ampere on
        return False
    try:
        import cudnn
        return cudnn.backend_version() >= MIN_CUDNN_VERSION
    except Exception:  # noqa: BLE001 - a frontend that cannot load its library: not available
        return False


def _bucket(value: int, floor: int) -> int:
    return max(floor, 1 << max(0, value - 1).bit_length())


@dataclass(frozen=True, slots=True)
class GraphShape:
    """What one cuDNN graph is built for: requests (padded), longest query, table width."""

    num_reqs: int
    max_query_len: int
    num_pages: int

    @classmethod
    def for_step(cls, num_reqs: int, max_query_len: int, table_width: int) -> GraphShape:
        return cls(_bucket(num_reqs, 1), _bucket(max_query_len, MIN_QUERY_BUCKET),
                   _bucket(table_width, MIN_PAGES_BUCKET))


def routes_to_cudnn(query: torch.Tensor, num_reqs: int, max_query_len: int) -> bool:
    """Whether a step of these shapes goes to cuDNN (else to the Triton kernel)."""
    return (query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16)
            and query.shape[0] >= MIN_STEP_TOKENS and max_query_len >= MIN_QUERY_LEN
            and num_reqs <= MAX_REQS
            and query.shape[0] * query.shape[1] * query.shape[2] < 2 ** 31)


class _PagedGraph:
    """One built graph: packed queries [tokens, heads, dim] of `shape.num_reqs` requests,
    K/V read from one layer's cache views through [num_reqs, num_pages] block tables."""

    def __init__(self, handle, shape: GraphShape, num_heads: int, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, softmax_scale: float) -> None:
        import cudnn

        io = {torch.float16: cudnn.data_type.HALF,
              torch.bfloat16: cudnn.data_type.BFLOAT16}[k_cache.dtype]
        i32 = cudnn.data_type.INT32
        b, sq, dim = shape.num_reqs, shape.max_query_len, k_cache.shape[3]
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        q_dims = [b, num_heads, sq, dim]
        q_strides = [sq * num_heads * dim, dim, num_heads * dim, 1]
        self.q = g.tensor(name="q", dim=q_dims, stride=q_strides, data_type=io)
        self.offsets = g.tensor(name="offsets", dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1],
                                data_type=i32)
        self.q.set_ragged_offset(self.offsets)
        # [num_blocks, block_size, kv_heads, dim] views as cuDNN's [blocks, heads, bs, dim].
        k, v = k_cache.permute(0, 2, 1, 3), v_cache.permute(0, 2, 1, 3)
        self.k = g.tensor(name="k", dim=list(k.shape), stride=list(k.stride()), data_type=io)
        self.v = g.tensor(name="v", dim=list(v.shape), stride=list(v.stride()), data_type=io)
        table = dict(dim=[b, 1, shape.num_pages, 1], data_type=i32,
                     stride=[shape.num_pages, shape.num_pages, 1, 1])
        self.table_k = g.tensor(name="table_k", **table)
        self.table_v = g.tensor(name="table_v", **table)
        lens = dict(dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
        self.q_lens = g.tensor(name="q_lens", **lens)
        self.kv_lens = g.tensor(name="kv_lens", **lens)
        o, _ = g.sdpa(name="paged_prefill", q=self.q, k=self.k, v=self.v, is_inference=True,
                      attn_scale=softmax_scale, use_causal_mask_bottom_right=True,
                      use_padding_mask=True, seq_len_q=self.q_lens, seq_len_kv=self.kv_lens,
                      paged_attention_k_table=self.table_k,
                      paged_attention_v_table=self.table_v,
                      paged_attention_max_seq_len_kv=shape.num_pages * k_cache.shape[1])
        o.set_output(True).set_dim(q_dims).set_stride(q_strides).set_ragged_offset(self.offsets)
        self.o = o
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph = g
        self.workspace = torch.empty(g.get_workspace_size(), dtype=torch.uint8,
                                     device=k_cache.device)


def _step_inputs(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 block_tables: torch.Tensor, shape: GraphShape,
                 row_elems: int) -> tuple[torch.Tensor, ...]:
    """cuDNN's per-step tensors: (query lengths [b, 1, 1, 1], ragged row offsets in elements
    [b + 1, 1, 1, 1], key lengths [b, 1, 1, 1], block tables [b, 1, num_pages, 1]), all
    int32, padded to the graph's b requests (padding requests have no queries and keys)."""
    n, b = seq_lens.shape[0], shape.num_reqs
    starts = query_start_loc[:n + 1]  # [n + 1] cu_seqlens
    kv_lens = seq_lens
    if b > n:
        starts = torch.cat([starts, starts[n:].expand(b - n)])
        kv_lens = torch.cat([seq_lens, seq_lens.new_zeros(b - n)])
    tables = block_tables.new_zeros((b, shape.num_pages))
    tables[:n, :block_tables.shape[1]] = block_tables
    return ((starts[1:] - starts[:-1]).view(b, 1, 1, 1), (starts * row_elems).view(b + 1, 1, 1, 1),
            kv_lens.view(b, 1, 1, 1), tables.view(b, 1, shape.num_pages, 1))


class CudnnPrefill:
    """The built graphs (by cache geometry, heads, scale and `GraphShape`) and one cuDNN
    handle per device."""

    def __init__(self) -> None:
        self._handles: dict[int, object] = {}
        self._graphs: dict[tuple, _PagedGraph | None] = {}

    @property
    def num_graphs(self) -> int:
        return sum(g is not None for g in self._graphs.values())

    def graph(self, shape: GraphShape, num_heads: int, k_cache: torch.Tensor,
              v_cache: torch.Tensor, softmax_scale: float) -> _PagedGraph | None:
        """The graph for these shapes, built on first use; None when cuDNN refuses them
        (logged once; those steps run on the Triton kernel)."""
        key = (k_cache.device.index, k_cache.dtype, tuple(k_cache.shape), k_cache.stride(),
               v_cache.stride(), num_heads, softmax_scale, shape)
        if key not in self._graphs:
            import cudnn

            index = k_cache.device.index
            if index not in self._handles:
                with torch.cuda.device(k_cache.device):
                    self._handles[index] = cudnn.create_handle()
            try:
                self._graphs[key] = _PagedGraph(self._handles[index], shape, num_heads,
                                                k_cache, v_cache, softmax_scale)
            except Exception as exc:  # noqa: BLE001 - unsupported here: the Triton kernel
                logger.warning("cuDNN cannot run paged attention for %s (%s); those steps "
                               "use the Triton kernel", shape, exc)
                self._graphs[key] = None
        return self._graphs[key]

    def disable(self, graph: _PagedGraph) -> None:
        """Never use `graph` again (its steps go to the Triton kernel)."""
        for key, built in self._graphs.items():
            if built is graph:
                self._graphs[key] = None


_PREFILL = CudnnPrefill()


def reachable_shapes(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                     block_size: int) -> list[GraphShape]:
    """The graph buckets the prefill steps of an engine with these limits can reach."""
    longest = min(max_num_batched_tokens, max_model_len)
    pages = -(-max_model_len // block_size)
    num_reqs = [1 << i for i in range(max(1, min(MAX_REQS, max_num_seqs)).bit_length())]
    if num_reqs[-1] < min(MAX_REQS, max_num_seqs):
        num_reqs.append(num_reqs[-1] * 2)
    return sorted({GraphShape.for_step(n, longest, pages) for n in num_reqs},
                  key=lambda s: s.num_reqs)


def build_graphs(shapes: list[GraphShape], num_heads: int, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, softmax_scale: float) -> int:
    """Build the graphs for `shapes` now (warm-up); returns how many are usable (none for
    a float32 cache, which the Triton kernel serves)."""
    if k_cache.dtype not in (torch.float16, torch.bfloat16):
        return 0
    return sum(_PREFILL.graph(s, num_heads, k_cache, v_cache, softmax_scale) is not None
               for s in shapes)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, max_query_len: int, max_seq_len: int,
                    softmax_scale: float, out: torch.Tensor | None = None,
                    shape: GraphShape | None = None,
                    step_cache: dict | None = None) -> torch.Tensor:
    """`kernels.paged_attention` with prefill-shaped steps through cuDNN; same arguments,
    same contract (rows of `out` past `query_start_loc[-1]` are not written). `shape`
    overrides the graph bucket (benchmarks; it must hold the step). `step_cache`: a dict
    that lives as long as this step's metadata (`AttentionMetadata.derived`), where the
    tensors cuDNN needs beyond it are kept for the step's other layers; None derives them
    on every call. Raises ValueError as the Triton launcher does on misuse, and when
    nvidia-cudnn-frontend is missing or cuDNN is older than 9.6."""
    def on_triton() -> torch.Tensor:
        return triton_paged_attention(query, k_cache, v_cache, query_start_loc, seq_lens,
                                      block_tables, max_query_len, max_seq_len,
                                      softmax_scale, out)

    num_reqs = seq_lens.shape[0]
    if not routes_to_cudnn(query, num_reqs, max_query_len):
        return on_triton()
    if not cudnn_available():
        raise ValueError("the cudnn attention backend needs nvidia-cudnn-frontend and "
                         "cuDNN >= 9.6 on CUDA (pip install 'kvtier[cudnn]'); or use 'triton'")
    if not looks_valid(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out):
        check_args(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out)
    num_heads, head_dim = query.shape[1], query.shape[2]
    needed = GraphShape.for_step(num_reqs, max_query_len, block_tables.shape[1])
    if shape is None:
        shape = needed
    elif (shape.num_reqs < num_reqs or shape.max_query_len < max_query_len
          or shape.num_pages < block_tables.shape[1]):
        raise ValueError(f"graph shape {shape} cannot hold this step ({num_reqs} requests, "
                         f"longest query {max_query_len}, tables {block_tables.shape[1]} "
                         f"blocks wide); pass shape=None to let the backend pick {needed}")
    graph = _PREFILL.graph(shape, num_heads, k_cache, v_cache, softmax_scale)
    if graph is None:
        return on_triton()
    import cudnn

    query = query.contiguous()  # [num_tokens, heads, dim]: cuDNN's packed rows
    if out is None:
        out = torch.empty_like(query)
    elif not out.is_contiguous():
        raise ValueError("out must be contiguous [num_tokens, num_heads, head_dim] for the "
                         "cudnn backend; pass out=None to get a new tensor")
    derived_key = ("cudnn", shape, num_heads * head_dim)
    inputs = None if step_cache is None else step_cache.get(derived_key)
    if inputs is None:
        inputs = _step_inputs(query_start_loc, seq_lens, block_tables, shape,
                              num_heads * head_dim)
        if step_cache is not None:
            step_cache[derived_key] = inputs
    q_lens, offsets, kv_lens, tables = inputs
    handle = _PREFILL._handles[k_cache.device.index]
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(query.device).cuda_stream)
    try:
        graph.graph.execute({graph.q: query, graph.offsets: offsets, graph.k: k_cache,
                             graph.v: v_cache, graph.table_k: tables, graph.table_v: tables,
                             graph.q_lens: q_lens, graph.kv_lens: kv_lens, graph.o: out},
                            graph.workspace, handle=handle)
    except Exception as exc:  # noqa: BLE001 - cuDNN refused at run time: the Triton kernel
        _PREFILL.disable(graph)
        logger.warning("cuDNN paged attention failed for %s (%s); those steps use the "
                       "Triton kernel from now on", shape, exc)
        return on_triton()
    return out
