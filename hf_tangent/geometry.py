"""Residual geometry on the sphere: reduced fields and their critical directions, attention pressure,
FFN Jacobians (docs/geometry.md; arXiv 2608.02071 section on critical directions, math.md 1 and 4).

Reduced fields of one layer, on unit directions u (rows of an (N, d) tensor):
    F_A(u)   attention output when every token of the sequence sits at u: softmax weights sum to
             one over identical values, so it is O V N_1(u) (+ biases) -- computed exactly by
             running the layer on N one-token sequences and reading its attention output
    F_Phi(u) = s * Phi(N_2(u)), the FFN branch at u (s: the layer's residual multiplier, 1 in most)
    F(u)     = F_A(u) + F_Phi(u), the additive (parallel) composition: it does not depend on the
             residual norm r, which the sequential composition Phi(N_2(r u + A)) does (r grows
             from ~4 to ~800 through SmolLM2), and it makes J = J_A + J_Phi exact.
    g = P_u F, the field on the sphere;  rho = <u, F(u)>;  zero score ||g(u)|| / ||F(u)||.
At a critical direction (g = 0) the tangent Jacobian J = P_u (DF(u) - rho I)|_T, written in an
orthonormal basis Q of T = u^perp as Q^T (DF - rho I) Q, linearises the direction dynamics.

Everything here is measured on the unpatched model, in float32 with eigenvalues in float64.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn

from .diagnostics import record
from .patching import get_config
from .registry import architecture

FIELDS = ("attention", "ffn", "full")
LABELS = ("attractor", "saddle", "repeller", "neutral")
EPS = 1e-12
ZERO_FACTOR = 1e-9  # attention_pressure's stand-in for 0


# ---------------------------------------------------------------------------------------------
# Pure tensor functions
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# The reduced fields of a real layer
# ---------------------------------------------------------------------------------------------

def _first(output):
    return output[0] if isinstance(output, tuple) else output


class LayerFields:
    """F_A, F_Phi and F of decoder layer `index` of an unpatched model, as row-wise maps (N, d) -> (N, d)."""

    def __init__(self, model, index: int):
        if get_config(model) is not None:
            raise ValueError("geometry: measure the reduced fields on the unpatched model (hf_tangent.unpatch first).")
        self.model = model
        self.spec, decoder = architecture(model)
        if not 0 <= index < len(decoder):
            raise ValueError(f"geometry: layer {index} out of range; accepted: 0..{len(decoder) - 1}.")
        self.index, self.layer = index, decoder[index]
        self.attention_out = self.spec.submodule(self.layer, "attention_out")
        self.ffn_branch = self.spec.ffn_branch(self.layer)
        self.scale = self.spec.scale(self.layer)
        self.param = next(model.parameters())
        self._args, self._kwargs = self._layer_call()

    def _layer_call(self):
        """The layer's arguments in a one-token forward (position embeddings, masks), to replay."""
        seen = {}

        def grab(module, args, kwargs):
            seen["args"], seen["kwargs"] = args, kwargs
            raise _Captured

        handle = self.layer.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            with torch.no_grad():
                self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.param.device), use_cache=False)
        except _Captured:
            pass
        finally:
            handle.remove()
        if "args" not in seen:
            raise RuntimeError(f"geometry: layer {self.index} was not called in a forward pass.")
        dropped = ("hidden_states", "past_key_values", "past_key_value", "layer_past")
        kwargs = {k: v for k, v in seen["kwargs"].items() if k not in dropped}
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        return seen["args"][1:], kwargs

    def attention(self, u: torch.Tensor) -> torch.Tensor:
        seen = {}

        def grab(module, args, output):
            seen["a"] = _first(output)

        handle = self.attention_out.register_forward_hook(grab)
        try:
            self.layer(u.to(self.param.dtype)[:, None, :], *self._args, **self._kwargs)
        finally:
            handle.remove()
        return seen["a"][:, 0, :].float()

    def ffn(self, u: torch.Tensor) -> torch.Tensor:
        return self.scale * self.ffn_branch(u.to(self.param.dtype)).float()

    def full(self, u: torch.Tensor) -> torch.Tensor:
        return self.attention(u) + self.ffn(u)

    def field(self, name: str):
        if name not in FIELDS:
            raise ValueError(f"geometry: unknown field {name!r}; accepted: {', '.join(FIELDS)}.")
        return getattr(self, name)


class _Captured(Exception):
    pass


@torch.no_grad()
def _sample_inputs(model, windows, modules: dict[int, nn.Module], per_layer: int, seed: int) -> dict[int, torch.Tensor]:
    """A seeded uniform sample of `per_layer` rows of what each module receives over the windows,
    position 0 excluded (the attention sink); only the sample is kept."""
    g = torch.Generator().manual_seed(seed)
    kept = {i: RunningSample(per_layer, g) for i in modules}

    def hook(i):
        def grab(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            kept[i].add(h[:, 1:].reshape(-1, h.shape[-1]).float().cpu())
        return grab

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in modules.items()]
    try:
        device = next(model.parameters()).device
        for w in windows:
            model(input_ids=w[None].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {i: kept[i].rows() for i in modules}


def block_inputs(model, windows: torch.Tensor, layers: list[int], per_layer: int, seed: int = 0) -> dict[int, torch.Tensor]:
    """Real token directions at each layer's block input, (per_layer, d) unit rows."""
    _, decoder = architecture(model)
    return {i: unit(x) for i, x in _sample_inputs(model, windows, {i: decoder[i] for i in layers}, per_layer,
                                                  seed).items()}


def ffn_inputs(model, windows: torch.Tensor, layers: list[int], per_layer: int, seed: int = 0) -> dict[int, torch.Tensor]:
    """Real FFN inputs x (what the pre-FFN norm reads) per layer, (per_layer, d)."""
    spec, decoder = architecture(model)
    return _sample_inputs(model, windows, {i: spec.submodule(decoder[i], "ffn_norm") for i in layers}, per_layer, seed)


def critical_directions(model, index: int, token_starts: torch.Tensor, *, random_starts: int = 32,
                        fields=FIELDS, steps: int = 300, lr: float = 0.05, threshold: float = 0.05,
                        rel_tol: float = 1e-2, seed: int = 0) -> dict:
    """Critical-direction candidates of each reduced field of layer `index`, from `random_starts`
    Gaussian directions and the rows of `token_starts`, with their tangent-Jacobian spectra and
    labels; at the full field's candidates, the decomposition error ||J - J_A - J_Phi|| / ||J||."""
    fields_of = LayerFields(model, index)
    d = fields_of.param.shape[-1] if token_starts.numel() == 0 else token_starts.shape[-1]
    g = torch.Generator().manual_seed(seed * 1000 + index)
    starts = torch.cat([torch.randn(random_starts, d, generator=g), token_starts.float().cpu()]).to(fields_of.param.device)
    out = {"layer": index, "fields": {}}
    for name in fields:
        fn = fields_of.field(name)
        found = find_critical(fn, starts, steps=steps, lr=lr, threshold=threshold)
        candidates = analyse_critical(fn, found["directions"], rel_tol)
        if name == "full" and candidates:
            parts = {p: analyse_critical(fields_of.field(p), found["directions"], rel_tol) for p in ("attention", "ffn")}
            for k, c in enumerate(candidates):
                combined = parts["attention"][k]["jacobian"] + parts["ffn"][k]["jacobian"]
                c["decomposition_error"] = ((c["jacobian"] - combined).norm() / c["jacobian"].norm()).item()
        out["fields"][name] = {
            "starts": found["starts"], "converged": found["converged"], "candidates": [
                {"score": found["scores"][k].item(), **{key: v for key, v in c.items() if key not in ("jacobian",)},
                 "eigenvalues": [[z.real, z.imag] for z in c["eigenvalues"].tolist()]}
                for k, c in enumerate(candidates)],
            "directions": found["directions"].cpu()}
    return out


def label_counts(candidates: list[dict]) -> dict:
    counts = {label: 0 for label in LABELS}
    for c in candidates:
        counts[c["label"]] += 1
    return counts


# ---------------------------------------------------------------------------------------------
# Aggregation pressure: attention temperature
# ---------------------------------------------------------------------------------------------

@contextmanager
def attention_pressure(model, factor: float):
    """Multiply every attention's logit scale by `factor` inside the block (0: a uniform average over
    the visible tokens, the most aggregation; 1: the model as it is), restored on exit. Uses the
    attention modules' `scaling`, which transformers passes to every attention implementation.
    Factor 0 is applied as 1e-9 (uniform to float32 precision): torch's causal SDPA returns NaN at
    scale 0."""
    if not (isinstance(factor, (int, float)) and not isinstance(factor, bool) and 0.0 <= factor):
        raise ValueError(f"attention pressure factor={factor!r}; accepted: a number >= 0.")
    spec, decoder = architecture(model)
    modules = []
    for i, layer in enumerate(decoder):
        attention = spec.submodule(layer, "attention")
        if not isinstance(getattr(attention, "scaling", None), (int, float)):
            raise ValueError(f"attention pressure: layer {i}'s {type(attention).__name__} has no numeric `scaling` "
                             "attribute, so its logit scale cannot be changed; accepted: attention modules that pass "
                             "`scaling=self.scaling` to the attention interface (Llama, Mistral, GPT-NeoX, GPT-2 in "
                             "transformers 5).")
        modules.append((attention, attention.scaling))
    try:
        for attention, scaling in modules:
            attention.scaling = scaling * max(factor, ZERO_FACTOR)
        yield model
    finally:
        for attention, scaling in modules:
            attention.scaling = scaling


@torch.no_grad()
def pressure_diversity(model, windows: torch.Tensor, factors, variants, *, layers=None, progress=None) -> list[dict]:
    """Spherical diversity D before attention, after attention and after the FFN, per layer, for
    every (pressure factor, FFN variant): one forward per window each."""
    from .ablation import ablated
    from .evaluation import forward_windows

    was_training = model.training
    model.eval()
    rows = []
    try:
        reference = model(input_ids=windows[:1].to(next(model.parameters()).device), use_cache=False).logits
        for factor in factors:
            with attention_pressure(model, factor):
                if factor != 1:
                    changed = model(input_ids=windows[:1].to(reference.device), use_cache=False).logits
                    if not torch.isfinite(changed).all():
                        raise RuntimeError(f"attention pressure: factor {factor} gave non-finite logits.")
                    if torch.equal(changed, reference):
                        raise RuntimeError("attention pressure: changing the attention modules' `scaling` did not "
                                           "change the output; this attention implementation ignores it.")
                for variant in variants:
                    with ablated(model, variant), record(model, layers) as recorder:
                        for _ in forward_windows(model, windows):
                            pass
                    for r in recorder.records():
                        rows.append({"factor": factor, "variant": variant, "layer": r["layer"],
                                     **{k: r[f"diversity_{k}"]["mean"] for k in
                                        ("before_attention", "after_attention", "after_ffn")}})
            if progress is not None:
                progress.update(1)
    finally:
        model.train(was_training)
    return rows


# ---------------------------------------------------------------------------------------------
# FFN Jacobians, activation gain, keys and values
# ---------------------------------------------------------------------------------------------

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
        self.index, self.branch, self.scale = index, spec.ffn_branch(layer), spec.scale(layer)
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


class RunningSample:
    """A uniform sample of at most `size` rows from a stream (reservoir, seeded)."""

    def __init__(self, size: int, generator: torch.Generator):
        self.size, self.generator, self.seen, self.kept = size, generator, 0, []

    def add(self, rows: torch.Tensor) -> None:
        for row in rows:
            self.seen += 1
            if len(self.kept) < self.size:
                self.kept.append(row.clone())
            else:
                slot = int(torch.randint(self.seen, (1,), generator=self.generator))
                if slot < self.size:
                    self.kept[slot] = row.clone()

    def rows(self) -> torch.Tensor:
        return torch.stack(self.kept)
