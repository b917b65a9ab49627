"""Timing profiles: how long a prefill batch and a decode step take on a given GPU.

The model (reference: SGLang's prefill-priority continuous batching) is

    prefill batch time = b + a * sum(U) + c * sum(U_r * (C_r + U_r / 2))
    decode step time   = d0 + d1 * batch_size + d2 * sum(context tokens)

where U_r are the uncached (extend) tokens of request r in the batch and C_r its cached or
already-computed prefix: `a` is the per-token GEMM cost, `c` the attention cost per
(query token x context token), `b` the fixed per-step overhead (scheduling, sampling the first
token, detokenizing). Decode is memory-bound: `d0` reads the weights once per step, `d2`
reads each KV token once.

The GPU numbers are priors from public data for Llama-3.1-8B BF16 (see docs/sim.md): about
30k prefill tokens/s at 40-60 % MFU (a = 33 us), c ~ 1 ns, and a decode step of weights / HBM
bandwidth (16 GB / 3.35 TB/s = 4.8 ms on H100, 3.3 ms on H200). Replace them with numbers
fitted on a real GPU (docs/sim.md, "Calibration").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    model_path: str
    a: float  # seconds per uncached prompt token
    b: float  # seconds of fixed overhead per prefill batch
    c: float  # seconds per (uncached token x attended context token)
    d0: float  # seconds per decode step
    d1: float  # seconds per request in the decode batch
    d2: float  # seconds per KV token read in a decode step
    max_total_tokens: int  # KV pool size in tokens
    max_running_requests: int
    context_length: int

    def prefill_time(self, chunks: list[tuple[int, int]]) -> float:
        """One prefill forward pass over `chunks` = [(uncached U_r, prefix C_r), ...]."""
        if not chunks:
            return 0.0
        linear = 0
        attention = 0.0
        for uncached, prefix in chunks:
            linear += uncached
            attention += uncached * (prefix + uncached / 2)
        return self.b + self.a * linear + self.c * attention

    def decode_time(self, batch_size: int, context_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        return self.d0 + self.d1 * batch_size + self.d2 * context_tokens

    def predict_ttft(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """Server-side TTFT of a lone request (no queue, no chunking): one prefill batch."""
        uncached = prompt_tokens - cached_tokens
        return self.prefill_time([(uncached, cached_tokens)])


_LLAMA3_8B = "meta-llama/Llama-3.1-8B-Instruct"
# KV per token, Llama-3-8B: 32 layers x 2 (K,V) x 8 KV heads x 128 dims x 2 bytes = 128 KiB.
# H100 80 GB: ~ (80 x 0.88 - 16) GB / 128 KiB ~ 420k tokens; H200 141 GB: ~ 850k tokens.
PROFILES: dict[str, Profile] = {
    "h100-llama3-8b": Profile(
        name="h100-llama3-8b",
        model_path=_LLAMA3_8B,
        a=33e-6,
        b=8e-3,
        c=1.1e-9,
        d0=4.5e-3,
        d1=10e-6,
        d2=40e-9,  # 128 KiB per KV token / 3.35 TB/s at ~100 % of the bandwidth
        max_total_tokens=420_000,
        max_running_requests=1024,
        context_length=131_072,
    ),
    "h200-llama3-8b": Profile(
        name="h200-llama3-8b",
        model_path=_LLAMA3_8B,
        a=33e-6,  # same BF16 compute as H100 (989 TFLOPS dense)
        b=7e-3,
        c=1.1e-9,
        d0=3.2e-3,
        d1=10e-6,
        d2=28e-9,  # 4.8 TB/s
        max_total_tokens=850_000,
        max_running_requests=1024,
        context_length=131_072,
    ),
    "instant": Profile(
        name="instant",
        model_path="quicedge/sim-instant",
        a=0.0,
        b=0.0,
        c=0.0,
        d0=0.0,
        d1=0.0,
        d2=0.0,
        max_total_tokens=1_000_000,
        max_running_requests=1024,
        context_length=131_072,
    ),
}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown profile {name!r} (known: {known})") from None
