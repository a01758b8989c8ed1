"""The Python API of every recipe: typed arguments in, a `Report` (to_dict / to_markdown / save) out.
The `hf-tangent` commands are thin layers over these. Each module renders the reports it makes and
registers them with report.py; importing them all here keeps that table whole."""

from .analysis import ablate, diagnose_layers, layer_sensitivity, parallel_sweep
from .calibrate import calibrate_gates
from .downstream import lm_eval, merge_lm_eval
from .evaluate import evaluate_rules
from .finetune import LoraSettings, finetune
from .geometry import critical, ffn_jacobian, pressure
from .heal import HealSettings, HealTrainingArguments, heal

__all__ = ["HealSettings", "HealTrainingArguments", "LoraSettings", "ablate", "calibrate_gates", "critical", "diagnose_layers",
           "evaluate_rules", "ffn_jacobian", "finetune", "heal", "layer_sensitivity", "lm_eval", "merge_lm_eval", "parallel_sweep",
           "pressure"]
