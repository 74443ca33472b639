"""``load_state_dict`` (hvd_gradcomp/checkpoint.py) in this one process: a truncated or damaged
checkpoint is a ValueError saying which entry is wrong, raised before anything is loaded.

Nothing here starts another process or joins a process group (the ``rank``/``world_size`` below
are fields of saved states), so nothing can hang on a peer. The rules that need real ranks
(resume, another rank's state, both engines) are in tests/parallel/test_checkpoint.py, whose
launches (tests/hvdrun.py, tests/ddprun.py) run under a timeout that kills the whole process
group."""
import pytest

from tests.backends import BACKENDS, native_tensor, requires_backend

SPEC = "topkc:ratio=0.1"


def _compression(backend):
    if backend == "torch":
        from torch_backend import Compression
    else:
        from tf_backend import Compression
    return Compression


def _per_rank(backend):
    """A well-formed per-rank state of SPEC for one tensor ``w``, as state_dict() writes it."""
    import numpy as np
    return {"spec": SPEC, "tensors": {"w": {"residual": native_tensor(backend, np.zeros(4, np.float32))}},
            "routes": {"w": SPEC}, "rank": 0, "world_size": 2}


def _damaged(state):
    """(what is changed, the state so damaged, the start of the message)."""
    per_rank = lambda **kw: {**state, **kw}  # noqa: E731
    gathered = lambda ranks: {"spec": SPEC, "world_size": 2, "ranks": ranks}  # noqa: E731
    no_tensors = {k: v for k, v in state.items() if k != "tensors"}
    return [
        ("not a dict", [state], "load_state_dict: expected the dict state_dict() returned, got list"),
        ("no spec", {k: v for k, v in state.items() if k != "spec"},
         "load_state_dict: state_dict has no 'spec' (keys ['rank', 'routes', 'tensors', 'world_size']); "
         "is it truncated"),
        ("no tensors", no_tensors, "load_state_dict: state_dict has no 'tensors' (the per-tensor state; keys "
                                   "['rank', 'routes', 'spec', 'world_size']): is it truncated"),
        ("tensors None", per_rank(tensors=None),
         "load_state_dict: state_dict['tensors'] must be a dict of tensor -> fields, got NoneType None"),
        ("tensors a string", per_rank(tensors="w"),
         "load_state_dict: state_dict['tensors'] must be a dict of tensor -> fields, got str 'w'"),
        ("a tensor's fields a string", per_rank(tensors={"w": "residual"}),
         "load_state_dict: state_dict['tensors']['w'] must be a non-empty dict of field -> tensor, got str"),
        ("a field a string", per_rank(tensors={"w": {"residual": "0.0"}}),
         "load_state_dict: state_dict['tensors']['w']['residual'] must be a tensor, got str '0.0'"),
        ("a field None", per_rank(tensors={"w": {"residual": None}}),
         "load_state_dict: state_dict['tensors']['w']['residual'] must be a tensor, got NoneType None"),
        ("a field no tensor", per_rank(tensors={"w": {"residual": object}}),
         "load_state_dict: tensor 'w' field 'residual' holds type <class 'object'>, not a tensor"),
        ("routes a string", per_rank(routes="topkc"),
         "load_state_dict: state_dict['routes'] must be a dict of tensor -> scheme spec text, got str"),
        ("a route not a text", per_rank(routes={"w": 3}),
         "load_state_dict: state_dict['routes'] must be a dict of tensor -> scheme spec text, got dict"),
        ("rank a string", per_rank(rank="0"),
         "load_state_dict: state_dict['rank'] must be an integer or None, got str '0'"),
        ("ranks empty", gathered([]),
         "load_state_dict: a gathered state_dict's 'ranks' must be a non-empty list of per-rank states, "
         "got list []"),
        ("ranks None", gathered(None),
         "load_state_dict: a gathered state_dict's 'ranks' must be a non-empty list of per-rank states, "
         "got NoneType None"),
        ("a rank a string", gathered([state, "rank 1"]),
         "load_state_dict: 'ranks'[1] must be a dict (one rank's state), got str 'rank 1'"),
        ("a rank without tensors", gathered([state, no_tensors]),
         "load_state_dict: 'ranks'[1] has no 'tensors'"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_damaged_checkpoints_raise_value_error(backend):
    Compression = _compression(backend)
    state = _per_rank(backend)
    Compression.from_spec(SPEC).load_state_dict(state, rank=0)  # the intact state loads
    for what, damaged, message in _damaged(state):
        comp = Compression.from_spec(SPEC)
        with pytest.raises(ValueError) as err:
            comp.load_state_dict(damaged, rank=0)
        assert str(err.value).startswith(message), (what, str(err.value))
        assert not comp.codec.tensors.pending and not comp.table.saved, what  # nothing loaded


@requires_backend("torch")
def test_rank_unknown_without_any_process_group():
    """Neither Horovod nor torch.distributed initialised: a gathered state needs rank=, and
    CompressionStats needs rank= (both say so); with rank= given both work. The same calls in
    a torch.distributed job take its rank: tests/parallel/test_checkpoint.py."""
    import torch.distributed as dist
    from torch_backend import Compression
    from torch_backend.stats import CompressionStats
    if dist.is_initialized():
        pytest.skip("a torch.distributed group is initialised in this process")
    state = _per_rank("torch")
    gathered = {"spec": SPEC, "world_size": 2, "ranks": [state, {**state, "rank": 1}]}
    comp = Compression.from_spec(SPEC)
    assert comp.codec.job_world() == (None, None)
    with pytest.raises(ValueError, match=r"load_state_dict: rank must be in \[0, 2\) for a state gathered from "
                                         r"2 ranks, got None \(is hvd.init\(\) or "
                                         r"torch.distributed.init_process_group\(\) done\? else pass rank=\)"):
        comp.load_state_dict(gathered)
    comp.load_state_dict(gathered, rank=1)
    assert set(comp.codec.tensors.pending) == {"w"}
    params = [torch_param()]
    with pytest.raises(ValueError, match=r"CompressionStats: this process's rank is unknown: neither hvd.init\(\) "
                                         r"nor torch.distributed.init_process_group\(\) is done; pass rank="):
        CompressionStats(comp, params)
    assert CompressionStats(comp, params, rank=1).rank == 1
    with pytest.raises(TypeError):
        CompressionStats(object(), params)


def torch_param():
    import torch
    return torch.nn.Parameter(torch.zeros(3))
