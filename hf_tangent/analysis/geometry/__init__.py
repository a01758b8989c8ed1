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

from .critical import PROTOCOLS, critical_directions, label_counts
from .ffn import GAIN_REGIMES, FfnProbe, gain_regimes, value_matrix
from .fields import FIELDS, LayerFields, RunningSample, block_inputs, ffn_inputs
from .pressure import ZERO_FACTOR, attention_pressure, pressure_diversity
from .sphere import (
    BASIN,
    LABELS,
    OUTCOMES,
    analyse_critical,
    batched_jacobian,
    classify,
    classify_by_sign,
    descend,
    distinct_roots,
    effective_rank,
    eigen,
    find_critical,
    is_odd,
    linear_critical,
    linear_map,
    newton_roots,
    project,
    refine_critical,
    spectrum,
    tangent_basis,
    tangent_jacobian,
    unit,
    zero_score,
)

__all__ = ["BASIN", "OUTCOMES", "FIELDS", "GAIN_REGIMES", "LABELS", "PROTOCOLS", "ZERO_FACTOR", "FfnProbe", "LayerFields", "RunningSample",
           "analyse_critical", "attention_pressure", "batched_jacobian", "block_inputs", "classify", "classify_by_sign",
           "critical_directions", "descend", "distinct_roots", "effective_rank", "eigen", "ffn_inputs", "find_critical",
           "gain_regimes", "is_odd", "label_counts", "linear_critical", "linear_map", "newton_roots",
           "pressure_diversity", "project", "refine_critical", "spectrum", "tangent_basis", "tangent_jacobian", "unit",
           "value_matrix", "zero_score"]
