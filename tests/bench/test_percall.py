"""The per-call codec benchmark (``python -m hvd_gradcomp.bench percall``) in a reduced mode:
its table (fp16 added as the yardstick, a warm and a cold figure per spec, ratios to fp16 of
the same run) and the refusal of an unknown spec. Timings are not checked (a shared machine)."""
import sys

from tests.hvdrun import run_process


def _rows(out):
    rows = {}
    for line in out.splitlines():
        words = line.split()
        if len(words) == 6 and words[3].endswith("x"):
            rows[words[0]] = words[1:]
    return rows


def test_table():
    cmd = [sys.executable, "-m", "hvd_gradcomp.bench", "percall", "--specs",
           "thc:error_feedback=false,subtract_own=true; thc",
           "--steps", "1", "--warmup", "1", "--evict-mb", "1"]
    res = run_process(cmd, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "lm-comm (29 tensors, 470,528 parameters)" in res.stdout, res.stdout
    rows = _rows(res.stdout)
    assert list(rows) == ["fp16", "thc:error_feedback=false,subtract_own=true", "thc"], res.stdout
    warm, cold, _, vs16, _ = rows["fp16"]
    assert float(warm) > 0 and float(cold) > 0 and vs16 == "1.00x"
    assert float(rows["thc:error_feedback=false,subtract_own=true"][0]) > 0


def test_unknown_spec_is_refused():
    cmd = [sys.executable, "-m", "hvd_gradcomp.bench", "percall", "--specs", "nosuch", "--steps", "1"]
    res = run_process(cmd, timeout=300)
    assert res.returncode != 0 and "nosuch" in res.stdout + res.stderr
