"""Hand-written float64 references of the schemes, independent of hvd_gradcomp's code.

Each reference simulates all ranks of one tensor in NumPy: it takes every rank's gradient for
a step and returns what every rank's decompress must output, keeping each rank's residual.
fp16 payloads are emulated exactly: each rank rounds ``x / n`` to fp16, Horovod's sum of two
fp16 values is rounded to fp16 once per addition, and Average scales the fp16 sum by 1/n.
"""
import math

import numpy as np


def fp16(x):
    return np.asarray(x, dtype=np.float64).astype(np.float16).astype(np.float64)


def allreduce_fp16(parts, op):
    """Horovod's fp16 all-reduce of the ranks' fp16 payloads (ring order: rank 0 first)."""
    total = parts[0]
    for p in parts[1:]:
        total = fp16(total + p)
    return fp16(total / len(parts)) if op == "average" else total


def chunk_selection(scores, k):
    """Indices of the k largest scores, ties by lower index."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return np.array(order[:k], dtype=np.int64)


class RefTopKC:
    """TopKC (selection="current" or "previous"), error feedback optional, fp16 or fp32 payload."""

    def __init__(self, numel, n, ratio, chunk, error_feedback=True, payload="float16",
                 selection="current"):
        self.d, self.n, self.c = numel, n, chunk
        self.m = -(-numel // chunk)
        self.k = min(self.m, max(1, math.ceil(ratio * self.m - 1e-9)))
        self.ef, self.payload, self.selection = error_feedback, payload, selection
        self.residual = [np.zeros(numel) for _ in range(n)]
        self.prev = np.zeros(self.m)

    def step(self, grads, op="average"):
        n, c, m, k = self.n, self.c, self.m, self.k
        corrected = [np.asarray(g, np.float64).reshape(-1) + (self.residual[r] if self.ef else 0)
                     for r, g in enumerate(grads)]
        padded = [np.concatenate([x, np.zeros(m * c - self.d)]).reshape(m, c) for x in corrected]
        scores = [(p ** 2).sum(1) for p in padded]
        ranking = sum(scores) if self.selection == "current" else self.prev
        idx = chunk_selection(list(ranking), k)
        cast = fp16 if self.payload == "float16" else (lambda v: v.astype(np.float32).astype(np.float64))
        sent = [cast(p[idx] / n) for p in padded]
        if self.payload == "float16":
            agg = allreduce_fp16(sent, op)
        else:
            agg = sum(sent) / (n if op == "average" else 1)
        out = np.zeros((m, c))
        out[idx] = agg * n
        if self.ef:
            for r in range(n):
                local = np.zeros((m, c))
                local[idx] = sent[r] * n
                self.residual[r] = (padded[r] - local).reshape(-1)[:self.d]
        if self.selection == "previous":
            normed = [cast(s / max(s.max(), 1e-30)) for s in scores]
            self.prev = (allreduce_fp16(normed, op) if self.payload == "float16"
                         else sum(normed) / (n if op == "average" else 1))
        return out.reshape(-1)[:self.d]


class RefTopK:
    """Magnitude TopK with error feedback, dense float32 payload."""

    def __init__(self, numel, n, ratio, error_feedback=True):
        self.d, self.n, self.ef = numel, n, error_feedback
        self.k = min(numel, max(1, math.ceil(ratio * numel - 1e-9)))
        self.residual = [np.zeros(numel) for _ in range(n)]

    def step(self, grads, op="average"):
        total = np.zeros(self.d)
        for r, g in enumerate(grads):
            x = np.asarray(g, np.float64).reshape(-1) + (self.residual[r] if self.ef else 0)
            idx = np.argsort(-np.abs(x), kind="stable")[:self.k]
            masked = np.zeros(self.d)
            masked[idx] = x[idx]
            if self.ef:
                self.residual[r] = x - masked
            total += masked
        return total / self.n if op == "average" else total


def fwht64(v, block):
    """Float64 Walsh-Hadamard transform (Sylvester order, unnormalised) of each block, by butterflies."""
    a = np.asarray(v, dtype=np.float64).reshape(-1, block)
    h = 1
    while h < block:
        a = a.reshape(a.shape[0], block // (2 * h), 2, h)
        a = np.concatenate([a[:, :, :1] + a[:, :, 1:], a[:, :, :1] - a[:, :, 1:]], axis=2)
        h *= 2
    return a.reshape(-1)


def reference_for_spec(spec, numel, n):
    """A reference simulator (RefTopKC / RefTopK) for a ``topkc``/``topk`` spec, else None."""
    name, _, rest = spec.partition(":")
    opts = dict(p.split("=") for p in rest.split(",") if p)
    if name == "topkc":
        return RefTopKC(numel, n, float(opts["ratio"]), int(opts["chunk"]),
                        error_feedback=opts.get("error_feedback", "true") == "true",
                        payload=opts.get("payload_dtype", "float16"),
                        selection=opts.get("selection", "current"))
    if name == "topk":
        return RefTopK(numel, n, float(opts["ratio"]))
    return None
