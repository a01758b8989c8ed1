"""Study verdicts: the paired comparisons over seeds of a from-scratch study and the sentence that
says whether its hypothesis held, with the confidence the number of seeds allows.

Outcomes: "held" (the means point the hypothesis' way and every paired p <= 0.05), "held in the mean
only" (they do and every seed agrees, too few seeds for p <= 0.05), "inconclusive" (they do but a
seed disagrees), "did not hold" (they point the other way).
"""

from __future__ import annotations

from hf_tangent.analysis.stats import paired as paired_over_seeds
from hf_tangent.analysis.stats import paired_summary

METRIC = "final_val_loss"


def summarize(runs: list[dict], baseline: str) -> list[dict]:
    """Per variant: seeds, final validation loss mean and sd, mean paired delta vs the baseline, p."""
    return [{"variant": r["variant"], "seeds": r["seeds"], "final_val_loss_mean": r["mean"],
             "final_val_loss_sd": r["sd"], "delta_mean": r["delta_mean"], "p_value": r["p_value"]}
            for r in paired_summary(runs, baseline, METRIC)]


def paired(runs: list[dict], a: str, b: str) -> tuple[float, float]:
    """Mean over shared seeds of final loss(a) - final loss(b), and its paired permutation p-value."""
    return paired_over_seeds(runs, a, b, METRIC)


def _outcome(direction: bool, p_values: list[float], floor: float) -> str:
    """'held': the means point the hypothesis' way and every paired p <= 0.05; 'held in the mean only':
    the means do and every seed agrees (p at its floor 2/2^n), too few seeds for more; 'inconclusive':
    the means do but some seed disagrees; otherwise 'did not hold'."""
    if not direction:
        return "did not hold"
    if p_values and all(p <= 0.05 for p in p_values):
        return "held"
    if p_values and all(p <= floor * (1 + 1e-9) for p in p_values):
        return "held in the mean only"
    return "inconclusive"


def _said(outcome: str) -> str:
    return "was inconclusive" if outcome == "inconclusive" else outcome


def verdict_outcome(study: str, summary: list[dict], runs: list[dict] | None = None) -> tuple[str, str]:
    """(outcome, sentence) per study, from the numbers, with the confidence the seeds allow; with the
    runs, also the paired comparisons of the best variant against the other contenders."""
    base, others = summary[0], summary[1:]
    n = base["seeds"]
    floor = 2 / 2**n
    reach = f"with {n} seeds the smallest reachable p-value is {floor:.3f}"
    if study == "retraction":
        best = min(summary, key=lambda r: r["final_val_loss_mean"])
        finite = best["variant"] not in ("euclidean", "retract p=inf")
        against, p_values = "", []
        if best is not base:
            against = f" (vs euclidean {best['delta_mean']:+.4f}, p = {best['p_value']:.3f}"
            p_values.append(best["p_value"])
            if runs and finite and any(r["variant"] == "retract p=inf" for r in runs):
                delta, p = paired(runs, best["variant"], "retract p=inf")
                against += f"; vs retract p=inf {delta:+.4f}, p = {p:.3f}"
                p_values.append(p)
            against += ")"
        outcome = _outcome(finite, p_values, floor)
        family = [r for r in summary if r["variant"].startswith("retract")]
        within = ""
        if family:  # where the optimum over p sits among the retraction variants alone
            top = min(family, key=lambda r: r["final_val_loss_mean"])
            place = ("at the small-p end of the range tried" if top is family[0] else "at p = inf" if top is family[-1]
                     else "inside the range tried")
            within = (f" Among the retraction variants alone the best is {top['variant']} "
                      f"({top['final_val_loss_mean']:.4f}, {place}; " +
                      ", ".join(f"{r['variant'].split()[-1]}: {r['final_val_loss_mean']:.4f}" for r in family) + ").")
        return outcome, (f"Best mean final validation loss: {best['variant']} ({best['final_val_loss_mean']:.4f}){against}."
                         f"{within} The hypothesis (best at a finite p) {_said(outcome)} on this data at this scale; {reach}.")
    if study == "noise":
        tangent = [r for r in others if r["variant"].startswith("tangent")]
        matched = {r["variant"]: r for r in others if not r["variant"].startswith("tangent")}
        if not tangent:
            return "not tested", "No tangent-noise variant was run."
        best = min(tangent, key=lambda r: r["final_val_loss_mean"])
        pairs = {k: paired(runs, best["variant"], k) for k in matched} if runs else {}
        comparison = ", ".join(f"{k}: {v['final_val_loss_mean']:.4f}" + (
            " (paired delta {:+.4f}, p = {:.3f})".format(*pairs[k]) if k in pairs else "") for k, v in matched.items())
        beats = all(best["final_val_loss_mean"] < v["final_val_loss_mean"] for v in matched.values()) and \
            best["final_val_loss_mean"] < base["final_val_loss_mean"]
        outcome = _outcome(beats, [best["p_value"], *(p for _, p in pairs.values())] if len(pairs) == len(matched) else [],
                           floor)
        return outcome, (f"Best tangent noise: {best['variant']} ({best['final_val_loss_mean']:.4f}, delta vs no noise "
                         f"{best['delta_mean']:+.4f}, p = {best['p_value']:.3f}); matched comparators: "
                         f"{comparison or 'not run'}. The hypothesis (tangent noise beats no noise and the matched "
                         f"comparators) {_said(outcome)} on this data at this scale; {reach}.")
    better = [r for r in others if r["delta_mean"] < 0]
    significant = [r for r in better if r["p_value"] <= 0.05]
    outcome = max((_outcome(True, [r["p_value"]], floor) for r in better), default="did not hold",
                  key=["did not hold", "inconclusive", "held in the mean only", "held"].index)
    return outcome, (f"Variants below the unpatched final validation loss: {[r['variant'] for r in better] or 'none'}; "
                     f"significant at p <= 0.05: {[r['variant'] for r in significant] or 'none'}; {reach}. "
                     f"The hypothesis (tangential updates train better) {_said(outcome)} on this data at this scale.")


def verdict(study: str, summary: list[dict], runs: list[dict] | None = None) -> str:
    return verdict_outcome(study, summary, runs)[1]
