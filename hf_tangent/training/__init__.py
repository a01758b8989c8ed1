"""Training on top of the HF Trainer: `TangentTrainingArguments` and `train` (trainer.py), healing
by distillation and the homotopy (healing.py), the text it trains and evaluates on (data.py).

Nothing is imported here, so `hf_tangent.training.data` does not pull in the Trainer."""
