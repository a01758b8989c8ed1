"""Per-token FFN Jacobian on the tangent space, activation gain, and the keys/values view of the MLP."""

from __future__ import annotations

import torch
from torch import nn

from ...core.discovery import architecture, ffn_branch
from .sphere import EPS, batched_jacobian, effective_rank, project, tangent_basis, unit


def _activation(mlp: nn.Module) -> nn.Module:
    for name in ("act_fn", "act", "activation_fn", "activation", "act_func"):
        module = getattr(mlp, name, None)
        if isinstance(module, nn.Module):
            return module
    raise ValueError(f"ffn jacobian: {type(mlp).__name__} has no activation module (act_fn, act, activation_fn); "
                     "the gain and keys/values views need one.")


def _down_projection(mlp: nn.Module, x: torch.Tensor) -> nn.Module:
    """The last Linear / Conv1D called inside the MLP: the value matrix of the keys/values view."""
    calls = []
    handles = [m.register_forward_hook(lambda mod, a, o: calls.append(mod)) for m in mlp.modules()
               if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"]
    try:
        with torch.no_grad():
            mlp(x)
    finally:
        for h in handles:
            h.remove()
    if not calls:
        raise ValueError(f"ffn jacobian: no Linear or Conv1D inside {type(mlp).__name__}.")
    return calls[-1]


def value_matrix(projection: nn.Module) -> torch.Tensor:
    """(d, m): column j is hidden unit j's value vector."""
    return projection.weight.T if type(projection).__name__ == "Conv1D" else projection.weight


class FfnProbe:
    """Per-token FFN Jacobian, activation gain and value-row shares of one layer."""

    def __init__(self, model, index: int):
        spec, decoder = architecture(model)
        layer = decoder[index]
        self.index, self.branch, self.scale = index, ffn_branch(spec, layer), spec.scale(layer)
        self.norm, self.mlp = spec.submodule(layer, "ffn_norm"), spec.submodule(layer, "mlp")
        self.dtype = next(model.parameters()).dtype
        self.activation = _activation(self.mlp)
        width = model.get_input_embeddings().weight.shape[-1]
        device = next(model.parameters()).device
        self.down = _down_projection(self.mlp, self.norm(torch.ones(1, width, dtype=self.dtype, device=device)))

    def phi(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.branch(x.to(self.dtype)).float()

    def measure(self, x: torch.Tensor, top_k: int = 8) -> dict[str, torch.Tensor]:
        """x: (n, d) FFN inputs. Per token: spectral norm and effective rank of r P_u DPhi P_u (the
        FFN's response to a rotation of x, per radian), its radial fraction ||u u^T DPhi P_u||_F^2 /
        ||DPhi P_u||_F^2; the activation derivatives; the top-k units' share of P_u y."""
        x = x.float()
        r = x.norm(dim=-1)
        u = unit(x)
        jac = batched_jacobian(self.phi, x).double()  # (n, d, d)
        out = {"spectral_norm": [], "effective_rank": [], "radial_fraction": []}
        with torch.no_grad():
            out["output_norm"] = self.phi(x).norm(dim=-1).tolist()
        for k in range(len(x)):
            q = tangent_basis(u[k])
            on_tangent = jac[k] @ q  # DPhi P_u, in the basis of T
            tangential = q.T @ on_tangent * r[k].double()
            s = torch.linalg.svdvals(tangential)
            out["spectral_norm"].append(s[0].item())
            out["effective_rank"].append(effective_rank(s))
            radial = (u[k].double() @ on_tangent).pow(2).sum()
            out["radial_fraction"].append((radial / on_tangent.pow(2).sum().clamp_min(EPS)).item())
        seen = {}
        handles = [self.activation.register_forward_pre_hook(lambda m, a: seen.__setitem__("z", a[0])),
                   self.down.register_forward_pre_hook(lambda m, a: seen.__setitem__("a", a[0]))]
        try:
            with torch.no_grad():
                y = self.mlp(self.norm(x.to(self.dtype))).float()
        finally:
            for h in handles:
                h.remove()
        z = seen["z"].detach().float().requires_grad_(True)
        with torch.enable_grad():
            (gain,) = torch.autograd.grad(self.activation(z).sum(), z)
        hidden = seen["a"].float()  # (n, m)
        values = value_matrix(self.down).float()  # (d, m)
        tangent_y = project(y, u)
        # share of unit j in P_u y: a_j <P_u v_j, P_u y> / ||P_u y||^2 = a_j <v_j, P_u y> / ||P_u y||^2
        shares = hidden * (tangent_y @ values) / tangent_y.pow(2).sum(-1, keepdim=True).clamp_min(EPS)
        top = shares.topk(top_k, dim=-1)
        return {k: torch.tensor(v) for k, v in out.items()} | {
            "gain": gain.detach(), "top_units": top.indices, "top_share": top.values.sum(-1).detach()}


GAIN_REGIMES = {"off": "|sigma'(z)| < 0.1", "linear": "|sigma'(z) - 1| < 0.1", "transition": "otherwise"}


def gain_regimes(gain: torch.Tensor) -> dict[str, float]:
    off = gain.abs() < 0.1
    linear = (gain - 1).abs() < 0.1
    n = gain.numel()
    return {"off": off.sum().item() / n, "linear": linear.sum().item() / n,
            "transition": (~off & ~linear).sum().item() / n}
