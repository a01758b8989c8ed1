"""Discovery and verification: where a decoder layer adds its FFN update, found and checked numerically.

Names are never trusted (gemma3 has all four Llama child names, and a Llama spec would put the
update on its attention output). Both steps run one probe forward (a few tokens, no grad, eval
mode, the model's own patch switched off) with hooks that record what each submodule receives
and returns, then test the layer's arithmetic on those tensors:

    sequential   out == r + s * f        r = input of the pre-FFN norm, f = output of ffn_out
    parallel     out == h + s * (a + f)  h = block input, a = output of attention_out

`discover` searches the recorded calls for modules that satisfy these equations; `verify` checks
a spec's modules against them on every layer, in eval mode and (for dropout after ffn_out) in
training mode. Results are cached per model class and config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import re

import torch
from torch import nn

from .patching import _refuse_inside_disabled, disabled, require_model
from .registry import _DISCOVERED, _REGISTRY, CONFIG_KEY, ArchitectureSpec, base_model_type, get_registered

_VERIFIED: dict = {}  # (model class, spec, config) -> Verification
_PROBE_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class Verification:
    """Per layer: the FFN equation holds (eval mode), also in training mode, the attention equation holds."""

    ffn: tuple[bool, ...]
    ffn_in_training: tuple[bool, ...]
    attention: tuple[bool, ...]
    detail: tuple[str, ...]  # why a layer's FFN check failed ("" when it passed)


# ----------------------------------------------------------------------------- probing
def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


@contextlib.contextmanager
def _mode(model: nn.Module, training: bool):
    flags = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def _probe_ids(model) -> torch.Tensor:
    embeddings = model.get_input_embeddings()
    vocab = getattr(model.config.get_text_config(), "vocab_size", None) or embeddings.weight.shape[0]
    ids = [1 + (37 * i + 11) % max(vocab - 2, 1) for i in range(_PROBE_TOKENS)]
    return torch.tensor([ids], device=embeddings.weight.device)


@contextlib.contextmanager
def _probing(model, *, training: bool = False, seed: int = 0):
    """The model as the probe sees it: its patch off, eval (or training) mode, no grad, RNG untouched."""
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with disabled(model), _mode(model, training), torch.no_grad(), torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        yield


def _probe(model, layers: nn.ModuleList, modules_of) -> list[dict]:
    """One forward with recording hooks (inside `_probing`): per layer, its input h, output, and
    {name: [[input, output, module, args, kwargs], ...]} for the submodules `modules_of(layer)` yields."""
    records = [{"h": None, "out": None, "calls": {}, "order": []} for _ in layers]
    handles = []

    def on_layer_in(rec):
        def hook(module, args, kwargs):
            if rec["h"] is None:
                rec["h"] = _first_tensor(args) if args else kwargs.get("hidden_states")
        return hook

    def on_layer_out(rec):
        def hook(module, args, output):
            if rec["out"] is None:
                rec["out"] = _first_tensor(output)
        return hook

    def on_call(rec, name):
        def pre(module, args, kwargs):
            x = _first_tensor(args) if args else _first_tensor(next(iter(kwargs.values()), None))
            rec["calls"].setdefault(name, []).append([x, None, module, args, kwargs])
            rec["order"].append(name)

        def post(module, args, output):  # a copy: some layers add into an output in place (Falcon)
            y = _first_tensor(output)
            rec["calls"][name][-1][1] = None if y is None else y.clone()
        return pre, post

    try:
        for layer, rec in zip(layers, records, strict=True):
            handles.append(layer.register_forward_pre_hook(on_layer_in(rec), with_kwargs=True))
            handles.append(layer.register_forward_hook(on_layer_out(rec)))
            for name, module in modules_of(layer):
                pre, post = on_call(rec, name)
                handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(module.register_forward_hook(post))
        # no cache (a hybrid's cache may need more than the probe gives); only where forward takes the argument
        params = inspect.signature(model.forward).parameters
        takes = "use_cache" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        cache = {"use_cache": False} if takes else {}
        model(input_ids=_probe_ids(model), **cache)
    except Exception as error:
        raise ValueError(f"hf_tangent: the probe forward that verifies where the FFN update is added failed "
                         f"on {type(model).__name__}: {type(error).__name__}: {error}") from error
    finally:
        for handle in handles:
            handle.remove()
    return records


def _like(t: torch.Tensor | None, out: torch.Tensor) -> bool:
    """A hidden-state tensor of the layer, possibly flattened to (tokens, d) as OPT does."""
    return t is not None and t.numel() == out.numel() and t.shape[-1] == out.shape[-1]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal up to a few roundings in the model's dtype (the layer may sum in another order)."""
    if actual is None or expected is None or not _like(actual, expected):
        return False
    # the dtype's own roundings (16 of float32's; 4 of a 16-bit type's: ~3 % of the scale in bfloat16, where
    # a parallel block's three-term sum in another order is off by up to ~1 %), read before the cast to double
    eps = torch.finfo(actual.dtype).eps if actual.dtype in (torch.bfloat16, torch.float16) else None
    tol = 4 * eps if eps is not None else 16 * torch.finfo(torch.float32).eps
    actual, expected = actual.double().reshape(expected.shape), expected.double()
    scale = expected.abs().amax().item() + 1e-30
    return bool((actual - expected).abs().amax().item() <= tol * scale)


def _once(rec: dict, name: str):
    calls = rec["calls"].get(name, [])
    return calls[0] if len(calls) == 1 and calls[0][0] is not None and calls[0][1] is not None else None


def _positionwise(call, *, exact: bool = False) -> bool:
    """Does the module act on each token alone (an FFN), unlike a mixer? Called again with the first
    token's input changed: the other tokens' outputs must not move (up to a few roundings; `exact`: not
    at all, for telling a mixer apart: in bfloat16 a few roundings are 12 % of the scale, more than a tiny
    attention moves the other tokens). False when it cannot be re-run."""
    x, y, module, args, kwargs = call
    if x.dim() < 2 or x.numel() // x.shape[-1] < 2:
        return False
    changed = x.clone()
    if x.dim() == 2:
        changed[0] = changed[0] * 2 + 1
    else:
        changed[..., 0, :] = changed[..., 0, :] * 2 + 1
    if args:
        args = (changed,) + tuple(args[1:])
    else:
        first = next(iter(kwargs))
        kwargs = {**kwargs, first: changed}
    try:
        again = _first_tensor(module(*args, **kwargs))
    except Exception:
        return False
    if again is None or again.shape != y.shape:
        return False
    rest = (lambda t: t[1:]) if y.dim() == 2 else (lambda t: t[..., 1:, :])
    return torch.equal(rest(again), rest(y)) or (not exact and _close(rest(again), rest(y)))


def _norm_like(module: nn.Module, d: int) -> bool:
    """A norm (or other per-channel map): at most 2 * d parameters."""
    return sum(p.numel() for p in module.parameters()) <= 2 * d


# ----------------------------------------------------------------------------- verification
def verify(model, spec: ArchitectureSpec, layers: nn.ModuleList) -> Verification:
    """Check the spec's modules against the layer arithmetic on every layer (cached per class and config)."""
    key = _cache_key(model, spec)
    if key in _VERIFIED:
        return _VERIFIED[key]

    def roles_of(layer):
        for role in ("input_norm", "attention", "attention_out", "ffn_norm", "mlp", "ffn_out"):
            with contextlib.suppress(ValueError):
                yield role, spec.submodule(layer, role)

    def check(rec, layer, *, training=False):
        h, out, s = rec["h"], rec["out"], spec.scale(layer)
        norm, ffn, attn = _once(rec, "ffn_norm"), _once(rec, "ffn_out"), _once(rec, "attention_out")
        if out is None or h is None:
            return False, False, "the layer's input or output is not a tensor"
        if norm is None or ffn is None:
            role = "ffn_norm" if norm is None else "ffn_out"
            path = spec.ffn_norm if norm is None else spec.ffn_out_path
            return False, False, f"its {role} module '{path}' was not called exactly once"
        f = ffn[1]
        if f.abs().amax().item() == 0:
            return False, False, "its FFN output is exactly zero, so the probe cannot tell where it is added"
        if spec.is_parallel(layer):
            ok = _close(norm[0], h) and attn is not None and _close(out, h + s * (attn[1].reshape(f.shape) + f))
            if not ok:
                return False, False, "out != h + s * (attention_out + ffn_out) with h the block input (parallel block)"
            if not training:  # which branch is which: the FFN acts per token, the attention mixes tokens
                mixer, ffn_root = _once(rec, "attention"), _once(rec, "mlp") or ffn
                if not _positionwise(ffn_root) or (mixer is not None and _positionwise(mixer, exact=True)):
                    return False, False, ("its attention and FFN roles are swapped: the FFN module must act on "
                                          "each token alone and the attention module must mix tokens")
            return True, True, ""
        ok = _close(out, norm[0].reshape(out.shape) + s * f.reshape(out.shape))
        if ok and not training and not _positionwise(_once(rec, "mlp") or ffn):
            return False, False, (f"the module it adds ('{spec.mlp or spec.ffn_out_path}') mixes tokens: it is a "
                                  "mixer (attention, Mamba), not an FFN")
        attention = attn is not None and _close(norm[0], h + s * attn[1].reshape(h.shape))
        why = "" if ok else (f"out != r + s * ffn_out(...) with r the input of '{spec.ffn_norm}' and ffn_out "
                             f"'{spec.ffn_out_path}' (s = {s:g})")
        return ok, attention, why

    with _probing(model):
        records = _probe(model, layers, roles_of)
        results = [check(rec, layer) for rec, layer in zip(records, layers, strict=True)]
    training = [ok for ok, _, _ in results]
    if any(training) and _has_dropout(model):
        with _probing(model, training=True):
            records = _probe(model, layers, roles_of)
            training = [ok and check(rec, layer, training=True)[0]
                        for rec, layer, ok in zip(records, layers, training, strict=True)]
    verification = Verification(ffn=tuple(r[0] for r in results), ffn_in_training=tuple(training),
                                attention=tuple(r[1] for r in results), detail=tuple(r[2] for r in results))
    _VERIFIED[key] = verification
    return verification


def _has_dropout(model) -> bool:
    """Dropout that could act in training mode: a module with p > 0 or a config probability > 0."""
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    config = model.config.get_text_config().to_dict()
    return any("dropout" in k and isinstance(v, float) and v > 0 for k, v in config.items())


def _cache_key(model, spec):
    config = {k: v for k, v in model.config.to_dict().items() if k != CONFIG_KEY}
    dtype = next((p.dtype for p in model.parameters()), None)
    layer_classes = tuple(dict.fromkeys(type(layer) for layer in spec.decoder_layers(model)))  # a swapped layer class
    return type(model), spec, json.dumps(config, sort_keys=True, default=str), dtype, layer_classes


def require_verified(model, spec: ArchitectureSpec, layers: nn.ModuleList, *, needs_attention: list[int]) -> Verification:
    """Verify, and refuse with the failed check and how to register the architecture by hand."""
    verification = verify(model, spec, layers)
    failed = [i for i, ok in enumerate(verification.ffn) if not ok]
    if failed:
        i = failed[0]
        raise ValueError(
            f"hf_tangent: model_type '{base_model_type(model.config)}' ({type(layers[i]).__name__}, {spec.source} spec) "
            f"did not verify: in layer {i}, {verification.detail[i]}. hf_tangent patches decoder layers whose "
            "output is the residual plus the FFN update (pre-norm, sandwich-norm, parallel or residual-scaled "
            "blocks; not post-LN blocks, blocks without an FFN, or extra streams). If the layer does compute "
            "that, name its submodules with hf_tangent.register_architecture(model_type=..., layers=..., "
            "input_norm=..., attention=..., ffn_norm=..., mlp=..., ffn_out=...); hf_tangent.describe(model) "
            "shows what was found."
        )
    unverified = [i for i in needs_attention if not verification.attention[i]]
    if unverified:
        raise ValueError(
            f"hf_tangent: in layers {unverified} of this '{base_model_type(model.config)}' model the attention branch "
            "could not be verified (h + attention_out(...) is not the residual the FFN sees), so parallel "
            "conversion and the attention branch are refused there."
        )
    return verification


# ----------------------------------------------------------------------------- discovery
def _depth(name: str) -> int:
    return name.count(".")


def _layer_list(model) -> tuple[str, nn.ModuleList]:
    n = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    candidates = [(name, m) for name, m in model.named_modules()
                  if isinstance(m, nn.ModuleList) and len(m) and all(any(True for _ in x.parameters()) for x in m)]
    towers = re.compile(r"vision|visual|image|audio|speech")  # a multimodal model's other stacks
    candidates = [c for c in candidates if not towers.search(c[0])] or candidates
    exact = [c for c in candidates if len(c[1]) == n] or candidates
    if not exact:
        raise ValueError(f"hf_tangent: found no list of decoder layers in {type(model).__name__}.")
    return max(exact, key=lambda c: sum(p.numel() for p in c[1].parameters()))


def _find_roles(rec: dict, layer: nn.Module) -> dict | str:
    """The spec fields of one layer from its recorded calls (inside `_probing`), or why none fit."""
    h, out = rec["h"], rec["out"]
    if h is None or out is None or not _like(h, out):
        return "its input or output is not a hidden-state tensor of one shape"
    h, d = h.reshape(out.shape), out.shape[-1]
    order = {name: rec["order"].index(name) for name in rec["calls"]}
    single = {name: c for name in order if (c := _once(rec, name)) is not None}
    outs = sorted((n for n, c in single.items() if _like(c[1], out) and c[1].abs().amax() > 0),
                  key=lambda n: (_depth(n), order[n]))
    ins = [n for n, c in single.items() if _like(c[0], out)]
    scales = {name: float(v) for name, v in vars(layer).items()
              if isinstance(v, (int, float)) and not isinstance(v, bool) and v not in (0, 1)}

    def value(name, i):  # a call's input (0) or output (1) as a hidden-state tensor
        return single[name][i].reshape(out.shape)

    def feeds(src: str, dst: str) -> bool:  # src's output is dst's input
        a, b = single[src][1], single[dst][0]
        return a is b or (_like(a, b) and torch.equal(a.reshape(b.shape), b))

    def nested(a: str, b: str) -> bool:
        return a.startswith(b + ".") or b.startswith(a + ".")

    def is_norm(name: str) -> bool:
        return _norm_like(single[name][2], d)

    def attention_roles(a_name: str) -> dict:
        feeder = [n for n in single if order[n] < order[a_name] and _depth(n) == _depth(a_name) and feeds(n, a_name)]
        attention = feeder[-1] if feeder and not is_norm(feeder[-1]) else a_name  # sandwich: mixer -> post-norm
        norms = [n for n in single if order[n] < order[attention] and _close(single[n][0], h) and feeds(n, attention)]
        input_norm = norms[-1] if norms else attention if _close(single[attention][0], h) else None
        return {"attention": attention, "attention_out": None if attention == a_name else a_name, "input_norm": input_norm}

    def ffn_roles(norm: str, f_name: str) -> dict:
        if norm == f_name or not is_norm(norm):  # no separate pre-FFN norm: the module reading r is the FFN
            return {"ffn_norm": norm, "mlp": None, "ffn_out": f_name}
        if feeds(norm, f_name):
            return {"ffn_norm": norm, "mlp": f_name, "ffn_out": None}
        inner = [n for n in single if order[norm] < order[n] < order[f_name] and feeds(norm, n) and feeds(n, f_name)
                 and any(True for _ in single[n][2].children())]  # a whole FFN, not fc1 with an identity-like act
        return {"ffn_norm": norm, "mlp": inner[0] if inner else None, "ffn_out": f_name}

    # sequential: out = r + s * f, r the input of the pre-FFN norm
    for f_name in outs:
        f = value(f_name, 1)
        readers = sorted((n for n in ins if order[n] <= order[f_name] and (n == f_name or not nested(n, f_name))),
                         key=lambda n: (_depth(n), -order[n]))
        for norm in readers:
            r = value(norm, 0)
            if _close(out, r + f):
                scale, s = None, 1.0
            else:
                fit = ((out - r).double() * f.double()).sum() / (f.double() * f.double()).sum()
                named = [k for k, v in scales.items() if abs(v - fit.item()) <= 1e-4 * abs(v) and _close(out, r + v * f)]
                if not named:
                    continue
                scale, s = named[0], scales[named[0]]
            ffn = ffn_roles(norm, f_name)
            root = ffn["mlp"] or (f_name if is_norm(norm) else norm)  # the module that computes the FFN
            path = [n for n in single if order[norm] < order[n] < order[root]] + [root]
            if not all(_positionwise(single[n]) for n in path):
                continue  # a mixer (Mamba, attention) adds this update, not an FFN
            attention = next((a for a in outs if order[a] < order[norm] and not nested(a, norm) and a != norm
                              and _close(r, h + s * value(a, 1))), None)
            roles = attention_roles(attention) if attention else {"attention": None, "attention_out": None, "input_norm": None}
            return {**roles, **ffn, "residual_scale": scale, "parallel": False}
    # parallel: out = h + a + f, the FFN acting on each token alone and the attention mixing them
    for f_name in outs:
        readers = [n for n in ins if order[n] <= order[f_name] and _close(single[n][0], h)
                   and (n == f_name or (not nested(n, f_name) and feeds(n, f_name)))]
        if not readers or not _positionwise(single[f_name]):
            continue
        for a_name in outs:
            if a_name != f_name and not nested(a_name, f_name) and _close(out, h + value(a_name, 1) + value(f_name, 1)):
                if _positionwise(single[a_name], exact=True):
                    continue
                return {**attention_roles(a_name), **ffn_roles(readers[-1], f_name), "residual_scale": None, "parallel": True}
    return "no submodules satisfy out = r + ffn(...) (sequential) or out = h + attention(h) + ffn(h) (parallel)" + \
        _why_not(rec, out, single, order, ins, outs, value)


def _why_not(rec, out, single, order, ins, outs, value) -> str:
    """What the layer computes instead, where one of the known reasons fits (for the refusal)."""
    mixers = [n for n in outs if not _positionwise(single[n])]
    per_token = [n for n in outs if not any(n.startswith(m + ".") for m in mixers) and _positionwise(single[n])]
    pairs = [(norm, f_name) for f_name in per_token if not torch.equal(value(f_name, 1), out)
             for norm in ins if order[norm] < order[f_name] and not f_name.startswith(norm + ".")]
    for norm, f_name in pairs:  # post-LN: out = norm(r + f)
        r, f = value(norm, 0), value(f_name, 1)
        if any(order[n] > order[f_name] and _close(single[n][1], out) and _close(single[n][0], r + f) for n in single):
            return ("; it is a post-LN block: out = norm(r + ffn(...)), so the update is normalised after the add "
                    "and no x_next = x + update exists to patch")
    for norm, f_name in pairs:  # a scaled residual: out = alpha r + beta f
        r, f = value(norm, 0), value(f_name, 1)
        a = torch.stack([r.double().flatten(), f.double().flatten()], 1)
        alpha, beta = torch.linalg.lstsq(a, out.double().flatten()[:, None]).solution.flatten().tolist()
        if abs(alpha - 1) > 1e-3 and abs(alpha) > 1e-3 and abs(beta) > 1e-3 and _close(out, alpha * r + beta * f):
            return (f"; it scales the residual itself: out = {alpha:.4g} * r + {beta:.4g} * ffn(...), which no "
                    "update of x alone reproduces")
    if not [n for n in per_token if not _norm_like(single[n][2], out.shape[-1])]:
        return ("; no sub-block that adds to its residual acts on each token alone (an SSM / recurrent block, or "
                "an FFN whose routing depends on other tokens)")
    return ""


def discover(model) -> ArchitectureSpec:
    """Infer the spec of an unregistered `model_type` from the module tree and one probe forward."""
    model_type = base_model_type(model.config)
    layers_path, layers = _layer_list(model)
    by_class: dict[type, dict] = {}  # layer class -> its roles (hybrids have several classes)
    with _probing(model):
        records = _probe(model, layers, lambda layer: ((n, m) for n, m in layer.named_modules() if n))
        for i, (layer, rec) in enumerate(zip(layers, records, strict=True)):
            if type(layer) in by_class:
                continue
            roles = _find_roles(rec, layer)
            if isinstance(roles, str):
                raise ValueError(
                    f"hf_tangent: model_type '{model_type}' has no registry entry and discovery failed: in layer {i} "
                    f"({type(layer).__name__}), {roles}. hf_tangent patches decoder layers whose output is the "
                    "residual plus the FFN update; if this one is, register it by hand with "
                    "hf_tangent.register_architecture(...)."
                )
            by_class[type(layer)] = {**roles, "ffn_out": roles["ffn_out"] or roles["mlp"],
                                     "attention_out": roles["attention_out"] or roles["attention"]}
    fields = {}
    for name in ("input_norm", "attention", "attention_out", "ffn_norm", "mlp", "ffn_out", "residual_scale", "parallel"):
        values = list(dict.fromkeys(roles[name] for roles in by_class.values()))
        if name in ("parallel", "residual_scale") and len(values) > 1:
            raise ValueError(f"hf_tangent: model_type '{model_type}' mixes layer kinds that differ in {name}; "
                             "register it by hand with hf_tangent.register_architecture(...).")
        # a role that differs per layer class is named per class: "ClassA=path|ClassB=path"
        keyed = "|".join(f"{cls.__name__}={roles[name]}" for cls, roles in by_class.items() if roles[name] is not None)
        fields[name] = values[0] if len(values) == 1 else keyed or None
    if fields["ffn_out"] == fields["mlp"]:
        fields["ffn_out"] = None
    if fields["attention_out"] == fields["attention"]:
        fields["attention_out"] = None
    spec = ArchitectureSpec(model_type=model_type, layers=layers_path, source="discovered", **fields)
    _DISCOVERED[type(model)] = spec
    return spec


def resolve_spec(model) -> ArchitectureSpec:
    """The registry's entry, else a spec discovered (or saved) earlier for this class, else discovery."""
    return get_registered(model) or discover(model)


def checked_spec(model) -> ArchitectureSpec:
    """install._check_model's checks of a model a user hands to `patch` (a folder's remote code patches only the
    model its own `__init__` built): a transformers model, outside `disabled`, whose layers are its own."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"hf_tangent.patch expects a transformers model (nn.Module), got {type(model).__name__}.")
    _refuse_inside_disabled(model, "patch")
    if getattr(getattr(model, "config", None), "model_type", None) is None:
        raise ValueError(f"hf_tangent: {type(model).__name__} has no config.model_type; pass a transformers model.")
    spec = resolve_spec(model)
    first = {}
    for i, layer in enumerate(spec.decoder_layers(model)):
        if id(layer) in first:
            raise ValueError(f"hf_tangent: layers {first[id(layer)]} and {i} are one module object (shared weights); "
                             "a patch is per layer, so hf_tangent refuses models that reuse a layer.")
        first[id(layer)] = i
        if _has_foreign_forward(layer):
            raise ValueError(
                f"hf_tangent: layer {i} ({type(layer).__name__}) has its forward replaced on the instance, "
                "by another patching tool; hf_tangent only patches unmodified layers."
            )
    return spec


def _has_foreign_forward(layer: nn.Module) -> bool:
    """True when an instance-level `forward` is not the layer class's own forward (or a wrapper of
    it, as transformers' output recording installs): another tool replaced the computation."""
    fn = vars(layer).get("forward")
    own = type(layer).forward
    while fn is not None:
        fn = getattr(fn, "__func__", fn)
        if fn is own:
            return False
        fn = getattr(fn, "__wrapped__", None)
    return "forward" in vars(layer)


def verify_patch(model, spec: ArchitectureSpec, layers, config, updated: set, parallel: set) -> Verification | None:
    """The numeric check of where the update lands (install._patch); None on a meta-device model built from a
    saved patch (from_pretrained), which was verified when it was saved."""
    if any(p.is_meta for p in model.parameters()):
        if spec.source == "registry" or getattr(model.config, CONFIG_KEY, None):
            return None
        raise ValueError("hf_tangent: this model's weights are on the meta device, so its architecture cannot be "
                         "discovered and verified; load the weights first.")
    attention = parallel | (updated if "attention" in config.branches and config.update != "add" else set())
    return require_verified(model, spec, layers, needs_attention=sorted(attention))


def ffn_branch(spec: ArchitectureSpec, layer: nn.Module):
    """Phi as a function of the residual x: ffn_out(mlp(ffn_norm(x))), without the residual
    multiplier (scale); what the layer adds when its FFN reads x."""
    ffn_norm, mlp, ffn_out = (spec.submodule(layer, r) for r in ("ffn_norm", "mlp", "ffn_out"))

    def phi(x):
        out = mlp(ffn_norm(x))
        return out if ffn_out is mlp else first_output(ffn_out(out))

    return phi


def first_output(output):
    """A module's output tensor (the first element when it returns a tuple)."""
    return output[0] if isinstance(output, tuple) else output


def architecture(model) -> tuple[ArchitectureSpec, nn.ModuleList]:
    """(spec, decoder layers) of a supported or patched model: the one place a model's architecture is
    resolved (an unregistered type is discovered and cached the way patch does)."""
    spec = resolve_spec(model)
    return spec, spec.decoder_layers(model)


def decoder_layers(model) -> nn.ModuleList:
    """The decoder layers of any supported model."""
    return architecture(model)[1]


def describe(model) -> str:
    """What hf_tangent found for this model: the spec, where it came from, and the per-layer verification."""
    model = require_model(model, "describe")
    spec = resolve_spec(model)
    layers = spec.decoder_layers(model)
    v = verify(model, spec, layers)
    lines = [f"{type(model).__name__} (model_type '{base_model_type(model.config)}'): {spec.source} spec",
             f"  layers: {spec.layers} ({len(layers)})"]
    for name in ("input_norm", "attention", "attention_out", "ffn_norm", "mlp", "ffn_out", "residual_scale",
                 "parallel_attr", "parallel"):
        value = getattr(spec, name)
        if value not in (None, False):
            lines.append(f"  {name}: {value}")
    for i, layer in enumerate(layers):
        form = "parallel" if spec.is_parallel(layer) else "sequential"
        status = "verified" if v.ffn[i] else f"NOT verified ({v.detail[i]})"
        extra = "" if v.ffn_in_training[i] or not v.ffn[i] else ", eval mode only (dropout after ffn_out)"
        attn = "attention verified" if v.attention[i] else "attention not verified"
        lines.append(f"  layer {i} ({type(layer).__name__}, {form}): FFN update {status}{extra}; {attn}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the registry's public side
# (package only: a saved folder's remote code reads the registry's entries and its record's spec, registry.py)
def register_architecture(spec: ArchitectureSpec | None = None, *, overwrite: bool = False, **fields) -> ArchitectureSpec:
    """Register an architecture, as a spec or as its fields: `register_architecture(model_type=..., ...)`."""
    if spec is not None and not isinstance(spec, ArchitectureSpec):
        raise TypeError(f"hf_tangent.register_architecture expects an ArchitectureSpec or its fields, got "
                        f"{type(spec).__name__}.")
    if spec is None:
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(ArchitectureSpec)})
        if unknown:
            raise ValueError(f"hf_tangent.register_architecture: unknown fields {unknown}; accepted: "
                             f"{', '.join(f.name for f in dataclasses.fields(ArchitectureSpec))}.")
        spec = ArchitectureSpec(**fields)
    if spec.model_type in _REGISTRY and not overwrite:
        raise ValueError(f"hf_tangent: model_type '{spec.model_type}' is already registered; pass overwrite=True.")
    _REGISTRY[spec.model_type] = spec
    return spec


def supported_model_types() -> list[str]:
    """The `model_type`s with a registry entry (built in or added with `register_architecture`), sorted."""
    return sorted(_REGISTRY)


def get_spec(model_type: str) -> ArchitectureSpec:
    try:
        return _REGISTRY[model_type]
    except KeyError:
        raise ValueError(
            f"hf_tangent: model_type '{model_type}' is not supported; supported: "
            f"{', '.join(supported_model_types())}, and any model_type whose spec hf_tangent.patch discovers and "
            "verifies. Add one with hf_tangent.register_architecture(...)."
        ) from None
