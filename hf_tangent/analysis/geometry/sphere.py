"""Pure tensor functions on the unit sphere: projections, the zero score, tangent Jacobians and
their labels, batched Jacobians of row-wise maps, and the critical-direction search (docs/geometry.md)."""

from __future__ import annotations

import math

import torch

LABELS = ("attractor", "saddle", "repeller", "neutral")
EPS = 1e-12


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(EPS)


def project(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """P_u v = v - <u, v> u, rows of unit u."""
    return v - (u * v).sum(-1, keepdim=True) * u


def zero_score(field: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """||P_u F(u)|| / ||F(u)||, per row: 0 at a critical direction, 1 where F is tangent."""
    return project(field, u).norm(dim=-1) / field.norm(dim=-1).clamp_min(EPS)


def tangent_basis(u: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis (d, d-1) of the tangent space u^perp, in float64: the last d-1 columns of
    the Householder reflection that maps e_1 to u (closed form, no factorisation)."""
    u = unit(u.double().reshape(-1))
    w = u.clone()
    w[0] -= 1.0 if u[0] <= 0 else -1.0  # w = u -+ e_1, the sign that avoids cancellation
    h = torch.eye(len(u), dtype=u.dtype, device=u.device) - 2.0 * torch.outer(w, w) / torch.dot(w, w)
    return h[:, 1:]


def tangent_jacobian(jacobian: torch.Tensor, u: torch.Tensor, field: torch.Tensor) -> torch.Tensor:
    """Q^T (DF(u) - rho I) Q with rho = <u, F(u)>: the (d-1, d-1) linearisation of g = P_u F on T."""
    q = tangent_basis(u)
    u, field = unit(u.double().reshape(-1)), field.double().reshape(-1)
    rho = torch.dot(u, field)
    return q.T @ jacobian.double().to(q.device) @ q - rho * torch.eye(q.shape[1], dtype=torch.float64, device=q.device)


def spectrum(matrix: torch.Tensor) -> torch.Tensor:
    """torch.linalg.eigvals, or numpy's LAPACK where torch's fails to converge: the MKL in torch 2.13's
    CPU wheel gives up on some exact float64 spectra (a skew 3x3 with a zero eigenvalue, e.g.) that
    numpy's OpenBLAS solves."""
    try:
        return torch.linalg.eigvals(matrix)
    except torch.linalg.LinAlgError:
        return _numpy_eig(matrix, vectors=False)


def eigen(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.linalg.eig with the same fallback as `spectrum`."""
    try:
        return torch.linalg.eig(matrix)
    except torch.linalg.LinAlgError:
        return _numpy_eig(matrix, vectors=True)


def _numpy_eig(matrix: torch.Tensor, vectors: bool):
    import numpy as np

    complex_dtype = torch.complex128 if matrix.dtype in (torch.float64, torch.complex128) else torch.complex64
    array = matrix.detach().cpu().numpy()
    if not vectors:
        return torch.from_numpy(np.linalg.eigvals(array)).to(complex_dtype).to(matrix.device)
    values, vecs = np.linalg.eig(array)
    return (torch.from_numpy(values).to(complex_dtype).to(matrix.device),
            torch.from_numpy(vecs).to(complex_dtype).to(matrix.device))


def classify(eigenvalues: torch.Tensor, rel_tol: float = 1e-2) -> dict:
    """The local type from the real parts: a real part counts as zero when |Re| <= rel_tol * max|lambda|.
    attractor: none positive, some negative; repeller: the reverse; saddle: both signs; neutral: all
    near zero (rotational when complex pairs remain)."""
    ev = eigenvalues.to(torch.complex128)
    tol = rel_tol * ev.abs().max().item()
    real = ev.real
    pos, neg = int((real > tol).sum()), int((real < -tol).sum())
    label = ("saddle" if pos and neg else "attractor" if neg else "repeller" if pos else "neutral")
    return {"label": label, "positive": pos, "negative": neg, "near_zero": len(ev) - pos - neg,
            "complex_pairs": int((ev.imag.abs() > tol).sum()) // 2, "max_real": real.max().item(),
            "min_real": real.min().item(), "spectral_radius": ev.abs().max().item(), "tolerance": tol}


def classify_by_sign(eigenvalues: torch.Tensor, rounding: float) -> dict:
    """The local type from the signs of the real parts (float64): attractor (all negative), repeller
    (all positive), saddle (both), neutral (only zeros). `margin` = the smallest |Re lambda|; a type
    whose margin is at or below `rounding` (the eigenvalues' rounding level) is `flagged`, not changed."""
    ev = eigenvalues.to(torch.complex128)
    real = ev.real
    pos, neg = int((real > 0).sum()), int((real < 0).sum())
    label = "saddle" if pos and neg else "attractor" if neg else "repeller" if pos else "neutral"
    margin = real.abs().min().item()
    return {"label": label, "positive": pos, "negative": neg, "near_zero": len(ev) - pos - neg, "margin": margin,
            "rounding": rounding, "flagged": margin <= rounding, "complex_pairs": int((ev.imag.abs() > rounding).sum()) // 2,
            "max_real": real.max().item(), "min_real": real.min().item(), "spectral_radius": ev.abs().max().item()}


def effective_rank(singular_values: torch.Tensor) -> float:
    """exp of the entropy of the normalised singular values (Roy and Vetterli, 2007)."""
    s = singular_values.double().clamp_min(0)
    p = s / s.sum().clamp_min(EPS)
    return math.exp(-(p * p.clamp_min(EPS).log()).sum().item())


def batched_jacobian(fn, x: torch.Tensor) -> torch.Tensor:
    """Jacobians of a row-wise map fn: (N, d) -> (N, d) at the rows of x, as (N, d, d) with
    [n, i, j] = d fn(x_n)_i / d x_n,j; one backward pass over N * d copies (rows must not interact)."""
    n, d = x.shape
    copies = x.detach().repeat_interleave(d, dim=0).requires_grad_(True)  # (N d, d)
    with torch.enable_grad():
        out = fn(copies).reshape(n, d, d)
        select = torch.eye(d, dtype=out.dtype, device=out.device).expand(n, d, d)
        (grad,) = torch.autograd.grad((out * select).sum(), copies)
    return grad.reshape(n, d, d)


def refine_critical(field_fn, u: torch.Tensor, iterations: int = 5, damping: float = 1e-2) -> torch.Tensor:
    """Levenberg-Marquardt on g(u) = P_u F(u) in tangent coordinates: solve (J^T J + mu I) delta =
    -J^T Q^T F with J the tangent Jacobian, u <- unit(u + Q delta) when that lowers the row's zero
    score (then mu / 3), else mu * 10. Newton near a regular zero; on the real fields most minima of
    the score are not exact zeros, and the score falls only a little."""
    u = unit(u.detach().float())
    mu = torch.full((len(u),), damping, dtype=torch.float64)
    for _ in range(iterations):
        with torch.no_grad():
            values = field_fn(u)
            before = zero_score(values, u)
        jacobians = batched_jacobian(field_fn, u)
        steps = []
        for k in range(len(u)):
            q = tangent_basis(u[k]).to(jacobians.device)
            j = tangent_jacobian(jacobians[k], u[k], values[k]).to(jacobians.device)
            normal = j.T @ j
            normal += mu[k] * normal.diagonal().mean() * torch.eye(len(normal), dtype=normal.dtype, device=normal.device)
            steps.append((q @ torch.linalg.solve(normal, -(j.T @ (q.T @ values[k].double())))).float())
        moved = unit(u + torch.stack(steps))
        with torch.no_grad():
            better = zero_score(field_fn(moved), moved) < before
        u = torch.where(better[:, None], moved, u)
        mu = torch.where(better.cpu(), mu / 3, mu * 10)
    return u


BASIN = 1e-4  # a zero score this low at max_iter: inside a regular root's basin (Newton's quadratic phase)
OUTCOMES = ("converged", "stalled", "unfinished")


def newton_roots(field_fn, u: torch.Tensor, *, tol: float = 1e-8, max_iter: int = 40, damping: float = 1e-6,
                 basin: float = BASIN):
    """Roots of g(u) = P_u F(u) on the sphere, refined to convergence: Levenberg-Marquardt on the
    augmented system F(u) - rho u = 0, (|u|^2 - 1) / 2 = 0 in (u, rho) (Newton's method for a
    nonlinear eigenproblem; quadratic near a regular root), in the dtype of `field_fn` (float64 for
    the roots the report counts). A row converges when its zero score ||P_u F|| / ||F|| < tol; it
    stalls when the damped step stops lowering the residual (mu grows past 1e8); it is unfinished when
    it used max_iter steps, except that a row already below `basin` then (about to converge: a cap must
    not decide whether a root is counted) goes on for up to 4 x max_iter.
    Returns (u, scores, outcome per row: 0 converged, 1 stalled, 2 unfinished (OUTCOMES), iterations per row)."""
    u = unit(u.detach())
    n, d = u.shape
    with torch.no_grad():
        values = field_fn(u)
    rho = (u * values).sum(-1)
    mu = torch.full((n,), damping, dtype=u.dtype, device=u.device)
    iterations = torch.zeros(n, dtype=torch.long)
    eye = torch.eye(d + 1, dtype=u.dtype, device=u.device)

    def residual(v, f, r):
        return torch.cat([f - r[:, None] * v, ((v * v).sum(-1, keepdim=True) - 1) / 2], dim=1)  # (n, d + 1)

    for step_index in range(4 * max_iter):
        scores = zero_score(values, u)
        active = (scores >= tol) & (mu < 1e8) & ((step_index < max_iter) | (scores < basin))
        if not active.any():
            break
        rows = active.nonzero().flatten()
        jac = batched_jacobian(field_fn, u[rows])  # (k, d, d)
        k = len(rows)
        big = torch.zeros(k, d + 1, d + 1, dtype=u.dtype, device=u.device)
        big[:, :d, :d] = jac - rho[rows, None, None] * torch.eye(d, dtype=u.dtype, device=u.device)
        big[:, :d, d] = -u[rows]
        big[:, d, :d] = u[rows]
        res = residual(u[rows], values[rows], rho[rows])
        normal = big.transpose(1, 2) @ big
        scale = normal.diagonal(dim1=1, dim2=2).mean(-1)
        damped, rhs = normal + (mu[rows] * scale)[:, None, None] * eye, -(big.transpose(1, 2) @ res[..., None])
        # one system at a time: MKL's batched LU fails on some batches of these (DLASWP parameter errors)
        solutions = [torch.linalg.solve_ex(damped[i], rhs[i]) for i in range(k)]
        step = torch.stack([x for x, _ in solutions])
        solved = torch.stack([info == 0 for _, info in solutions]) & torch.isfinite(step).all(dim=1).flatten()
        step = torch.where(solved[:, None, None], step, torch.zeros_like(step))
        moved = unit(u[rows] + step[:, :d, 0])
        new_rho = rho[rows] + step[:, d, 0]
        with torch.no_grad():
            new_values = field_fn(moved)
        better = solved & (residual(moved, new_values, new_rho).norm(dim=-1) < res.norm(dim=-1))
        idx = rows[better]
        u[idx], values[idx], rho[idx] = moved[better], new_values[better], new_rho[better]
        mu[rows] = torch.where(better, (mu[rows] / 10).clamp_min(1e-12), mu[rows] * 10)
        iterations[rows.cpu()] += 1
    scores = zero_score(values, u)
    outcome = torch.where(scores < tol, 0, torch.where(mu >= 1e8, 1, 2))
    return u, scores, outcome, iterations


def distinct_roots(u: torch.Tensor, scores: torch.Tensor, *, odd: bool, angle_tol: float = 1e-6) -> list[int]:
    """Rows that are distinct roots, best score first: a row within 1 - cos < angle_tol of a kept one
    is the same root (with |cos| for an odd field, where u and -u are one critical line)."""
    kept: list[int] = []
    for i in sorted(range(len(u)), key=lambda i: scores[i].item()):
        cos = [torch.dot(u[i], u[j]).item() for j in kept]
        if all(1 - (abs(c) if odd else c) >= angle_tol for c in cos):
            kept.append(i)
    return kept


def is_odd(field_fn, d: int, *, samples: int = 4, seed: int = 0, dtype=torch.float64, device="cpu") -> bool:
    """F(-u) = -F(u) on random unit directions, to the rounding of `dtype`."""
    u = unit(torch.randn(samples, d, generator=torch.Generator().manual_seed(seed), dtype=dtype).to(device))
    with torch.no_grad():
        plus, minus = field_fn(u), field_fn(-u)
    return bool(((plus + minus).norm(dim=-1) <= 1e3 * torch.finfo(dtype).eps * plus.norm(dim=-1)).all())


def linear_map(field_fn, d: int, *, samples: int = 4, seed: int = 0, dtype=torch.float64, device="cpu"):
    """(M, relative residual): M's columns are F(e_i), and the residual max ||F(u) - M u|| / ||F(u)|| over
    random unit u says whether F is linear on the sphere (F(u) = M u; the OV field of a model whose
    input norm has no mean subtraction and no bias: RMSNorm scales every unit vector alike)."""
    eye = torch.eye(d, dtype=dtype, device=device)
    with torch.no_grad():
        matrix = field_fn(eye).T  # (d, d): column i = F(e_i)
        u = unit(torch.randn(samples, d, generator=torch.Generator().manual_seed(seed), dtype=dtype).to(device))
        values = field_fn(u)
    residual = ((values - u @ matrix.T).norm(dim=-1) / values.norm(dim=-1).clamp_min(EPS)).max().item()
    return matrix, residual


def linear_critical(matrix: torch.Tensor, *, rel_tol: float = 1e-9) -> dict:
    """The exact critical set of F(u) = M u on the sphere: P_u M u = 0 <=> M u = rho u, so the critical
    directions are the real eigenvectors of M (rho = the eigenvalue), and the tangent Jacobian at the
    k-th is conjugate to M - lambda_k I on R^d / span(u_k): its spectrum is {lambda_j - lambda_k}, j != k.
    Eigenvalues closer than rel_tol x the spectral radius count as one: a real eigenvalue of
    multiplicity m > 1 (0 included: the kernel, where F = 0) gives a degenerate set (the unit sphere
    of its m-dimensional eigenspace), reported with its dimension, not as points. Returns
    {"directions": (k, d), "eigenvalues": (d,) complex, "isolated": [...], "degenerate": [...], "rank"}."""
    m = matrix.double()
    values, vectors = eigen(m)
    radius = values.abs().max().item()
    tol = rel_tol * max(radius, EPS)
    real = values.imag.abs() <= tol
    isolated, degenerate, directions = [], [], []
    for k in torch.argsort(values.real, descending=True).tolist():
        if not real[k]:
            continue
        close = ((values - values[k]).abs() <= tol).nonzero().flatten().tolist()
        if len(close) > 1:
            if k == min(close):
                degenerate.append({"eigenvalue": values[k].real.item(), "dimension": len(close),
                                   "kernel": abs(values[k].real.item()) <= tol})
            continue
        if abs(values[k].real.item()) <= tol:  # a simple zero eigenvalue: F(u) = 0 at +-u, a zero of F
            degenerate.append({"eigenvalue": 0.0, "dimension": 1, "kernel": True})
            continue
        v = unit(vectors[:, k].real)
        spectrum = torch.cat([values[:k], values[k + 1:]]) - values[k]
        isolated.append({"rho": values[k].real.item(), "spectrum": spectrum, **classify_by_sign(spectrum, tol)})
        directions.append(v)
    rank = int((torch.linalg.svdvals(m) > tol).sum())
    return {"directions": torch.stack(directions) if directions else m.new_zeros(0, m.shape[0]),
            "eigenvalues": values, "isolated": isolated, "degenerate": degenerate, "rank": rank, "tolerance": tol}


def _merge(u: torch.Tensor, scores: torch.Tensor, rows: list[int], merge_cos: float) -> list[int]:
    """Rows in order of score, dropping any within merge_cos of a kept one."""
    kept: list[int] = []
    for i in sorted(rows, key=lambda i: scores[i].item()):
        if all(torch.dot(u[i], u[j]).item() < merge_cos for j in kept):
            kept.append(i)
    return kept


def descend(field_fn, starts: torch.Tensor, *, steps: int = 300, lr: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Adam on x, u = x / ||x||, minimising the squared zero score from every start (rows of `starts`),
    cosine-decayed lr; returns the final unit rows and their zero scores. Rows do not interact."""
    x = unit(starts.detach().float()).clone().requires_grad_(True)
    optimizer = torch.optim.Adam([x], lr=lr)
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        with torch.enable_grad():
            u = unit(x)
            loss = zero_score(field_fn(u), u).pow(2).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        u = unit(x.detach())
        return u, zero_score(field_fn(u), u)


def find_critical(field_fn, starts: torch.Tensor, *, steps: int = 300, lr: float = 0.05, threshold: float = 0.05,
                  refine: int = 3, max_refined: int = 8, merge_cos: float = 0.99) -> dict:
    """The paper's protocol (thresholded near-invariant directions, `--protocol paper`): `descend` from
    every start; then Levenberg-Marquardt (`refine` iterations) on the distinct best `max_refined` rows
    scoring below 4 * threshold; candidates: the rows below `threshold` (converged starts), merged when
    their cosine exceeds merge_cos. A candidate is not a root: see `newton_roots` for those."""
    u, scores = descend(field_fn, starts, steps=steps, lr=lr)
    near = _merge(u, scores, (scores < 4 * threshold).nonzero().flatten().tolist(), merge_cos)[:max_refined]
    if refine and near:
        u[near] = refine_critical(field_fn, u[near], refine)
        with torch.no_grad():
            scores[near] = zero_score(field_fn(u[near]), u[near])
    converged = (scores < threshold).nonzero().flatten().tolist()
    kept = _merge(u, scores, converged, merge_cos)
    return {"directions": u[kept], "scores": scores[kept], "start_scores": scores, "refined": len(near),
            "converged": len(converged), "starts": len(starts)}


def analyse_critical(field_fn, u: torch.Tensor, rel_tol: float = 1e-2) -> list[dict]:
    """Per critical direction (rows of u): rho, the tangent Jacobian's eigenvalues and their label."""
    if len(u) == 0:
        return []
    with torch.no_grad():
        values = field_fn(u)
    jacobians = batched_jacobian(field_fn, u)
    out = []
    for k in range(len(u)):
        j = tangent_jacobian(jacobians[k], u[k], values[k])
        eig = spectrum(j)
        out.append({"rho": torch.dot(u[k].double(), values[k].double()).item(), "eigenvalues": eig,
                    "jacobian": j, **classify(eig, rel_tol)})
    return out
