"""Performance model of one rollout worker (a TP group running one model): time of an engine iteration.

Pure: no I/O. The simulator's engine times every iteration with `iteration_time`, and the predictor
draws its makespan parameters (A, b, t_p, KV transfer, KV capacity) from the same functions, so the
code that is measured and the code that predicts share one model of the hardware.

Every figure below is fixed calibration, with its source; none is tuned to a throughput target.

Roofline with measured efficiency (docs/calibration.md, `h100-7b-linear-efficiency.csv`, vidur):
  T_linear(n) = max(weight bytes read / (HBM_BW * MBU_PEAK),  n * F / (PEAK * MFU(n)))
  MFU(n) = MFU_PEAK * n / (n + MFU_HALF_TOKENS)
fitted to the CSV's 7B/H100 per-layer times (RMS log error 6.3% over 1..4096 tokens per step; the
knee at 128-256 tokens per step).

Serving efficiency (docs/calibration.md, "End-to-end serving efficiency under agentic load"):
- prefill runs at PREFILL_SERVING_FACTOR of the kernel roofline (the 0.8 serving-overhead factor;
  lands Llama-3.1-8B on one H100 at ~27-28k tok/s for 8k prompts, measured 27.7k, sglang PR #1060);
- decode at batch 1 is weight streaming plus STEP_OVERHEAD_S (7.06 ms/token measured for Llama-3-8B
  with CUDA graphs; this model gives ~6.7 ms);
- MoE expert weights stream at MOE_EXPERT_BW_EFFICIENCY of HBM peak, a kernel figure: a Triton
  fused-MoE kernel of the kind SGLang uses streams the touched experts at 0.54-0.67 of HBM bandwidth
  at batch 8-256 (measured on one H200, docs/calibration.md, "GPU measurements on an H200");
- each running sequence costs PER_SEQUENCE_OVERHEAD_S of scheduler CPU time per iteration (batch
  assembly, sampling, detokenization), overlapped with the GPU's work by SGLang's overlap scheduler
  (on by default since v0.4); checked against SGLang's ShareGPT saturation on one H100 (10.9k output
  tok/s of 24k total, sglang issue #1639).

Kernel speed and engine speed under agentic load are kept apart (docs/fidelity.md). Everything above
is what kernels (and an engine on a serving benchmark) deliver: `KERNEL`. Under agentic rollout an
engine delivers less (scheduling and CPU overhead between short turns, chunked prefill interrupting
decode, ragged batches, aborts and retractions): `AGENTIC_LOAD` divides the decode share and the
prefill share of every iteration by a fitted efficiency, for dense and MoE models alike. Its two
figures were fitted once on the paper's §3 measurements and frozen, with their ranges
(docs/fidelity.md); the simulator's engines use them, the serving-benchmark anchors (sim/calibration.py) use
`KERNEL`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from pearl.controlplane.core.catalog import GPUSpec, LinearEfficiencyRow, ModelSpec
from pearl.controlplane.core.domain import Role

MBU_PEAK = 0.78  # weight streaming share of HBM peak at small batch (CSV, MBU_vs_3350 at 1-8 tokens)
MFU_PEAK = 0.80  # asymptotic GEMM share of dense peak (CSV fit)
MFU_HALF_TOKENS = 250.0  # tokens per step at which GEMMs reach half of MFU_PEAK (CSV fit)
ATTENTION_BW_EFFICIENCY = 0.75  # decode attention reads the KV cache at 75% of HBM peak (docs/calibration.md)
ATTENTION_FLOPS_EFFICIENCY = 0.5  # prefill attention kernels vs dense peak [EST; FlashAttention-2/3 range]
STEP_OVERHEAD_S = 0.0005  # fixed per iteration: launch, sampling (docs/calibration.md decode step model)
PREFILL_SERVING_FACTOR = 0.8  # end-to-end prefill vs kernel roofline (docs/calibration.md)
MOE_EXPERT_BW_EFFICIENCY = 0.65  # fused-MoE kernel, touched experts vs HBM peak (H200: 0.54-0.67)
PER_SEQUENCE_OVERHEAD_S = 15e-6  # scheduler CPU time per running sequence per iteration [EST, #1639]
TP_ALLREDUCE_LATENCY_S = 8e-6  # one small all-reduce over NVLink (custom all-reduce) [EST]
KV_MEMORY_FRACTION = 0.9  # SGLang mem_fraction_static-like share of HBM the engine takes
ACTIVATION_RESERVE_BYTES = 3e9  # activations, CUDA graphs, NCCL buffers per GPU (docs/calibration.md)
KV_TRANSFER_SETUP_S = 0.002  # per-request KV handshake between prefill and decode pools [EST]


MBU_SMALL_BATCH_TOKENS = 8  # steps up to this many tokens stream weights (the MBU_PEAK rows)
MFU_FIT_FROM_TOKENS = 128  # rows from this many tokens per step are compute-bound (the MFU fit)


def fit_linear_efficiency(rows: Sequence[LinearEfficiencyRow]) -> tuple[float, float, float]:
    """(MBU_PEAK, MFU_PEAK, MFU_HALF_TOKENS) from a measured kernel-efficiency table: the mean MBU of
    the weight-streaming rows, and MFU(n) = peak * n / (n + half) by least squares on
    1/MFU = 1/peak + (half/peak) / n over the compute-bound rows."""
    small = [r.mbu for r in rows if r.tokens <= MBU_SMALL_BATCH_TOKENS]
    big = [r for r in rows if r.tokens >= MFU_FIT_FROM_TOKENS and r.mfu > 0]
    if not small or len(big) < 2:
        raise ValueError("the table needs weight-streaming rows and at least two compute-bound rows")
    xs = [1.0 / r.tokens for r in big]
    ys = [1.0 / r.mfu for r in big]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    return sum(small) / len(small), 1.0 / intercept, slope / intercept


@dataclass(frozen=True)
class ServingEfficiency:
    """The share of kernel speed an engine delivers (1.0: kernel speed), by the kind of iteration: decode
    and prefill on a colocated worker, decode on a decode worker (`decode_only`) and prefill on a
    prefill worker (`prefill_only`) of a split; None: as on a colocated worker."""

    decode: float = 1.0
    prefill: float = 1.0
    decode_only: float | None = None
    prefill_only: float | None = None

    def __post_init__(self) -> None:
        for name in ("decode", "prefill", "decode_only", "prefill_only"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"serving efficiency {name} must be in (0, 1], got {value}")

    def for_role(self, role: Role) -> ServingEfficiency:
        """The efficiencies a worker in `role` runs at (its decode and prefill shares)."""
        if role is Role.DECODE and self.decode_only is not None:
            return ServingEfficiency(self.decode_only, self.prefill)
        if role is Role.PREFILL and self.prefill_only is not None:
            return ServingEfficiency(self.decode, self.prefill_only)
        return ServingEfficiency(self.decode, self.prefill)


# A frozen fit (docs/fidelity.md): each figure with the range its argument allows.
AGENTIC_DECODE_EFFICIENCY = 0.7908241235421372  # a colocated worker's decode (docs/fidelity.md); range 0.30-0.80
AGENTIC_DECODE_EFFICIENCY_RANGE = (0.30, 0.80)
AGENTIC_PREFILL_EFFICIENCY = 0.6141331252098212  # a colocated worker's prefill (docs/fidelity.md); range 0.25-0.80
AGENTIC_PREFILL_EFFICIENCY_RANGE = (0.25, 0.80)
AGENTIC_DECODE_ONLY_EFFICIENCY = 0.8744731250144251  # a split's decode worker (docs/fidelity.md); range 0.30-0.90
AGENTIC_DECODE_ONLY_EFFICIENCY_RANGE = (0.30, 0.90)
AGENTIC_PREFILL_ONLY_EFFICIENCY = 0.476454111319516  # a split's prefill worker (docs/fidelity.md); range 0.25-0.80
AGENTIC_PREFILL_ONLY_EFFICIENCY_RANGE = (0.25, 0.80)
KERNEL = ServingEfficiency()
AGENTIC_LOAD = ServingEfficiency(AGENTIC_DECODE_EFFICIENCY, AGENTIC_PREFILL_EFFICIENCY,
                                 AGENTIC_DECODE_ONLY_EFFICIENCY, AGENTIC_PREFILL_ONLY_EFFICIENCY)

# How much of a trajectory's cached context its next turn still matches beyond the prompt (a frozen fit,
# docs/fidelity.md; range 0-1). SGLang's radix cache matches token prefixes; Qwen3's chat template
# renders earlier assistant turns without their reasoning (`<think>`) block, so in thinking mode the
# next turn's tokens leave the cached sequence at the first assistant turn and only the prompt (shared
# by the GRPO group) is reused: 0. A template that re-renders every turn verbatim reuses it all: 1.
# The simulated engine (sim/engine.py) and the predictor's prior (`profile.engine_from_perf`) read it.
TURN_PREFIX_REUSE = 0.11574873035213104
TURN_PREFIX_REUSE_RANGE = (0.0, 1.0)


def reusable_prefix(cached: float, prompt: float, reuse: float) -> float:
    """Tokens of a trajectory's `cached` context its next turn reuses: the prompt, then `reuse` of the
    rest. Numbers or numpy arrays alike (min(cached, prompt) written with abs for both)."""
    head = (cached + prompt - abs(cached - prompt)) / 2
    return head + reuse * (cached - head)


@dataclass(frozen=True)
class PerfModel:
    """Timing of one worker: `model` served with tensor parallelism `tp` on `gpu`s, at `serving`'s
    share of kernel speed."""

    model: ModelSpec
    gpu: GPUSpec
    tp: int
    serving: ServingEfficiency = field(default=KERNEL)

    def for_role(self, role: Role) -> PerfModel:
        """This worker in `role`: its iterations at that role's serving efficiencies."""
        serving = self.serving.for_role(role)
        return self if serving == self.serving else replace(self, serving=serving)

    # -- capacity -------------------------------------------------------------------------------

    @cached_property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache one worker holds (all TP ranks together)."""
        per_gpu = (
            KV_MEMORY_FRACTION * self.gpu.hbm_gb * 1e9 - self.model.weight_bytes / self.tp - ACTIVATION_RESERVE_BYTES
        )
        return max(0, int(per_gpu * self.tp / self.model.kv_bytes_per_token))

    # -- building blocks ------------------------------------------------------------------------

    def experts_touched(self, tokens: int) -> float:
        """Experts each layer reads for a step of `tokens` tokens (docs/calibration.md, MoE decode)."""
        m = self.model
        if not m.is_moe or tokens <= 0:
            return 0.0
        return m.experts * (1.0 - (1.0 - m.experts_active / m.experts) ** tokens)

    def weight_read_time(self, tokens: int) -> float:
        """Streaming the weights one step reads, per GPU."""
        m, bw = self.model, self.gpu.hbm_tbps * 1e12
        dense_bytes = (m.weight_bytes - m.expert_bytes) / self.tp
        t = dense_bytes / (bw * MBU_PEAK)
        if m.is_moe:
            expert_bytes = m.expert_bytes * self.experts_touched(tokens) / m.experts / self.tp
            t += expert_bytes / (bw * MOE_EXPERT_BW_EFFICIENCY)
        return t

    def linear_compute_time(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        mfu = MFU_PEAK * tokens / (tokens + MFU_HALF_TOKENS)
        return tokens * self.model.linear_flops_per_token / self.tp / (self.gpu.bf16_tflops * 1e12 * mfu)

    def tp_comm_time(self, tokens: int) -> float:
        """Two all-reduces of the hidden states per layer (ring: 2(tp-1)/tp of the bytes)."""
        if self.tp == 1 or tokens <= 0:
            return 0.0
        nbytes = tokens * self.model.hidden * 2
        per = TP_ALLREDUCE_LATENCY_S + 2 * (self.tp - 1) / self.tp * nbytes / (self.gpu.nvlink_gbps * 1e9)
        return 2 * self.model.layers * per

    def decode_attention_time(self, context_tokens: float) -> float:
        """Reading the KV cache of all decoding sequences (`context_tokens` summed over them), at the
        decode serving efficiency."""
        kv_bytes = context_tokens * self.model.kv_bytes_per_token / self.tp
        return kv_bytes / (self.gpu.hbm_tbps * 1e12 * ATTENTION_BW_EFFICIENCY * self.serving.decode)

    def prefill_attention_time(self, tokens: float, context_before: float) -> float:
        """Attention of `tokens` new tokens that see `context_before` cached tokens plus each other."""
        flops = tokens * (context_before + tokens / 2) * self.model.attention_flops_per_token_per_ctx
        return flops / self.tp / (self.gpu.bf16_tflops * 1e12 * ATTENTION_FLOPS_EFFICIENCY)

    # -- an engine iteration --------------------------------------------------------------------

    def iteration_time(
        self,
        prefill_tokens: int = 0,
        prefill_attention_s: float = 0.0,
        decode_batch: int = 0,
        decode_context_tokens: float = 0.0,
    ) -> float:
        """One forward pass of a continuous-batching engine.

        `prefill_tokens` new prompt tokens (chunked prefill; their attention cost precomputed with
        `prefill_attention_time`, summed over requests) plus `decode_batch` sequences decoding one
        token each over `decode_context_tokens` of cached context in total.
        """
        tokens = prefill_tokens + decode_batch
        if tokens <= 0:
            return 0.0
        linear = max(self.weight_read_time(tokens), self.linear_compute_time(tokens))
        gpu = linear + prefill_attention_s + self.tp_comm_time(tokens) + STEP_OVERHEAD_S
        share = prefill_tokens / tokens
        if prefill_tokens > 0:
            # end-to-end prefill serving efficiency applies to the prefill share of the pass
            gpu += (1.0 / PREFILL_SERVING_FACTOR - 1.0) * share * (linear + prefill_attention_s)
        # the engine under load: each share of the pass at its serving efficiency (1.0 for KERNEL)
        slowdown = share / self.serving.prefill + (1.0 - share) / self.serving.decode
        # SGLang's overlap scheduler prepares the next batch on the CPU while the GPU runs this one, so
        # the per-sequence CPU cost only shows when it exceeds the GPU work. Overlapping it with the
        # context-independent GPU work alone (conservative) keeps the iteration time affine in the
        # decode context, which the simulator's closed-form advance relies on.
        cpu = PER_SEQUENCE_OVERHEAD_S * decode_batch
        return max(gpu * slowdown, cpu) + self.decode_attention_time(decode_context_tokens)

    def decode_step_time(self, batch: int, context_mean: float) -> float:
        """A decode-only iteration: `batch` sequences of mean context `context_mean`."""
        return self.iteration_time(decode_batch=batch, decode_context_tokens=batch * context_mean)

    def prefill_time(self, tokens: int, context_before: float = 0.0, chunk: int = 8192) -> float:
        """Prefill of one request alone: `tokens` new tokens after `context_before` cached ones."""
        t, done = 0.0, 0
        while done < tokens:
            n = min(chunk, tokens - done)
            att = self.prefill_attention_time(n, context_before + done)
            t += self.iteration_time(prefill_tokens=n, prefill_attention_s=att)
            done += n
        return t

    def kv_transfer_time(self, tokens: float) -> float:
        """Moving `tokens` of KV from a prefill worker to a decode worker (each TP rank its shard)."""
        bw = self.gpu.nic_gbps * 1e9 * self.tp
        return KV_TRANSFER_SETUP_S + tokens * self.model.kv_bytes_per_token / bw

    # -- the predictor's parameters -------------------------------------------------------------

    def decode_coefficients(self, context_mean: float, batch_hint: int = 32) -> tuple[float, float]:
        """(A, b) of the method's decode model `T_iter(B) = A + b*B`, by a secant around `batch_hint`."""
        lo, hi = max(1, batch_hint // 2), max(2, batch_hint * 2)
        t_lo = self.decode_step_time(lo, context_mean)
        t_hi = self.decode_step_time(hi, context_mean)
        b = (t_hi - t_lo) / (hi - lo)
        return t_lo - b * lo, b

    def prefill_seconds_per_token(self, tokens: int = 2048, context_before: float = 0.0) -> float:
        """t_p: prefill time per token for a chunk of `tokens` after `context_before` cached tokens."""
        return self.prefill_time(tokens, context_before) / tokens
