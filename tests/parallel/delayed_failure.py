"""The failing-rank check the delayed DDP and FSDP2 tests share: rank 1 raises at step 2 and
exits; rank 0, which posted step 2 without waiting, must raise at its next wait for it instead
of hanging. Each worker records where it stopped with :func:`record`."""
import json
import os

import pytest

from tests.ddprun import run
from tests.hvdrun import WorkerError


def record(tmp, rank, where):
    """Write ``where`` (a step number, ``"drain"`` or ``"done"``) as rank ``rank``'s last place."""
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(where, f)


def check_peer_raises(worker, tmp_path, timeout=180):
    """Run ``worker(tmp)`` on 2 Gloo ranks and check: the launch raises (not at its timeout),
    rank 1 stopped at step 2, rank 0 after it but never "done", and both ranks raised."""
    with pytest.raises(Exception) as info:
        run(worker, np=2, args=(str(tmp_path),), timeout=timeout)
    assert not isinstance(info.value, TimeoutError)
    where = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert where[1] == 2
    assert where[0] in (2, 3, 4, "drain"), where  # after rank 1 left, never "done"
    cause = info.value.__cause__ if isinstance(info.value.__cause__, WorkerError) else info.value
    assert cause.errors == [0, 1]
