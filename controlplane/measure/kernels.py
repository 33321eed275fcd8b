"""Measuring a worker's engine on this device with torch kernels shaped like the model's layers.

`pearlctl profile` times what one rollout worker's iterations are made of and fits the profile's
engine (decode curve, b_ctx, t_p0, t_pc), from which the method's A, b and t_p follow
(`EngineProfile.a_b`, `prefill_s_per_token_at`). torch is an optional extra: it is imported only
here, lazily, and TorchMissing says how to install it.

What one layer of one TP rank does (heads and FFN divided by tp; the all-reduces are not timed):
the QKV projection, attention (decode: n single-token queries, each over its own c cached tokens,
grouped-query; prefill: a chunk of T new tokens over c cached tokens plus, causally, each other),
the output projection and the gated MLP (gate and up, SiLU, down). The catalog has no FFN width,
so it comes from the linear FLOPs: per layer F / (2 x layers) weights (the LM head spread over the
layers), less the attention projections, over 3 x hidden.

A mixture of experts (the catalog's `experts`) has a routed MoE layer instead of the MLP: the router
projection, then each expert the step's tokens are routed to (top-k, uniform routing drawn once per
shape, so the experts a batch touches are those of docs/calibration.md's formula on average) runs
its gated MLP of the expert width (expert_bytes / (2 x layers x experts x 3 x hidden)) on its
tokens, and the results are summed back. The touched experts' weights are read every step, as
SGLang's fused-MoE kernels read them.

An iteration is timed as an engine runs it: the layers chained, each feeding the next, with one
synchronisation at the end (SGLang decodes under CUDA graphs; a sync after every layer would time
the kernel launches at small batches). On CUDA the chained stack is captured as a CUDA graph and
replayed (`timing: "cuda-graph"`), or run eagerly when capture fails (`"chained"`). On the CPU,
where a call returns when its work is done, CPU_CHAIN_LAYERS layers are chained and scaled to the
model's layers.

Fit. For each batch n of DECODE_BATCHES up to `max_batch`: T(n, c0) and T(n, c1); b_ctx is the
median over n of (T(n, c1) - T(n, c0)) / (n (c1 - c0)); base(n) = T(n, c0) - b_ctx n c0, made
non-decreasing in n (a running maximum: more sequences never make an iteration cheaper, so a dip is
timing noise); batches past `max_batch` continue the last measured slope (marked `extrapolated`).
Prefill: t_p0 = T_pre(T, 0) / T and t_pc = (T_pre(T, c1) / T - t_p0) / c1.

KV figures: on a GPU in the catalog, the KV transfer (it crosses NICs, which one device cannot
time) and the KV capacity come from the catalog performance model. On the CPU (the key's gpu is
"cpu") the measured shape's KV bytes per token, a timed host copy as the link, and half the host
memory as capacity: a CPU profile describes this CPU running the shape it timed, nothing more.

Shapes: the full model shape by default on CUDA; on the CPU a scaled-down one (hidden, heads and
FFN times `scale`, head_dim kept), said so in the result, with float32 (bf16 matrix products on
CPUs are emulated on many of them).
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from pearl.controlplane.core.catalog import ModelSpec
from pearl.controlplane.core.perfmodel import PerfModel
from pearl.controlplane.core.profile import DECODE_BATCHES, EngineProfile
from pearl.controlplane.errors import BadInput, PearlError

CPU_SCALE = 1 / 8  # default shape factor on the CPU
DEFAULT_TP = 1
CPU_CHAIN_LAYERS = 4  # layers chained per timed stack on the CPU (module docstring)
ROUTING_SEED = 0  # the uniform routing of the MoE layer, drawn once per shape


class TorchMissing(PearlError):
    """torch is not installed: `pip install torch==2.13.0` (CPU build), or `pip install -e '.[torch]'`."""


class DeviceUnavailable(PearlError):
    """The requested device is not available here."""


@dataclass(frozen=True)
class LayerShape:
    """One layer of one TP rank, as timed."""

    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # the MLP's width, or for a mixture of experts one expert's (per rank)
    layers: int
    dtype: str
    experts: int = 0  # routed experts per layer (0: a dense MLP)
    experts_active: int = 0  # experts each token is routed to

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of one token over every layer of this rank."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * (2 if self.dtype == "bfloat16" else 4)


@dataclass(frozen=True)
class MeasureSpec:
    """What to time (the CLI's options)."""

    device: str  # "cpu" or "cuda"
    scale: float  # shape factor (1: the model's own shape)
    tp: int = DEFAULT_TP
    max_batch: int = 512
    context_small: int = 16  # c0
    context_tokens: int = 4096  # c1
    chunk_tokens: int = 2048  # prefill chunk T
    repeats: int = 10

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise BadInput(f"--device: must be cpu or cuda, got {self.device!r}")
        if not 0 < self.scale <= 1:
            raise BadInput(f"--scale: must be in (0, 1], got {self.scale}")
        options = {"tp": "--tp", "max_batch": "--max-batch", "context_tokens": "--context", "chunk_tokens": "--chunk",
                   "repeats": "--repeats"}
        for name, option in options.items():
            if getattr(self, name) < 1:
                raise BadInput(f"{option}: must be >= 1, got {getattr(self, name)}")
        if self.max_batch < 2:
            raise BadInput("--max-batch: must be >= 2 (the decode curve needs two points)")
        if not 0 < self.context_small < self.context_tokens:
            raise BadInput(f"--context: must be > {self.context_small} (the small context), got {self.context_tokens}")


@dataclass(frozen=True)
class Measurement:
    """The fitted engine and how it was measured (stored with the `measured` profile row)."""

    engine: EngineProfile
    shape: LayerShape
    spec: MeasureSpec
    device_name: str
    scaled: bool
    decode_s: dict[int, tuple[float, float]]  # batch -> (T(n, c0), T(n, c1)), measured
    extrapolated: tuple[int, ...]  # batches whose base continues the last measured slope
    prefill_s: tuple[float, float]  # T_pre(T, 0), T_pre(T, c1)
    seconds: float  # wall time of the measurement
    timing: str = "chained"  # how the layer stack was timed: "cuda-graph" or "chained" (module docstring)

    def method_symbols(self, batch_hint: float = 8.0) -> dict[str, float]:
        """A, b (secant around `batch_hint` sequences) and t_p, at the measured context c1."""
        c = float(self.spec.context_tokens)
        a, b = self.engine.a_b(c, batch_hint)
        return {"A": a, "b": b, "t_p": float(self.engine.prefill_s_per_token_at(c)), "context_tokens": c,
                "batch_hint": batch_hint}

    def as_dict(self) -> dict[str, Any]:
        return {
            "device_name": self.device_name,
            "scaled": self.scaled,
            "shape": asdict(self.shape),
            "spec": asdict(self.spec),
            "decode_s": {str(n): list(t) for n, t in self.decode_s.items()},
            "extrapolated": list(self.extrapolated),
            "prefill_s": list(self.prefill_s),
            "timing": self.timing,
            "symbols": self.method_symbols(),
            "seconds": self.seconds,
        }


def import_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise TorchMissing() from None
    return torch


def ffn_width(model: ModelSpec) -> int:
    """FFN width from the linear FLOPs (module docstring)."""
    per_layer = model.linear_flops_per_token / 2 / model.layers
    attention = model.hidden * model.head_dim * (2 * model.q_heads + 2 * model.kv_heads)
    return max(model.hidden, int(round((per_layer - attention) / (3 * model.hidden))))


def expert_width(model: ModelSpec) -> int:
    """One expert's FFN width from the catalog's expert bytes (bf16, gate, up and down)."""
    return int(round(model.expert_bytes / (2 * model.layers * model.experts * 3 * model.hidden)))


def layer_shape(model: ModelSpec, tp: int, scale: float, dtype: str) -> LayerShape:
    """One TP rank's layer at `scale` (head_dim kept, at least one KV head, q heads a multiple of it);
    a mixture of experts keeps every expert, each of its expert width divided by tp."""
    if model.q_heads % tp or model.kv_heads % tp and tp % model.kv_heads:
        raise BadInput(f"--tp: {tp} does not divide the heads of {model.name} ({model.q_heads} q, {model.kv_heads} kv)")
    # a rank keeps q_heads / tp query heads and ceil(kv_heads / tp) KV heads (replicated when tp > kv_heads)
    q_rank, kv_rank = model.q_heads // tp, -(-model.kv_heads // tp)
    kv = max(1, round(kv_rank * scale))
    q = kv * max(1, q_rank // kv_rank)
    hidden = max(64, int(round(model.hidden * scale)))
    if model.is_moe:
        ffn = max(16, int(round(expert_width(model) * scale / tp)))
        return LayerShape(hidden, q, kv, model.head_dim, ffn, model.layers, dtype, model.experts,
                          model.experts_active)
    ffn = max(64, int(round(ffn_width(model) * scale / tp)))
    return LayerShape(hidden, q, kv, model.head_dim, ffn, model.layers, dtype)


def routing(tokens: int, experts: int, active: int, seed: int = ROUTING_SEED) -> list[list[int]]:
    """Uniform top-k routing of `tokens` tokens: for each expert, the tokens routed to it (pure)."""
    import random

    rng = random.Random(seed * 1_000_003 + tokens)
    out: list[list[int]] = [[] for _ in range(experts)]
    for token in range(tokens):
        for e in rng.sample(range(experts), active):
            out[e].append(token)
    return out


def time_stack(step: Callable[[Any], Any], x: Any, chain: int, repeats: int, sync: Callable[[], None],
               graph: Callable[[Callable[[], Any]], Callable[[], Any]] | None = None) -> tuple[float, str]:
    """Median seconds of `chain` chained calls of `step` (each feeding the next) with one `sync` at the
    end, over `repeats` samples after one warm-up; with `graph`, the chain is captured once and its
    replay is timed (`graph` returns the replay, or raises if capture fails: then it runs eagerly).
    Returns (seconds, "cuda-graph" | "chained")."""

    def stack() -> Any:
        y = x
        for _ in range(chain):
            y = step(y)
        return y

    run, how = stack, "chained"
    if graph is not None:
        try:
            run, how = graph(stack), "cuda-graph"
        except Exception:  # noqa: BLE001 - capture is an optimisation: any failure falls back to eager
            run, how = stack, "chained"
    run()
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), how


def measure(model: ModelSpec, spec: MeasureSpec, perf: PerfModel | None = None,
            progress: Callable[[str], None] | None = None) -> Measurement:
    """Time the kernels and fit the engine (module docstring). `perf` (a catalog GPU) supplies the
    KV transfer and capacity on CUDA; without it they are measured as on the CPU."""
    torch = import_torch()
    if spec.device == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailable("--device cuda: torch sees no CUDA device here (use --device cpu)")
    started = time.perf_counter()
    dev = torch.device(spec.device)
    dtype = torch.bfloat16 if spec.device == "cuda" else torch.float32
    shape = layer_shape(model, spec.tp, spec.scale, "bfloat16" if dtype == torch.bfloat16 else "float32")
    layer = _Layer(torch, shape, dev, dtype)
    sync = torch.cuda.synchronize if spec.device == "cuda" else (lambda: None)
    say = progress or (lambda _: None)

    chain = shape.layers if spec.device == "cuda" else min(shape.layers, CPU_CHAIN_LAYERS)
    graph = _cuda_graph(torch) if spec.device == "cuda" else None
    methods: set[str] = set()

    def timed(step_and_input: tuple[Callable[[Any], Any], Any]) -> float:
        step, x = step_and_input
        with torch.inference_mode():
            seconds, how = time_stack(step, x, chain, spec.repeats, sync, graph)
        methods.add(how)
        return seconds * shape.layers / chain

    c0, c1 = spec.context_small, spec.context_tokens
    batches = [n for n in DECODE_BATCHES if n <= spec.max_batch]
    decode: dict[int, tuple[float, float]] = {}
    for n in batches:
        say(f"decode batch {n}")
        decode[n] = (timed(layer.decode(n, c0)), timed(layer.decode(n, c1)))
    say("prefill")
    prefill = (timed(layer.prefill(spec.chunk_tokens, 0)), timed(layer.prefill(spec.chunk_tokens, c1)))
    layer.free()
    b_ctx = max(0.0, statistics.median((t1 - t0) / (n * (c1 - c0)) for n, (t0, t1) in decode.items()))
    # an iteration never gets cheaper with more sequences: timing noise is cut by a running maximum
    base = list(itertools.accumulate((max(1e-9, decode[n][0] - b_ctx * n * c0) for n in batches), max))
    slope = max(0.0, (base[-1] - base[-2]) / (batches[-1] - batches[-2]))
    extra = [n for n in DECODE_BATCHES if n > batches[-1]]
    base += [base[-1] + slope * (n - batches[-1]) for n in extra]
    t_p0 = max(1e-12, prefill[0] / spec.chunk_tokens)
    t_pc = max(0.0, (prefill[1] / spec.chunk_tokens - t_p0) / c1)
    kv = _kv_figures(torch, shape, spec, dev, perf, kv_shards=min(spec.tp, model.kv_heads),
                     timed_copy=lambda nbytes: _copy_seconds(torch, dev, nbytes, sync))
    engine = EngineProfile(
        decode_batches=DECODE_BATCHES, decode_base_s=tuple(base), decode_s_per_ctx_token=b_ctx,
        prefill_s_per_token=t_p0, prefill_s_per_token_per_ctx=t_pc, **kv,
    )
    name = torch.cuda.get_device_name(dev) if spec.device == "cuda" else _cpu_name()
    timing = "cuda-graph" if methods == {"cuda-graph"} else "chained"
    return Measurement(engine, shape, spec, name, spec.scale < 1, decode, tuple(extra), prefill,
                       time.perf_counter() - started, timing)


def _cuda_graph(torch: Any) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    """Capture a callable as a CUDA graph (after a warm-up on a side stream); returns its replay."""

    def capture(fn: Callable[[], Any]) -> Callable[[], Any]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g.replay

    return capture


def _kv_figures(torch: Any, shape: LayerShape, spec: MeasureSpec, dev: Any, perf: PerfModel | None,
                kv_shards: int, timed_copy: Callable[[int], float]) -> dict[str, Any]:
    """KV bytes per token, link and capacity of one worker; `kv_shards` = min(tp, kv_heads): the
    ranks whose KV heads differ (past kv_heads the ranks hold replicas)."""
    if perf is not None and spec.scale == 1:
        setup = perf.kv_transfer_time(0)
        return {
            "kv_bytes_per_token": perf.model.kv_bytes_per_token,
            "kv_bandwidth_bps": perf.model.kv_bytes_per_token / (perf.kv_transfer_time(1.0) - setup),
            "kv_setup_s": setup,
            "kv_capacity_tokens": perf.kv_capacity_tokens,
        }
    # K and V move once per distinct KV head; every rank stores its own heads, replicas included
    per_token = shape.kv_bytes_per_token * kv_shards
    stored = shape.kv_bytes_per_token * spec.tp
    nbytes = 64 << 20
    setup = timed_copy(4096)
    bandwidth = nbytes / max(1e-9, timed_copy(nbytes) - setup)
    if spec.device == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        memory = 0.9 * free
    else:
        memory = 0.5 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"kv_bytes_per_token": per_token, "kv_bandwidth_bps": bandwidth, "kv_setup_s": setup,
            "kv_capacity_tokens": int(memory / stored)}


def _copy_seconds(torch: Any, dev: Any, nbytes: int, sync: Callable[[], None]) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


class _Layer:
    """The weights of one layer and the closures that run it (module docstring).

    Grouped-query attention without copying K and V per query head: the query heads that share a
    KV head are laid out along the query dimension. The new tokens' K and V are written into the
    cache in place, as a paged KV cache does, and attention reads the whole of it.
    """

    def __init__(self, torch: Any, shape: LayerShape, dev: Any, dtype: Any) -> None:
        self.torch, self.s, self.dev, self.dtype = torch, shape, dev, dtype
        self.group = shape.q_heads // shape.kv_heads
        h, d = shape.hidden, shape.head_dim
        w = lambda *size: torch.randn(*size, device=dev, dtype=dtype) / math.sqrt(size[0])  # noqa: E731
        self.w_qkv = w(h, (shape.q_heads + 2 * shape.kv_heads) * d)
        self.w_o = w(shape.q_heads * d, h)
        if shape.experts:
            self.w_router = w(h, shape.experts)
            self.w_gate_up = torch.randn(shape.experts, h, 2 * shape.ffn, device=dev, dtype=dtype) / math.sqrt(h)
            self.w_down = torch.randn(shape.experts, shape.ffn, h, device=dev, dtype=dtype) / math.sqrt(shape.ffn)
        else:
            self.w_gate_up = w(h, 2 * shape.ffn)
            self.w_down = w(shape.ffn, h)
        self.cache: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.routes: dict[int, list[tuple[int, Any]]] = {}

    def _kv(self, n: int, c: int) -> tuple[Any, Any]:
        """K and V caches of n sequences of c tokens (one at a time, so memory stays bounded)."""
        if (n, c) not in self.cache:
            self.cache.clear()
            size = (n, self.s.kv_heads, c, self.s.head_dim)
            self.cache[(n, c)] = (self.torch.randn(*size, device=self.dev, dtype=self.dtype),
                                  self.torch.randn(*size, device=self.dev, dtype=self.dtype))
        return self.cache[(n, c)]

    def _split(self, qkv: Any, tokens: int) -> tuple[Any, Any, Any]:
        """(tokens, qkv) -> q (kv_heads, group * tokens, d), k and v (kv_heads, tokens, d)."""
        s = self.s
        q_dim, kv_dim = s.q_heads * s.head_dim, s.kv_heads * s.head_dim
        q = qkv[:, :q_dim].view(tokens, s.kv_heads, self.group, s.head_dim).permute(1, 2, 0, 3)
        k = qkv[:, q_dim:q_dim + kv_dim].view(tokens, s.kv_heads, s.head_dim).transpose(0, 1)
        v = qkv[:, q_dim + kv_dim:].view(tokens, s.kv_heads, s.head_dim).transpose(0, 1)
        return q.reshape(s.kv_heads, self.group * tokens, s.head_dim), k, v

    def touched(self, tokens: int) -> list[tuple[int, Any]]:
        """(expert, the indices of its tokens) for each expert a step of `tokens` tokens is routed to."""
        if tokens not in self.routes:
            self.routes[tokens] = [(e, self.torch.tensor(idx, device=self.dev, dtype=self.torch.long))
                                   for e, idx in enumerate(routing(tokens, self.s.experts, self.s.experts_active))
                                   if idx]
        return self.routes[tokens]

    def _finish(self, x: Any, attn: Any) -> Any:
        """Output projection, residual, gated MLP (or the routed experts' MLPs)."""
        F = self.torch.nn.functional  # noqa: N806 - torch's own name
        y = attn @ self.w_o + x
        if not self.s.experts:
            gate, up = (y @ self.w_gate_up).chunk(2, dim=-1)
            return (F.silu(gate) * up) @ self.w_down + y
        y @ self.w_router  # the router's logits (the routing itself is fixed per shape)
        out = y.clone()
        for e, idx in self.touched(y.shape[0]):
            gate, up = (y.index_select(0, idx) @ self.w_gate_up[e]).chunk(2, dim=-1)
            out.index_add_(0, idx, (F.silu(gate) * up) @ self.w_down[e])
        return out

    def decode(self, n: int, c: int) -> tuple[Callable[[Any], Any], Any]:
        """One layer of a decode iteration of n sequences, each attending over its own c tokens (the
        last is new): (the layer, from hidden states to hidden states, so layers chain; its input)."""
        s, torch = self.s, self.torch
        F = torch.nn.functional  # noqa: N806
        x0 = torch.randn(n, s.hidden, device=self.dev, dtype=self.dtype)
        k_cache, v_cache = self._kv(n, c)
        q_dim, kv_dim = s.q_heads * s.head_dim, s.kv_heads * s.head_dim

        def run(x: Any) -> Any:
            qkv = x @ self.w_qkv
            q = qkv[:, :q_dim].view(n, s.kv_heads, self.group, s.head_dim)
            k_cache[:, :, c - 1] = qkv[:, q_dim:q_dim + kv_dim].view(n, s.kv_heads, s.head_dim)
            v_cache[:, :, c - 1] = qkv[:, q_dim + kv_dim:].view(n, s.kv_heads, s.head_dim)
            attn = F.scaled_dot_product_attention(q, k_cache, v_cache)
            return self._finish(x, attn.reshape(n, q_dim))

        return run, x0

    def prefill(self, t: int, c: int) -> tuple[Callable[[Any], Any], Any]:
        """One layer of a chunk of t new tokens of one sequence after c cached ones (causal among the
        new): (the layer, from hidden states to hidden states; its input)."""
        s, torch = self.s, self.torch
        F = torch.nn.functional  # noqa: N806
        x0 = torch.randn(t, s.hidden, device=self.dev, dtype=self.dtype)
        k_cache, v_cache = self._kv(1, c + t)
        # row g * t + i is new token i of query head g of its group: it sees columns j <= c + i
        mask = torch.ones(t, c + t, device=self.dev, dtype=torch.bool).tril(diagonal=c).repeat(self.group, 1)
        q_dim = s.q_heads * s.head_dim

        def run(x: Any) -> Any:
            q, k, v = self._split(x @ self.w_qkv, t)
            k_cache[0, :, c:] = k
            v_cache[0, :, c:] = v
            attn = F.scaled_dot_product_attention(q.unsqueeze(0), k_cache, v_cache, attn_mask=mask)
            out = attn.view(s.kv_heads, self.group, t, s.head_dim).permute(2, 0, 1, 3).reshape(t, q_dim)
            return self._finish(x, out)

        return run, x0

    def free(self) -> None:
        self.cache.clear()
        if self.dev.type == "cuda":
            self.torch.cuda.empty_cache()
