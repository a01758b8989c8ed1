"""`evaluate` metric: perplexity from per-window summed NLL and token counts.

Load it offline by path: `evaluate.load(hf_tangent.analysis.evaluation.PERPLEXITY_METRIC)`.
"""

import math

import datasets
import evaluate

_DESCRIPTION = """Token-weighted perplexity: exp(sum of next-token NLL / number of predicted tokens).
Each prediction is one window's summed NLL (nats), each reference that window's predicted-token count."""

_INPUTS = """
Args:
    predictions: summed next-token negative log-likelihood of each window, in nats.
    references: number of predicted tokens in each window.
Returns:
    perplexity: exp(nll); nll: token-weighted mean NLL; tokens: total predicted tokens.
Example:
    >>> metric = evaluate.load(PERPLEXITY_METRIC)
    >>> metric.compute(predictions=[10.0, 20.0], references=[5, 10])["nll"]
    2.0
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _INPUTS)
class TangentPerplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_INPUTS,
            features=datasets.Features({"predictions": datasets.Value("float64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        tokens = int(sum(references))
        if tokens <= 0:
            raise ValueError("tangent_perplexity: no predicted tokens (references sum to 0).")
        nll = float(sum(predictions)) / tokens
        return {"perplexity": math.exp(nll), "nll": nll, "tokens": tokens}
