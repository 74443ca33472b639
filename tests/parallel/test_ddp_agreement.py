"""DDP: the ranks' compressors checked at registration (issue 47, item 5), on real Gloo
processes: one launch of 2 ranks. Every rank must register the same spec (rules included)
and per_tensor (DDP itself checks the parameters): a difference raises the same
ValueError on every rank at ``register_comm_hook`` (or at the first backward for
``comm_state``), naming both ranks' values, instead of one rank aborted inside Gloo and its
peer reset mid-backward."""
import pytest
import torch

from tests.ddprun import run

# case: (rank 0's settings, rank 1's settings), each (spec, per_tensor, frozen parameter names)
CASES = {
    "spec": (("thc", False, ()), ("fp16", False, ())),
    "per_tensor": (("topkc:0.1", False, ()), ("topkc:0.1", True, ())),
    "rules": (("*.bias -> fp16; thc", False, ()), ("thc", False, ())),
    "comm_state": (("signsgd", False, ()), ("bf16", False, ())),
}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def _attempt(case, settings):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch_backend import Compression
    from torch_backend.ddp import comm_state, hook, register_comm_hook
    spec, per_tensor, frozen = settings[dist.get_rank()]
    model = _model()
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    comp = Compression.from_spec(spec)
    try:
        if case == "comm_state":  # bound at the first backward, inside the hook
            ddp = DDP(model)
            ddp.register_comm_hook(comm_state(model, comp), hook)
        else:
            ddp = DDP(model)
            register_comm_hook(ddp, comp, per_tensor=per_tensor)
        ddp(torch.randn(4, 6)).sum().backward()
    except ValueError as exc:
        return f"ValueError: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported: the test fails on it
        return f"{type(exc).__name__}: {exc}"
    return "trained"


def worker():
    import torch.distributed as dist
    out = {case: _attempt(case, settings) for case, settings in CASES.items()}
    # The same settings on every rank still train, after the refusals (nothing left posted).
    out["agree"] = _attempt("spec", {0: ("thc", False, ()), 1: ("thc", False, ())})
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def two():
    return run(worker, np=2, timeout=240)


@pytest.mark.parametrize("case", sorted(CASES))
def test_mismatch_refused_on_every_rank(two, case):
    (spec0, per0, frozen0), (spec1, per1, frozen1) = CASES[case]
    for rank, result in enumerate(two):
        assert result[case].startswith("ValueError: "), (rank, result[case])
        assert "disagree" in result[case], (rank, result[case])
        if spec0 != spec1:
            from torch_backend import Compression
            for spec in (spec0, spec1):
                assert repr(Compression.from_spec(spec).spec) in result[case], (rank, result[case])
        if per0 != per1:
            assert "per_tensor" in result[case], (rank, result[case])
    assert two[0][case] == two[1][case]  # the same message on every rank


def test_agreeing_ranks_train(two):
    assert [r["agree"] for r in two] == ["trained", "trained"]
