"""``tierstore bench gpu``'s compile part: the demo's DLRM, every row in the HBM tier,
trained eagerly and under ``torch.compile(fullgraph=True)`` on the same batches (on
CUDA with inductor, mode "reduce-overhead": the step in CUDA graphs), their losses
compared; and ``torch.export.export`` of the model, its program's output against the
module's. A compiler's refusal is a result here, reported with its first line."""
from __future__ import annotations

import statistics
import tempfile

import torch

LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-6  # inductor's kernels may round the dense layers differently from eager's
UNTIMED = 2  # the first compiled steps compile (and record CUDA graphs)


def compile_part(directory, seed: int, sz: dict, device: torch.device, timer, backend: str) -> tuple[dict, list]:
    """Returns the part's figures and its printed lines."""
    from tierstore.tools.demo import ClickData, DemoConfig

    cfg = DemoConfig(rows=sz["dlrm_rows"], progress=False)
    gen = torch.Generator().manual_seed(seed)
    data = ClickData(cfg, gen)
    batches = [_moved(data.batch(gen), device) for _ in range(max(sz["dlrm_steps"], UNTIMED + 1))]
    mode = "reduce-overhead" if device.type == "cuda" and backend == "inductor" else None
    out = {"model": f"demo DLRM, {cfg.tables} tables x {cfg.rows} x {cfg.dim}, batch {cfg.batch}, every row in the "
                    "HBM tier, Adagrad", "steps": len(batches), "backend": backend, "mode": mode}
    with tempfile.TemporaryDirectory(prefix="tierstore-bench-gpu-", dir=directory) as d:
        eager = _dlrm(cfg, f"{d}/eager", seed, device)
        eager_losses, eager_times = _train(eager, eager, batches, cfg.lr, timer)
        twin = _dlrm(cfg, f"{d}/compiled", seed, device)
        torch._dynamo.reset()
        try:
            fwd = torch.compile(twin, fullgraph=True, backend=backend, mode=mode)
            losses, times = _train(twin, fwd, batches, cfg.lr, timer, cuda_graphs=mode is not None)
            diff = (losses - eager_losses).abs().max().item()
            out["compile"] = {"ok": True, "equal": torch.allclose(losses, eager_losses, rtol=LOSS_RTOL, atol=LOSS_ATOL),
                              "max_loss_diff": diff, "first_step_s": times[0], "eager_ms": _p50(eager_times),
                              "compiled_ms": _p50(times)}
        except Exception as e:  # noqa: BLE001 - a graph break under fullgraph=True is the finding
            out["compile"] = {"ok": False, "equal": False, "error": _first_line(e), "eager_ms": _p50(eager_times)}
        eager.eval()
        dense, sparse, _ = batches[0]
        try:
            with torch.no_grad():
                want = eager(dense, sparse)
                got = torch.export.export(eager, (dense, sparse), strict=False).module()(dense, sparse)
            out["export"] = {"ok": True, "equal": torch.allclose(got, want, rtol=LOSS_RTOL, atol=LOSS_ATOL),
                             "max_diff": (got - want).abs().max().item()}
        except Exception as e:  # noqa: BLE001 - a refusal is the finding
            out["export"] = {"ok": False, "equal": False, "error": _first_line(e)}
        for model in (eager, twin):
            model.embeddings.close()
    c, x = out["compile"], out["export"]
    lines = [(f"torch.compile(fullgraph=True, backend={backend}" + (f", mode={mode})" if mode else ")"),
              (f"losses equal to eager's within rtol {LOSS_RTOL}: {c['equal']} (max difference {c['max_loss_diff']:.1e}); "
               f"step {c['compiled_ms']:.2f} ms against eager {c['eager_ms']:.2f} ms; first step {c['first_step_s']:.1f} s")
              if c["ok"] else f"refused: {c['error']}"),
             ("torch.export.export", f"program's output equal to the module's: {x['equal']} (max difference "
                                     f"{x['max_diff']:.1e})" if x["ok"] else f"refused: {x['error']}")]
    return out, lines


def _moved(batch, device: torch.device):
    dense, sparse, labels = batch
    return dense.to(device), {n: (i.to(device), o.to(device)) for n, (i, o) in sparse.items()}, labels.to(device)


def _dlrm(cfg, path: str, seed: int, device: torch.device):
    """The demo's DLRM over a collection whose HBM tier holds every row (hold_resident: the device step, which
    compiles and exports whole), its dense layers on ``device``."""
    import tierstore
    from tierstore.tools.demo import DLRM

    init = tierstore.RowInit.uniform(-0.05, 0.05, seed=seed)
    specs = [tierstore.TableSpec(n, cfg.rows, cfg.dim, init=init) for n in cfg.table_names]
    ebc = tierstore.TieredEmbeddingBagCollection(specs, path=path, hbm_rows=cfg.rows, device=device,
                                                 optimizer=tierstore.optim.Adagrad(lr=cfg.lr)).hold_resident()
    model = DLRM(ebc, cfg.table_names, cfg.dim, torch.Generator().manual_seed(seed + 1))
    model.bottom.to(device)
    model.top.to(device)
    model.pairs = model.pairs.to(device)
    return model


def _train(model, fwd, batches, lr: float, timer, cuda_graphs: bool = False):
    """Trains on every batch in turn; the losses and each step's seconds."""
    opt = torch.optim.Adagrad([*model.bottom.parameters(), *model.top.parameters()], lr=lr)
    losses = []

    def step(r):
        if cuda_graphs:  # a new iteration: the graphs' earlier outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        dense, sparse, labels = batches[r]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(fwd(dense, sparse), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())

    times = [timer(step, r) for r in range(len(batches))]
    return torch.stack(losses).cpu(), times


def _p50(times: list[float]) -> float:
    return statistics.median(times[UNTIMED:] or times) * 1e3


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
