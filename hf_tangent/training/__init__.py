"""Training on top of the HF Trainer: `TangentTrainingArguments` and `train` (trainer.py), healing
by distillation and the homotopy (healing.py), the text it trains and evaluates on (data.py).

Nothing is imported here, so `hf_tangent.training.data` does not pull in the Trainer; the names of
trainer.py resolve here on first use, as they did when training was one module (`from hf_tangent.training
import TangentTrainingArguments`, and a Trainer checkpoint's pickled training_args.bin of that time)."""


def __getattr__(name: str):
    if name.startswith("__") or name in ("data", "extras", "healing", "trainer"):  # the submodules: the import system's own
        raise AttributeError(f"module 'hf_tangent.training' has no attribute {name!r}")
    from . import trainer

    try:
        return getattr(trainer, name)
    except AttributeError:
        raise AttributeError(f"module 'hf_tangent.training' has no attribute {name!r}") from None
