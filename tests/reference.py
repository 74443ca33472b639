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


FP16_MAX = 65504.0
F32_MAX = float(np.finfo(np.float32).max)


def fp16_limit(n):
    """The largest float16 <= 65504 / n: n values of at most this sum to <= 65504 in fp16."""
    v = FP16_MAX / n
    r = float(np.float16(v))
    return r if r <= v else float(np.nextafter(np.float16(r), np.float16(0)))


def saturate_fp16(x, n=1):
    """fp16 payload cast of finite values, each clamped to +-fp16_limit(n) first, so the fp16
    sum of n ranks' payloads never overflows (what the clamp cuts stays in error feedback)."""
    limit = fp16_limit(n)
    return fp16(np.clip(np.asarray(x, np.float64), -limit, limit))


def fp32(x):
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


class RefTopKC:
    """TopKC, every rank of one tensor: ``selection="previous"`` (default) or ``"current"``,
    error feedback optional, fp16 or fp32 payload; the scheme alone, on a tensor of any size
    (which tensors a compressor sends as fp16 instead is the routing's: :func:`reference_for_spec`).

    "previous": the k chunks of highest agreed score are sent (ties: lower index; all zero
    before the first step); the scores each rank appends to its payload are the squared chunk
    norms of ``g + e'`` (its gradient plus its new residual), normalised by that rank's own
    maximum (non-finite scores as 0), cast to the payload dtype; they are all-reduced with the
    values (fp16: summed as Horovod sums fp16, under Average divided by n) and become the
    agreed scores of the NEXT step (each rank's vote for its selection rides there too; the
    ranks simulated here always agree, so the votes change nothing). "current": chunks ranked
    by this step's float32 scores of ``c = g + e`` summed over the ranks (the blocking side
    all-reduce); the payload is the values only. Either way each rank's residual is ``c`` minus
    the decoded values it sent, on the selected chunks (what fp16 rounding and the saturation
    at the largest float16 <= 65504 / n cut stays there); when the all-reduced payload is not
    finite, every rank's residual and the agreed scores stay as they were. ``residual_decay``
    (beta): the carried residual enters as ``c = g + beta e`` and the scores guess
    ``g + beta e'``. ``max_age`` (A > 0, "previous"): each chunk's age counts the steps since it
    was last sent (0 at first; kept only when the all-reduced payload is finite: sent -> 0,
    others + 1); the chunks of age >= A are taken first, oldest first, ties by lower index, then
    the rest by agreed score as above (written as two lists, not as the scheme's one sort key).
    """

    def __init__(self, numel, n, ratio, chunk, error_feedback=True, payload="float16",
                 selection="previous", residual_decay=1.0, max_age=0):
        self.d, self.n, self.c = numel, n, chunk
        self.m = -(-numel // chunk)
        self.k = min(self.m, max(1, math.ceil(ratio * self.m - 1e-9)))
        self.ef, self.payload, self.selection = error_feedback, payload, selection
        self.beta = residual_decay
        self.residual = [np.zeros(numel) for _ in range(n)]
        self.prev = np.zeros(self.m)
        self.max_age = max_age
        self.age = np.zeros(self.m, np.int64)
        self.last_payload = None  # the all-reduced payload of the last step (float64 values)
        self.last_idx = None  # the chunks selected in the last step

    def _cast(self, v, n=1):
        return saturate_fp16(v, n) if self.payload == "float16" else fp32(v)

    def _aged_selection(self, k):
        due = sorted((i for i in range(self.m) if self.age[i] >= self.max_age), key=lambda i: (-self.age[i], i))
        rest = [i for i in chunk_selection(list(self.prev), self.m) if i not in due]
        return np.array((due + rest)[:k], dtype=np.int64)

    def _allreduce(self, parts, op):
        if self.payload == "float16":
            return allreduce_fp16(parts, op)
        return sum(parts) / (self.n if op == "average" else 1)

    def _padded(self, flat):
        return np.concatenate([flat, np.zeros(self.m * self.c - self.d)]).reshape(self.m, self.c)

    def _scores(self, chunks):
        """float32 squared chunk norms, non-finite (float32 overflow included) as 0."""
        with np.errstate(over="ignore", invalid="ignore"):
            s = (chunks ** 2).sum(1)
        return np.where(np.isfinite(s) & (s <= F32_MAX), s, 0.0)

    def step(self, grads, op="average"):
        n, m, k = self.n, self.m, self.k
        grads = [np.asarray(g, np.float64).reshape(-1) for g in grads]
        corrected = [g + (self.beta * self.residual[r] if self.ef else 0) for r, g in enumerate(grads)]
        padded = [self._padded(x) for x in corrected]
        if self.selection == "current":
            ranking = sum(fp32(self._scores(p)) for p in padded)
        else:
            ranking = self.prev
        if self.max_age:
            idx = self.last_idx = self._aged_selection(k)
        else:
            idx = self.last_idx = chunk_selection(list(ranking), k)
        with np.errstate(over="ignore", invalid="ignore"):
            sent = [self._cast(p[idx] / n, n) for p in padded]
        # Residual e' = c - (decoded values sent), on the selected chunks only.
        new_residual = []
        for r in range(n):
            left = padded[r].copy()
            left[idx] -= sent[r] * n
            new_residual.append(left.reshape(-1)[:self.d])
        parts = [s.reshape(-1) for s in sent]
        if self.selection == "previous":
            for r in range(n):
                guess = grads[r] + self.beta * new_residual[r] if self.ef else grads[r]
                scores = self._scores(self._padded(guess))
                parts[r] = np.concatenate([parts[r], self._cast(scores / max(scores.max(), 1e-30))])
        finite = [np.isfinite(g).all() for g in grads]
        with np.errstate(over="ignore", invalid="ignore"):
            agg = self._allreduce(parts, op)
        if not all(finite):  # poison: a NaN/inf on one rank makes every rank's payload NaN
            agg = agg + np.nan
        self.last_payload = agg
        out = np.zeros((m, self.c))
        out[idx] = agg[:k * self.c].reshape(k, self.c) * n
        if np.isfinite(agg.sum()):
            if self.ef:
                self.residual = new_residual
            if self.selection == "previous":
                self.prev = agg[k * self.c:]
            self.age += 1
            self.age[idx] = 0
        return out.reshape(-1)[:self.d]


class RefFp16:
    """The fp16 route of tensors below a compressor's ``min_numel`` (Fp16Scheme), every rank:
    each rank's gradient pre-scaled by 1/n and cast to float16 (no saturation), summed as
    Horovod sums fp16 (Average: divided by n), times n; no state."""

    def __init__(self, n):
        self.n = n
        self.last_payload = None  # the all-reduced payload of the last step (float64 values)

    def step(self, grads, op="average"):
        grads = [np.asarray(g, np.float64).reshape(-1) for g in grads]
        with np.errstate(over="ignore", invalid="ignore"):
            self.last_payload = allreduce_fp16([fp16(g / self.n) for g in grads], op)
            return self.last_payload * self.n


class RefTopK:
    """Magnitude TopK with error feedback, dense float32 payload (a NaN/inf on one rank makes
    every output NaN and leaves every residual as it was)."""

    def __init__(self, numel, n, ratio, error_feedback=True):
        self.d, self.n, self.ef = numel, n, error_feedback
        self.k = min(numel, max(1, math.ceil(ratio * numel - 1e-9)))
        self.residual = [np.zeros(numel) for _ in range(n)]

    def step(self, grads, op="average"):
        total = np.zeros(self.d)
        new_residual = []
        for r, g in enumerate(grads):
            x = np.asarray(g, np.float64).reshape(-1) + (self.residual[r] if self.ef else 0)
            idx = np.argsort(-np.abs(x), kind="stable")[:self.k]
            masked = np.zeros(self.d)
            masked[idx] = x[idx]
            new_residual.append(x - masked)
            total += masked if np.isfinite(x).all() else np.nan  # poison
        if self.ef and np.isfinite(total).all():  # a failed step leaves every residual as it was
            self.residual = new_residual
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
    """A reference simulator of a plain ``topkc``/``topk`` compressor spec (``key=value``
    options, ``min_numel`` included) on a tensor of ``numel`` coordinates and ``n`` ranks, as
    the routing sends it: :class:`RefFp16` below ``min_numel`` (default 1024 for topkc, 1 for
    topk), else RefTopKC / RefTopK; None for other specs."""
    name, _, rest = spec.partition(":")
    opts = dict(p.split("=") for p in rest.split(",") if p)
    if name in ("topkc", "topk") and numel < int(opts.get("min_numel", 1024 if name == "topkc" else 1)):
        return RefFp16(n)
    if name == "topkc":
        return RefTopKC(numel, n, float(opts.get("ratio", 0.01)), int(opts.get("chunk", 256)),
                        error_feedback=opts.get("error_feedback", "true") == "true",
                        payload=opts.get("payload_dtype", "float16"),
                        selection=opts.get("selection", "previous"),
                        residual_decay=float(opts.get("residual_decay", 1.0)),
                        max_age=int(opts.get("max_age", 0)))
    if name == "topk":
        return RefTopK(numel, n, float(opts["ratio"]))
    return None


def gram_schmidt64(p, tol=1e-4):
    """orthogonalize() in float64: columns in order, twice projected, max-abs pre-scaled;
    zero or dependent columns (norm below ``tol`` of the pre-projection norm) become 0."""
    cols = []
    for j in range(p.shape[1]):
        v = p[:, j].copy()
        top = np.abs(v).max()
        v = v / top if top > 0 else v
        norm0 = np.linalg.norm(v)
        for _ in range(2):
            for c in cols:
                v = v - c * (c @ v)
        norm = np.linalg.norm(v)
        cols.append(v / norm if norm > norm0 * tol else v * 0.0)
    return np.stack(cols, 1)


class RefTopKCEF21:
    """TopKC with ``error_feedback="ef21"`` (Richtarik et al., NeurIPS 2021), every rank of
    one tensor, written from the recursion: rank ``i`` keeps ``h_i`` and every rank the same
    ``H``; at each step the k chunks of highest agreed score are selected (all zero at first:
    the first k), rank ``i`` sends ``C_i`` = ``g_i - h_i`` on them (cast to the payload dtype
    after dividing by n, decoded times n), ``h_i += C_i``, ``H += `` the all-reduced C's
    (their sum under Sum, their mean under Average) and every rank outputs the new ``H``.
    Each rank's scores are the squared chunk norms of ``g_i - h_i`` after the update,
    normalised by their maximum, all-reduced with the values: the next step's agreed scores.
    A non-finite all-reduced payload leaves everything as it was (and the output NaN).
    """

    def __init__(self, numel, n, ratio, chunk, payload="float16", momentum=1.0):
        self.d, self.n, self.c, self.payload = numel, n, chunk, payload
        self.a = momentum  # EF21-M: rank i compresses v_i = (1 - a) v_i + a g_i (from 0) instead of g_i
        self.v = [np.zeros(numel) for _ in range(n)]
        self.m = -(-numel // chunk)
        self.k = min(self.m, max(1, math.ceil(ratio * self.m - 1e-9)))
        self.h = [np.zeros(numel) for _ in range(n)]
        self.H = np.zeros(numel)
        self.prev = np.zeros(self.m)

    def _cast(self, v, n=1):
        return saturate_fp16(v, n) if self.payload == "float16" else fp32(v)

    def _padded(self, flat):
        return np.concatenate([flat, np.zeros(self.m * self.c - self.d)]).reshape(self.m, self.c)

    def step(self, grads, op="average"):
        n, k = self.n, self.k
        idx = chunk_selection(list(self.prev), k)
        parts, sent = [], []
        v = [(1 - self.a) * self.v[r] + self.a * np.asarray(g, np.float64).reshape(-1) for r, g in enumerate(grads)]
        for r, g in enumerate(v):
            diff = self._padded(g - self.h[r])
            with np.errstate(over="ignore", invalid="ignore"):
                wire = self._cast(diff[idx] / n, n)
            decoded = np.zeros_like(diff)
            decoded[idx] = wire * n
            sent.append(decoded.reshape(-1)[:self.d])
            with np.errstate(over="ignore", invalid="ignore"):
                s = ((diff - decoded) ** 2).sum(1)
            s = np.where(np.isfinite(s), s, 0.0)
            parts.append(np.concatenate([wire.reshape(-1), self._cast(s / max(s.max(), 1e-30))]))
        with np.errstate(over="ignore", invalid="ignore"):
            if self.payload == "float16":
                agg = allreduce_fp16(parts, op)
            else:
                agg = sum(parts) / (n if op == "average" else 1)
        dense = np.zeros((self.m, self.c))
        dense[idx] = agg[:k * self.c].reshape(k, self.c) * n
        new_H = self.H + dense.reshape(-1)[:self.d]
        if np.isfinite(agg.sum()):
            self.h = [h + s for h, s in zip(self.h, sent)]
            self.H = new_H
            self.v = v
            self.prev = agg[k * self.c:]
        return new_H
