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
    """An orthonormal basis (d, d-1) of the tangent space u^perp, in float64."""
    u = unit(u.double().reshape(-1))
    q, _ = torch.linalg.qr(torch.cat([u[:, None], torch.eye(len(u), dtype=u.dtype)], dim=1))
    return q[:, 1:]


def tangent_jacobian(jacobian: torch.Tensor, u: torch.Tensor, field: torch.Tensor) -> torch.Tensor:
    """Q^T (DF(u) - rho I) Q with rho = <u, F(u)>: the (d-1, d-1) linearisation of g = P_u F on T."""
    q = tangent_basis(u)
    u, field = unit(u.double().reshape(-1)), field.double().reshape(-1)
    rho = torch.dot(u, field)
    return q.T @ jacobian.double() @ q - rho * torch.eye(q.shape[1], dtype=torch.float64)


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


def _merge(u: torch.Tensor, scores: torch.Tensor, rows: list[int], merge_cos: float) -> list[int]:
    """Rows in order of score, dropping any within merge_cos of a kept one."""
    kept: list[int] = []
    for i in sorted(rows, key=lambda i: scores[i].item()):
        if all(torch.dot(u[i], u[j]).item() < merge_cos for j in kept):
            kept.append(i)
    return kept


def find_critical(field_fn, starts: torch.Tensor, *, steps: int = 300, lr: float = 0.05, threshold: float = 0.05,
                  refine: int = 3, max_refined: int = 8, merge_cos: float = 0.99) -> dict:
    """Minimise the squared zero score from every start (rows of `starts`) on the sphere (Adam on
    x, u = x / ||x||, cosine-decayed lr); then Levenberg-Marquardt (`refine` iterations) on the distinct
    best `max_refined` rows scoring below 4 * threshold; candidates: the rows below `threshold`
    (converged starts), merged when their cosine exceeds merge_cos."""
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
        scores = zero_score(field_fn(u), u)
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
        eig = torch.linalg.eigvals(j)
        out.append({"rho": torch.dot(u[k].double(), values[k].double()).item(), "eigenvalues": eig,
                    "jacobian": j, **classify(eig, rel_tol)})
    return out
