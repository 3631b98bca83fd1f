"""tierstore.optim against torch.optim (and a plain row-wise Adagrad) on the same
sequences of sparse steps, over many steps with random touched subsets."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tierstore import optim

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # raised inside torch.optim.Adagrad

N, D = 12, 5


def _steps(seed: int, n_steps: int = 25):
    """Random (touched rows, their summed gradients) per step."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_steps):
        k = int(torch.randint(1, N + 1, (1,), generator=g))
        rows = torch.randperm(N, generator=g)[:k].sort().values
        out.append((rows, torch.randn(k, D, generator=g)))
    return out


def _run_ours(opt, w0, steps, lr_at=None):
    table = torch.zeros(N, D + opt.state_dim(D))
    table[:, :D] = w0
    for i, (rows, grad) in enumerate(steps):
        if lr_at:
            opt.lr = lr_at(i)
        r = table[rows]
        opt.update(r, grad)
        table[rows] = r
    return table


def _sparse(rows, grad):
    return torch.sparse_coo_tensor(rows[None], grad, (N, D), check_invariants=True)


def test_state_dims():
    assert optim.SGD().state_dim(D) == 0
    assert optim.Adagrad().state_dim(D) == D
    assert optim.RowWiseAdagrad().state_dim(D) == 1
    assert optim.Adam().state_dim(D) == 2 * D + 1


def test_only_row_wise_adagrad_couples_a_rows_columns():
    assert optim.RowWiseAdagrad().row_coupled
    assert not any(o.row_coupled for o in (optim.SGD(), optim.Adagrad(), optim.Adam()))


@given(st.integers(0, 2**31 - 1))
def test_sgd_matches_torch_sgd_on_sparse_grads(seed):
    w0 = torch.randn(N, D, generator=torch.Generator().manual_seed(seed))
    steps = _steps(seed)
    ours = _run_ours(optim.SGD(lr=0.05), w0, steps)
    p = torch.nn.Parameter(w0.clone())
    ref = torch.optim.SGD([p], lr=0.05)
    for rows, grad in steps:
        p.grad = _sparse(rows, grad)
        ref.step()
    torch.testing.assert_close(ours, p.detach(), rtol=1e-6, atol=1e-6)


@given(st.integers(0, 2**31 - 1))
def test_adagrad_matches_torch_adagrad_on_sparse_grads(seed):
    w0 = torch.randn(N, D, generator=torch.Generator().manual_seed(seed))
    steps = _steps(seed)
    ours = _run_ours(optim.Adagrad(lr=0.1, eps=1e-10), w0, steps)
    p = torch.nn.Parameter(w0.clone())
    ref = torch.optim.Adagrad([p], lr=0.1, eps=1e-10)
    for rows, grad in steps:
        p.grad = _sparse(rows, grad)
        ref.step()
    # torch's op sequence: the state bit for bit; the weights within the one rounding
    # of -lr * (g / d) that torch fuses into its add (a few ulp of the step per update)
    assert torch.equal(ours[:, D:], ref.state[p]["sum"])
    torch.testing.assert_close(ours[:, :D], p.detach(), rtol=1e-6, atol=1e-7)


def _plain_rowwise_adagrad(w0, steps, lr, eps):
    """Row by row in float64, straight from the definition."""
    w = w0.double().numpy().copy()
    acc = np.zeros(N)
    for rows, grad in steps:
        for r, g in zip(rows.tolist(), grad.double().numpy()):
            acc[r] += float(np.mean(g * g))
            w[r] -= lr * g / (math.sqrt(acc[r]) + eps)
    return w, acc


@given(st.integers(0, 2**31 - 1))
def test_rowwise_adagrad_matches_plain_reference(seed):
    w0 = torch.randn(N, D, generator=torch.Generator().manual_seed(seed))
    steps = _steps(seed)
    ours = _run_ours(optim.RowWiseAdagrad(lr=0.1, eps=1e-8), w0, steps)
    w, acc = _plain_rowwise_adagrad(w0, steps, 0.1, 1e-8)
    np.testing.assert_allclose(ours[:, :D].numpy(), w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours[:, D].numpy(), acc, rtol=1e-5, atol=1e-7)


def _torch_adam_per_row(w0, steps, lr_at, **kw):
    """torch.optim.Adam applied densely to the touched rows: each row is its own
    parameter, given a gradient only on the steps that touch it."""
    params = [torch.nn.Parameter(w0[i].clone()) for i in range(N)]
    ref = torch.optim.Adam(params, lr=lr_at(0), **kw)
    for i, (rows, grad) in enumerate(steps):
        ref.param_groups[0]["lr"] = lr_at(i)
        for p in params:
            p.grad = None
        for r, g in zip(rows.tolist(), grad):
            params[r].grad = g.clone()
        ref.step()
    return params, ref


@given(st.integers(0, 2**31 - 1))
def test_adam_matches_torch_adam_on_touched_rows(seed):
    w0 = torch.randn(N, D, generator=torch.Generator().manual_seed(seed))
    steps = _steps(seed)
    lr_at = lambda i: 0.01 if i < 10 else 0.003  # noqa: E731  (a schedule: lr changes mid-run)
    ours = _run_ours(optim.Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-6), w0, steps, lr_at=lr_at)
    params, ref = _torch_adam_per_row(w0, steps, lr_at, betas=(0.8, 0.99), eps=1e-6)
    for i, p in enumerate(params):
        s = ref.state.get(p)
        if not s:  # never touched: weights as they started, zero state
            assert torch.equal(ours[i, :D], w0[i]) and not ours[i, D:].any()
            continue
        # same op sequence as torch's Adam, per row: bit-identical, not just close
        assert torch.equal(ours[i, :D], p.detach())
        assert torch.equal(ours[i, D : 2 * D], s["exp_avg"])
        assert torch.equal(ours[i, 2 * D : 3 * D], s["exp_avg_sq"])
        assert ours[i, 3 * D].item() == float(s["step"])


def test_lr_change_is_used_by_the_next_step():
    w0 = torch.zeros(N, D)
    steps = [(torch.tensor([0]), torch.ones(1, D))] * 2
    out = _run_ours(optim.SGD(lr=0.5), w0, steps, lr_at=lambda i: [0.5, 0.25][i])
    assert torch.equal(out[0], torch.full((D,), -0.75))


def test_update_is_deterministic_and_in_place():
    rows = torch.zeros(7, D + 2 * D + 1)
    rows[:, :D] = torch.randn(7, D)
    grad = torch.randn(7, D)
    a, b = rows.clone(), rows.clone()
    optim.Adam().update(a, grad)
    optim.Adam().update(b, grad)
    assert torch.equal(a, b) and not torch.equal(a, rows)


@pytest.mark.parametrize("bad", [-1.0, -1e-9, float("nan"), float("inf"), "0.1", True])  # 0 is allowed: a warm-up starts there
def test_bad_lr_is_refused(bad):
    with pytest.raises(ValueError, match="lr must be"):
        optim.SGD(lr=bad)
    opt = optim.SGD(lr=0.1)
    with pytest.raises(ValueError, match="lr must be"):
        opt.lr = bad
    assert opt.lr == 0.1


def test_bad_hyperparameters_are_refused():
    with pytest.raises(ValueError, match="betas"):
        optim.Adam(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="eps"):
        optim.Adagrad(eps=0)


def test_wrong_row_width_names_the_fix():
    with pytest.raises(ValueError, match="state_dim=optimizer.state_dim"):
        optim.Adagrad().update(torch.zeros(3, D + 1), torch.zeros(3, D))
    with pytest.raises(ValueError, match=r"\[n, dim\]"):
        optim.SGD().update(torch.zeros(3, D), torch.zeros(2, D))


def test_empty_update_is_a_no_op():
    rows = torch.zeros(0, 2 * D)
    optim.Adagrad().update(rows, torch.zeros(0, D))
    assert rows.shape == (0, 2 * D)
