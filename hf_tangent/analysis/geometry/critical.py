"""Critical directions of a layer's reduced fields (docs/geometry.md section 1).

Two protocols:

    refined (default)  a critical direction is a root of g(u) = P_u F(u), refined to convergence in
                       float64 (zero score < `tol`); the roots are counted, deduplicated by angle
                       (u and -u are one line for an odd field), typed by the signs of their tangent
                       spectra. A field that is linear on the sphere (the OV field of an RMSNorm model
                       without biases: F(u) = M u) is solved exactly: its critical directions are the
                       real eigenvectors of M, and the search is run as a check that it finds them.
    paper              the paper's thresholded near-invariant directions (zero score < threshold after
                       the search), kept so that Table 2 can be compared like for like; not roots.

Fields are evaluated on a float64 copy of the layer (LayerFields(dtype=float64)); the search's
descent runs in the model's dtype.
"""

from __future__ import annotations

import torch

from .fields import LayerFields
from .sphere import (
    LABELS,
    analyse_critical,
    batched_jacobian,
    classify_by_sign,
    descend,
    distinct_roots,
    eigen,
    find_critical,
    is_odd,
    linear_critical,
    linear_map,
    newton_roots,
    spectrum,
    tangent_jacobian,
    zero_score,
)

FIELDS = ("attention", "ffn", "full")
PROTOCOLS = ("refined", "paper")
LINEAR_RESIDUAL = 1e-10  # F(u) = M u to float64 rounding: the field is linear on the sphere
MERGE_BEFORE_REFINING = 0.999  # starts that descended to within this cosine of each other are refined once


def critical_directions(model, index: int, token_starts: torch.Tensor, *, random_starts: int = 32, fields=FIELDS,
                        steps: int = 300, lr: float = 0.05, threshold: float = 0.05, protocol: str = "refined",
                        tol: float = 1e-8, max_iter: int = 20, rel_tol: float = 1e-2, seed: int = 0) -> dict:
    """The critical directions of each reduced field of layer `index` (module docstring): per field,
    the path taken, the search's counts (starts, below `threshold`, refined, converged, stalled, unfinished), the
    distinct roots with their rho, tangent-spectrum type and margin, degenerate sets, and the roots as
    unit rows (`directions`, float32, in the order of `roots`). With protocol="paper", the paper's
    thresholded candidates instead (labels with `rel_tol`, as before: not roots)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r}; accepted: {', '.join(PROTOCOLS)}.")
    low = LayerFields(model, index)
    d = low.param.shape[-1] if token_starts.numel() == 0 else token_starts.shape[-1]
    g = torch.Generator().manual_seed(seed * 1000 + index)
    starts = torch.cat([torch.randn(random_starts, d, generator=g), token_starts.float().cpu()]).to(low.param.device)
    if protocol == "paper":
        return {"layer": index, "protocol": "paper", "fields": {name: _paper(low, name, starts, steps, lr, threshold, rel_tol)
                                                               for name in fields}}
    high = LayerFields(model, index, dtype=torch.float64)
    matrix, residual = linear_map(high.attention, d, device=low.param.device)
    linear = residual < LINEAR_RESIDUAL
    exact = linear_critical(matrix) if linear else None
    functions = _functions(low, high, matrix if linear else None)
    out = {"layer": index, "protocol": "refined", "ov_linear_residual": residual, "fields": {}}
    for name in fields:
        found = _search(functions[name], starts, steps=steps, lr=lr, threshold=threshold, tol=tol, max_iter=max_iter, d=d)
        if name == "attention" and linear:
            found["check"] = _agreement(found, exact)
            found |= _exact_roots(exact)
        out["fields"][name] = found
    if "attention" in fields:
        out["common"] = _common(functions, out["fields"], exact, matrix if linear else None, tol)
    if linear:
        out["ov_structure"] = {"rank": exact["rank"], "kernel_dimension": d - exact["rank"], "dimension": d,
                               "real_eigenvalues": int((exact["eigenvalues"].imag.abs() <= exact["tolerance"]).sum()),
                               "isolated_roots": len(exact["isolated"]), "degenerate": exact["degenerate"]}
    return out


def _functions(low: LayerFields, high: LayerFields, matrix: torch.Tensor | None) -> dict:
    """(descent field in the model's dtype, float64 field) per name. Where the OV field is linear on
    the sphere it is evaluated as u M^T (equal to the layer's replay to float64 rounding, checked by
    linear_map), which makes the full field's Jacobian as cheap as the FFN's."""
    if matrix is None:
        return {name: (low.field(name), high.field(name)) for name in FIELDS}
    m64, m32 = matrix.double(), matrix.float()
    return {"attention": (lambda u: u @ m32.T, lambda u: u @ m64.T), "ffn": (low.ffn, high.ffn),
            "full": (lambda u: u @ m32.T + low.ffn(u), lambda u: u @ m64.T + high.ffn(u))}


def _search(functions, starts, *, steps, lr, threshold, tol, max_iter, d) -> dict:
    """Descent from every start; every row below `threshold` (near-duplicates merged first, counted)
    refined by Newton / Levenberg-Marquardt in float64 to a zero score < tol, or stalled, or unfinished
    (max_iter steps used while still above sphere.BASIN)."""
    low, high = functions
    u, scores = descend(low, starts, steps=steps, lr=lr)
    below = (scores < threshold).nonzero().flatten().tolist()
    odd = is_odd(high, d, device=u.device)
    merged = distinct_roots(u[below].double(), scores[below].double(), odd=odd, angle_tol=1 - MERGE_BEFORE_REFINING) \
        if below else []
    rows = [below[i] for i in merged]
    out = {"path": "search", "odd": odd, "starts": len(starts), "below_threshold": len(below),
           "merged_before_refining": len(below) - len(rows), "refined": len(rows), "near_invariant": len(rows)}
    if not rows:
        return out | {"converged": 0, "stalled": 0, "unfinished": 0, "roots": [], "directions": torch.zeros(0, d)}
    refined, final, outcome, iterations = newton_roots(high, u[rows].double(), tol=tol, max_iter=max_iter)
    converged = outcome == 0
    keep = converged.nonzero().flatten()
    distinct = [keep[i].item() for i in distinct_roots(refined[keep], final[keep], odd=odd)] if len(keep) else []
    roots = [_root(high, refined[i], final[i].item()) for i in distinct]
    return out | {"converged": int(converged.sum()), "stalled": int((outcome == 1).sum()),
                  "unfinished": int((outcome == 2).sum()), "stalled_scores": sorted(final[outcome == 1].tolist()),
                  "unfinished_scores": sorted(final[outcome == 2].tolist()), "iterations": iterations.tolist(),
                  "roots": roots, "directions": refined[distinct].float().cpu() if distinct else torch.zeros(0, d)}


def _root(field, u: torch.Tensor, score: float) -> dict:
    """rho, the tangent spectrum (float64) and its type by sign, at a root u."""
    with torch.no_grad():
        value = field(u[None])[0]
    jacobian = tangent_jacobian(batched_jacobian(field, u[None])[0], u, value)
    eigenvalues = spectrum(jacobian)
    rounding = len(u) * torch.finfo(torch.float64).eps * torch.linalg.matrix_norm(jacobian, ord=2).item()
    kind = classify_by_sign(eigenvalues, rounding)
    return {"score": score, "rho": torch.dot(u, value).item(), **kind,
            "unstable_share": kind["positive"] / len(eigenvalues), "eigenvalues": _sample(eigenvalues)}


def _exact_roots(exact: dict) -> dict:
    """The OV field's critical set from the eigen-decomposition of M (sphere.linear_critical)."""
    roots = [{"score": 0.0, "rho": r["rho"], **{k: v for k, v in r.items() if k not in ("rho", "spectrum")},
              "unstable_share": r["positive"] / len(r["spectrum"]), "eigenvalues": _sample(r["spectrum"])}
             for r in exact["isolated"]]
    return {"path": "exact (linear on the sphere: F(u) = M u)", "odd": True, "roots": roots,
            "directions": exact["directions"].float().cpu(), "degenerate": exact["degenerate"]}


def _agreement(found: dict, exact: dict) -> dict:
    """How the search's converged roots sit against the exact ones: each matched within 1 - |cos| < 1e-6."""
    searched, truth = found["directions"].double(), exact["directions"].double()
    if not len(searched) or not len(truth):
        return {"search_roots": len(searched), "matched": 0, "exact_found": 0, "exact": len(truth)}
    cos = (searched @ truth.T).abs()
    matched = (1 - cos.max(dim=1).values < 1e-6)
    return {"search_roots": len(searched), "matched": int(matched.sum()), "exact": len(truth),
            "exact_found": int((1 - cos.max(dim=0).values < 1e-6).sum()),
            "max_distance": (1 - cos.max(dim=1).values).max().item()}


def _common(functions, found: dict, exact: dict | None, matrix: torch.Tensor | None, tol: float) -> dict:
    """Common critical directions of F_A and F_Phi (where the paper's eigenvalue law
    lambda = lambda_A + lambda_Phi can be tested): every root of F_A is an eigenvector of M, so a common
    direction is an OV root at which the FFN's zero score vanishes, or an FFN root in the kernel of M
    (F_A = 0 there). Reports the best FFN score over the OV roots and the smallest ||M u|| / ||M||
    over the FFN roots, and the law at every common direction found."""
    ffn = functions["ffn"][1]
    ffn_roots = found["ffn"]["directions"] if "ffn" in found else torch.zeros(0)
    out = {"ov_roots_checked": 0, "ffn_roots_checked": len(ffn_roots), "common": []}
    if exact is not None and len(exact["directions"]):
        directions = exact["directions"].double().to(matrix.device)
        with torch.no_grad():
            scores = zero_score(ffn(directions), directions)
        out |= {"ov_roots_checked": len(directions), "best_ffn_score_at_ov_roots": scores.min().item()}
        out["common"] += [directions[i] for i in (scores < tol).nonzero().flatten().tolist()]
    if matrix is not None and len(ffn_roots):
        u = ffn_roots.double().to(matrix.device)
        ratio = (u @ matrix.double().T).norm(dim=-1) / torch.linalg.matrix_norm(matrix.double(), ord=2)
        out["smallest_ov_response_at_ffn_roots"] = ratio.min().item()
        out["common"] += [u[i] for i in (ratio < tol).nonzero().flatten().tolist()]
    out["law"] = [_law(functions, u) for u in out["common"]]
    out["common"] = len(out["common"])
    return out


def _law(functions, u: torch.Tensor) -> dict:
    """At a common direction: J = J_A + J_Phi holds by construction; the paper's law says the
    eigenvalues add. Measured: how far J_A's eigenvectors are from diagonalising J_Phi (relative
    off-diagonal norm) and the largest gap between J's eigenvalues and lambda_A + lambda_Phi paired
    through J_A's eigenvectors."""
    parts = {}
    for name in ("attention", "ffn"):
        field = functions[name][1]
        with torch.no_grad():
            value = field(u[None])[0]
        parts[name] = tangent_jacobian(batched_jacobian(field, u[None])[0], u, value).to(torch.complex128)
    values, vectors = eigen(parts["attention"])
    rotated = torch.linalg.solve(vectors, parts["ffn"] @ vectors)
    diagonal = torch.diagonal(rotated)
    off = (rotated - torch.diag(diagonal)).norm() / rotated.norm()
    predicted = values + diagonal
    actual = spectrum(parts["attention"] + parts["ffn"])
    gap = max(((actual - p).abs().min().item() for p in predicted), default=0.0)
    return {"offdiagonal": off.item(), "largest_gap": gap, "spectral_radius": actual.abs().max().item()}


def _paper(low: LayerFields, name: str, starts, steps, lr, threshold, rel_tol) -> dict:
    """The paper's protocol: thresholded candidates, labels with a relative tolerance (not roots)."""
    fn = low.field(name)
    found = find_critical(fn, starts, steps=steps, lr=lr, threshold=threshold)
    candidates = analyse_critical(fn, found["directions"], rel_tol)
    return {"path": "paper protocol (thresholded)", "starts": found["starts"], "converged": found["converged"],
            "roots": [{"score": found["scores"][k].item(), **{key: v for key, v in c.items() if key not in ("jacobian",)},
                       "unstable_share": c["positive"] / len(c["eigenvalues"]), "eigenvalues": _sample(c["eigenvalues"])}
                      for k, c in enumerate(candidates)],
            "directions": found["directions"].float().cpu()}


def _sample(eigenvalues: torch.Tensor, n: int = 96) -> list[list[float]]:
    """At most n eigenvalues [re, im], evenly spaced in the order of the real part (extremes kept)."""
    ordered = sorted(([z.real, z.imag] for z in eigenvalues.to(torch.complex128).tolist()), key=lambda z: (z[0], z[1]))
    if len(ordered) > n:
        ordered = [ordered[round(k * (len(ordered) - 1) / (n - 1))] for k in range(n)]
    return [[round(a, 6), round(b, 6)] for a, b in ordered]


def label_counts(roots: list[dict]) -> dict:
    counts = {label: 0 for label in LABELS}
    for r in roots:
        counts[r["label"]] += 1
    return counts
