"""The three user examples in ``examples/``, each launched as a user does (``horovodrun -np 2
--gloo python examples/<script> ...``) for a few epochs, one launch per script.

Checked from what rank 0 prints (rank 1 prints nothing of its own):
- the test accuracy after the last epoch is above a bound (each run reaches it in the epochs
  given; measured 89-96% on the shared 2-core machine, seeds fixed);
- the last stats line (the closing line; in Keras, the last epoch's) holds the bytes sent per step, equal to the schemes' own wire formula for
  the example's model (independently of the compressor object), the FP16 bytes (2 per
  parameter), their ratio (> 1) and the collectives per step;
- PyTorch and Keras with ``--log-dir``: the TensorBoard scalars hold the same numbers.

Launches: one PyTorch, two TensorFlow (TensorFlow's import costs ~10 s a rank); measured
3-4 minutes together on the 2-core machine shared with other test runs (load 5), the
PyTorch one 85 s of it.
"""
import glob
import os
import re
import sys

import pytest

from hvd_gradcomp.base import TensorInfo
from hvd_gradcomp.routing import Routing
from tests.backends import backend_ops, requires_backend
from tests.conftest import ROOT
from tests.hvdrun import run_command

EXAMPLES = os.path.join(ROOT, "examples")
# The examples' MLP 64-256-256-10: weight and bias shapes, in parameter order.
TORCH_SHAPES = [(256, 64), (256,), (256, 256), (256,), (10, 256), (10,)]
TF_SHAPES = [(64, 256), (256,), (256, 256), (256,), (256, 10), (10,)]
PARAMS = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10  # 85,002
STATS = re.compile(r"(?P<spec>\S+): (?P<sent>[\d,]+) B/step sent, FP16 (?P<fp16>[\d,]+) B/step "
                   r"\(FP16/ours (?P<ratio>[\d.]+)x\); (?P<coll>\d+) collectives/step "
                   r"\((?P<payloads>\d+) payloads \+ (?P<side>\d+) side\)(?P<metrics>.*)$")
ACCURACY = re.compile(r"final test accuracy (?P<acc>[\d.]+)%")


def expected_bytes(spec, shapes, layout, bucketed=False):
    """Bytes per step (2 ranks) from the wire formula of the scheme the compressor's routing
    gives each tensor under the backend ``layout`` (fp16 below thc/topkc's 1024 coordinates
    and for the vectors PowerSGD does not accept). ``bucketed``: all ``shapes`` in one DDP
    bucket, the tensors of one route whose scheme flattens sent as one vector (buckets.py)."""
    routing = Routing.from_spec(spec).bind(backend_ops(layout))
    total, groups = 0, {}
    for i, shape in enumerate(shapes):
        info = TensorInfo(f"t{i}", tuple(shape), "float32", 2, 0, "sum" if bucketed else "average")
        scheme = routing.decide(info.key, info).scheme
        if bucketed and scheme.flattens:
            groups.setdefault(id(scheme), [scheme, 0])[1] += info.numel
            continue
        wire = scheme.wire(info)
        total += wire.payload + wire.side
    for scheme, numel in groups.values():
        wire = scheme.wire(TensorInfo("group", (numel,), "float32", 2, 0, "sum"))
        total += wire.payload + wire.side
    return total


def launch(script, *args, timeout=400):
    """Run the example on 2 ranks; returns ``{rank: [lines]}`` (stdout and stderr, unprefixed)."""
    proc = run_command([sys.executable, os.path.join(EXAMPLES, script), *args], np=2, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = {0: [], 1: []}
    for text in (proc.stdout, proc.stderr):
        for line in text.splitlines():
            m = re.match(r"^\[(\d+)\]<std(?:out|err)>:(.*)$", line)
            if m:
                lines[int(m.group(1))].append(m.group(2))
    return lines


def check_closing_line(lines, spec, shapes, layout, accuracy):
    """The final accuracy, and the last stats line: exact bytes, FP16 bytes, ratio, collectives."""
    (done,) = [ln for ln in lines if ACCURACY.search(ln)]
    assert float(ACCURACY.search(done).group("acc")) >= accuracy, done
    final = [ln for ln in lines if STATS.search(ln)][-1]
    m = STATS.search(final)
    assert m["spec"] == spec, final
    sent, fp16 = int(m["sent"].replace(",", "")), int(m["fp16"].replace(",", ""))
    assert sent == expected_bytes(spec, shapes, layout), final
    assert fp16 == 2 * PARAMS and float(m["ratio"]) == pytest.approx(fp16 / sent, abs=0.005)
    assert float(m["ratio"]) > 1 and int(m["coll"]) == int(m["payloads"]) == 6 and m["side"] == "0"
    assert "realigned 0" in m["metrics"], final
    return sent, m


def scalars(log_dir, tag):
    """``[(step, value)]`` of a TensorBoard scalar written by ``torch.utils.tensorboard`` or
    ``tf.summary`` (stored as a tensor)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    if tag in acc.Tags()["scalars"]:
        return [(e.step, e.value) for e in acc.Scalars(tag)]
    return [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]


@requires_backend("torch")
def test_pytorch_example_amp_topkc(tmp_path):
    spec = "topkc:0.1"
    logs = str(tmp_path / "tb")
    lines = launch("pytorch_digits.py", "--compression", spec, "--epochs", "3", "--log-dir", logs)
    epochs = [ln for ln in lines[0] if ln.startswith("epoch ")]
    assert [ln.split(",")[0] for ln in epochs] == ["epoch 1", "epoch 2", "epoch 3"]
    assert "step 66:" in epochs[-1]  # 718 examples a worker, 22 full batches of 32 an epoch
    sent, _ = check_closing_line(lines[0], "topkc:ratio=0.1", TORCH_SHAPES, "torch", accuracy=85.0)
    assert not any("epoch" in ln or "B/step" in ln for ln in lines[1])  # rank 0 logs alone
    assert scalars(logs, "compression/bytes_per_step") == [(66, sent)]
    assert scalars(logs, "compression/fp16_bytes_per_step") == [(66, 2 * PARAMS)]
    assert scalars(logs, "compression/realigned") == [(66, 0)]


@requires_backend("tensorflow")
def test_keras_example_fit_thc(tmp_path):
    logs = str(tmp_path / "tb")
    lines = launch("keras_digits.py", "--compression", "thc", "--epochs", "3", "--log-dir", logs)
    per_epoch = [ln for ln in lines[0] if ln.startswith("epoch ") and "B/step" in ln]
    assert [ln.split(":")[0] for ln in per_epoch] == ["epoch 1", "epoch 2", "epoch 3"]
    sent, m = check_closing_line(lines[0], "thc", TF_SHAPES, "tensorflow", accuracy=85.0)
    assert re.search(r"; saturated \d+", m["metrics"])
    assert all(STATS.search(ln)["sent"] == m["sent"] for ln in per_epoch)
    assert not any("B/step" in ln for ln in lines[1])
    assert scalars(logs, "compression/bytes_per_step") == [(1, sent), (2, sent), (3, sent)]
    ratio = scalars(logs, "compression/fp16_ratio")
    assert [s for s, _ in ratio] == [1, 2, 3] and ratio[-1][1] == pytest.approx(2 * PARAMS / sent, rel=1e-6)
    assert len(glob.glob(os.path.join(logs, "events.out.tfevents.*"))) == 1  # rank 0 only


@requires_backend("tensorflow")
def test_tf_gradient_tape_example_powersgd():
    lines = launch("tf_digits.py", "--compression", "powersgd:4", "--epochs", "3")
    epochs = [ln for ln in lines[0] if ln.startswith("epoch ")]
    assert len(epochs) == 3 and "step 66:" in epochs[-1]
    check_closing_line(lines[0], "powersgd:rank=4", TF_SHAPES, "tensorflow", accuracy=85.0)
    assert not any("B/step" in ln for ln in lines[1])
