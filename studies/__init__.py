"""From-scratch studies: small GPT-2 / GPT-NeoX models trained with each update rule (docs/studies-guide.md, results
in docs/studies.md). A tool of the checkout, not shipped in the wheel: the models are built from scratch, not
patched checkpoints, and `study-report` writes the checkout's docs. Run from the checkout's root:

    python -m studies study tangential --scale cpu --output-dir runs/study-tangential
    python -m studies study-report runs/study-*/report.json
"""

from . import study  # noqa: F401  (registers the "study" report kind: hf_tangent.Report.load reads kept ones)
