"""The training-time stochastic updates of docs/math.md section 3 (tangent_noise, gaussian_noise,
residual_dropout) as plain tensor ops: random per call in training mode, exactly alpha * y in eval mode."""

from __future__ import annotations

import math

import torch

from .fused import dot


def noise_delta(x: torch.Tensor, y: torch.Tensor, update: str, *, alpha: float = 1.0, gamma: float = 0.0,
                h: float = 0.1, rank: int = 4, training: bool = True, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Training-time stochastic updates (math.md section 3), x_next - x in y's dtype.

    Deterministic part alpha * y (the model's own add). In training mode, with r = ||x||, u = x / r:
      tangent_noise:    + r (h p + gamma sqrt(h) q),  p = A u - u <u, A u>, q = z - u <u, z>,
                        A = U U^T + V V^T with U, V in R^(d x rank) ~ N(0, 1/d), drawn per call (shared by
                        all tokens), z ~ N(0, I) per token: drift and noise tangent to the sphere at u
      gaussian_noise:   + gamma sqrt(h) r sqrt((d-1)/d) z, isotropic: the same expected energy as q's
      residual_dropout: y dropped per coordinate at a per-token rate p_i with p_i / (1 - p_i) =
                        gamma^2 h r^2 (d-1) / ||y||^2: the same expected noise energy again
    The residual is not renormalised (the next layer's norm does that in a pre-norm transformer).
    In eval mode every one of them is exactly alpha * y: no noise at evaluation.
    """
    dtype = torch.promote_types(y.dtype, torch.float32)
    xf, yf = x.to(dtype), y.to(dtype)
    if gate is not None:
        yf = yf * gate.to(dtype)
    if not training or gamma == 0.0 and update != "tangent_noise":
        return (alpha * yf).to(y.dtype)
    d = xf.shape[-1]
    r = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)  # (..., 1)
    u = xf / (r + 1e-12)
    energy = gamma * gamma * h * (d - 1)  # expected ||noise||^2 / r^2
    if update == "tangent_noise":
        U = torch.randn(d, rank, dtype=dtype, device=x.device) / math.sqrt(d)
        V = torch.randn(d, rank, dtype=dtype, device=x.device) / math.sqrt(d)
        au = (u @ U) @ U.T + (u @ V) @ V.T  # (..., d)
        p = au - u * dot(u, au)
        z = torch.randn_like(xf)
        q = z - u * dot(u, z)
        delta = alpha * yf + r * (h * p + gamma * math.sqrt(h) * q)
    elif update == "gaussian_noise":
        delta = alpha * yf + gamma * math.sqrt(h) * math.sqrt((d - 1) / d) * r * torch.randn_like(xf)
    elif update == "residual_dropout":
        k = energy * r * r / (dot(yf, yf) + 1e-12)
        keep = (1.0 / (1.0 + k)).clamp(min=0.1)  # 1 - p_i, capped at p = 0.9
        mask = torch.rand_like(yf) < keep
        delta = alpha * yf * mask / keep
    else:
        raise ValueError(f"unknown noise update {update!r}")
    return delta.to(y.dtype)
