"""Trainer-based recipes: FFN gate calibration (math.md section 5) and fine-tuning.

Everything distributed (DDP, FSDP, DeepSpeed) is the HF Trainer's and accelerate's job: run the
same code under `accelerate launch` or `torchrun`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import statistics
import warnings
from typing import ClassVar

import torch
from transformers import TrainerCallback, TrainingArguments

from ..analysis.diagnostics import QUANTITIES, diagnose
from ..core.gather import full_parameters, full_value
from ..core.install import CHILD_NAME
from ..core.patching import tangent_layers
from ..ranges import SEED, Range, at_least, check_ranges
from .extras import needs_recipes

GATE_SUFFIX = f"{CHILD_NAME}.gate"
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


def lm_dataset(windows: torch.Tensor):
    """A `datasets.Dataset` of packed causal-LM examples (input_ids = labels) from (n, seq_len) windows."""
    with needs_recipes("training with the HF Trainer"):
        import datasets

    rows = windows.tolist()
    return datasets.Dataset.from_dict({"input_ids": rows, "labels": rows})


def freeze_all_but_gates(model) -> list[torch.nn.Parameter]:
    """requires_grad only on the FFN gates; every model weight frozen. Returns the gates."""
    gates = []
    for name, param in model.named_parameters():
        trainable = name.endswith(GATE_SUFFIX)
        param.requires_grad_(trainable)
        if trainable:
            gates.append(param)
    if not gates:
        raise ValueError("no FFN gates on this model: patch it with TangentConfig(gates=True) first.")
    return gates


def gate_values(model) -> dict[int, float]:
    """Gate value by layer index, also through DDP / FSDP1 / FSDP2 / ZeRO-3 wrappers, where the
    gates are gathered: a collective, so call it on every rank."""
    children = [child for child in tangent_layers(model) if child.gate is not None]
    with full_parameters(model, [child.gate for child in children]):
        return {child.index: float(full_value(child.gate).detach().float().reshape(-1)[0]) for child in children}


def gate_summary(gates: dict[int, float]) -> dict:
    values = list(gates.values())
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "argmin": min(gates, key=gates.get), "argmax": max(gates, key=gates.get)}


@dataclasses.dataclass
class TangentTrainingArguments(TrainingArguments):
    """`transformers.TrainingArguments` with hf_tangent's defaults: a fixed number of optimizer steps,
    a loss logged every step, a reproducible data order, no checkpoints unless `save_steps` > 0, no
    logging backend, and gloo for multi-process runs on CPU. Every other field is the Trainer's own
    (deepspeed, fsdp, bf16, gradient_checkpointing, report_to, ...).

    `resume_from_checkpoint`: "last" resumes from the newest complete checkpoint in output_dir."""

    output_dir: str = dataclasses.field(default="runs/latest", metadata={"help": "Run folder: report, plots, checkpoints."})
    max_steps: int = dataclasses.field(default=50, metadata={"help": "Optimizer steps."})
    learning_rate: float = dataclasses.field(default=1e-2, metadata={"help": "Peak learning rate (AdamW)."})
    lr_scheduler_type: str = dataclasses.field(default="constant", metadata={"help": "Trainer scheduler name."})
    logging_steps: float = dataclasses.field(default=1, metadata={"help": "Log the loss every N steps."})
    save_steps: float = dataclasses.field(default=0, metadata={"help": "Checkpoint every N steps (0: no checkpoints)."})
    save_total_limit: int | None = dataclasses.field(default=2, metadata={
        "help": "Checkpoints kept, the newest (None: every one; 0 is refused, the Trainer would keep every one)."})
    report_to: str | None = dataclasses.field(default="none", metadata={"help": "Logging backend: none, tensorboard, wandb."})
    dataloader_drop_last: bool = dataclasses.field(default=True, metadata={"help": "Full batches only."})
    remove_unused_columns: bool = dataclasses.field(default=False, metadata={"help": "Keep the packed LM columns."})
    resume_from_checkpoint: str | None = dataclasses.field(default=None, metadata={
        "help": "Resume training from a checkpoint: a checkpoint-N folder, or `last` (the newest complete checkpoint in "
                "--output_dir; a run saves them with --save_steps). Default: start from step 0."})

    # every numeric field, the Trainer's own too (finite unless said; a fraction < 1 of max_steps where
    # the Trainer reads one): refused here, before the Trainer or a model sees them
    RANGES: ClassVar[dict[str, Range]] = {
        "max_steps": at_least(1), "per_device_train_batch_size": at_least(1), "per_device_eval_batch_size": at_least(1),
        "gradient_accumulation_steps": at_least(1), "learning_rate": Range(0), "save_steps": Range(0),
        "num_train_epochs": Range(0), "warmup_steps": Range(0), "weight_decay": Range(0),
        "adam_beta1": Range(0, 1, open_high=True), "adam_beta2": Range(0, 1, open_high=True),
        "adam_epsilon": Range(0, open_low=True), "max_grad_norm": Range(0),  # 0: no clipping
        "label_smoothing_factor": Range(0, 1, open_high=True), "neftune_noise_alpha": Range(0),
        "torch_empty_cache_steps": at_least(1), "logging_steps": Range(0, open_low=True),
        "eval_steps": Range(0, open_low=True), "eval_delay": Range(0), "eval_accumulation_steps": at_least(1),
        "save_total_limit": at_least(1), "seed": SEED, "data_seed": SEED, "dataloader_num_workers": at_least(0),
        "dataloader_prefetch_factor": at_least(1), "ddp_bucket_cap_mb": at_least(1),
        "ddp_timeout": Range(1, 2**31 - 1, integer=True),  # seconds; torch keeps them in a C int
        "local_rank": at_least(-1)}  # -1: not a distributed run
    RANGES_ALL_TYPES: ClassVar[bool] = False  # ranges.check_ranges (here and in every recipe function): ranged fields

    def __post_init__(self):
        check_ranges(self)  # the numeric fields (RANGES_ALL_TYPES); the Trainer converts its other fields itself
        if self.save_steps and self.save_steps > 0:
            self.save_strategy = "steps"
        else:
            self.save_strategy, self.save_steps = "no", 500
        if self.gradient_checkpointing and self.gradient_checkpointing_kwargs is None:
            self.gradient_checkpointing_kwargs = {"use_reentrant": False}
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and self.ddp_backend is None and not torch.cuda.is_available():
            self.ddp_backend = "gloo"
            self.ddp_find_unused_parameters = False
        if self.data_seed is None:
            self.data_seed = self.seed
        super().__post_init__()


def training_arguments(output_dir: str, *, max_steps: int, learning_rate: float, batch_size: int,
                       grad_accum: int = 1, seed: int = 0, save_steps: int = 0, bf16: bool = False,
                       gradient_checkpointing: bool = False, device: str = "cpu", lr_scheduler: str = "constant",
                       warmup_steps: int = 0, weight_decay: float = 0.0, **fields) -> TangentTrainingArguments:
    """TangentTrainingArguments from the few fields the recipes vary (others pass through)."""
    return TangentTrainingArguments(
        output_dir=output_dir, max_steps=max_steps, learning_rate=learning_rate,
        per_device_train_batch_size=batch_size, gradient_accumulation_steps=grad_accum, seed=seed,
        save_steps=save_steps, bf16=bf16, gradient_checkpointing=gradient_checkpointing, use_cpu=device == "cpu",
        lr_scheduler_type=lr_scheduler, warmup_steps=warmup_steps, weight_decay=weight_decay, **fields)


def training_summary(args) -> dict:
    """The Trainer settings a report records (the keys the kept reports use)."""
    scheduler = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    return {"max_steps": args.max_steps, "learning_rate": args.learning_rate, "batch_size": args.per_device_train_batch_size,
            "grad_accum": args.gradient_accumulation_steps, "lr_scheduler": str(scheduler), "bf16": args.bf16,
            "gradient_checkpointing": args.gradient_checkpointing}


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest `checkpoint-N` folder in `output_dir` that the Trainer finished writing (it
    writes trainer_state.json last), or None. Newer, incomplete ones (a run killed while saving)
    are skipped with a warning."""
    if not os.path.isdir(output_dir):
        return None
    steps = sorted((int(m.group(1)), m.group(0)) for m in (_CHECKPOINT.fullmatch(n) for n in os.listdir(output_dir)) if m)
    skipped = []
    for _, name in reversed(steps):
        folder = os.path.join(output_dir, name)
        if os.path.isfile(os.path.join(folder, "trainer_state.json")):
            if skipped:
                warnings.warn(f"hf_tangent: skipping incomplete checkpoints {skipped} (no trainer_state.json: the run "
                              f"stopped while saving); resuming from {name}.", stacklevel=2)
            return folder
        skipped.append(name)
    return None


def check_sharding(model) -> None:
    """Refuse, before any work, a run that accelerate would shard with FSDP1 while the model holds
    parameters of more than one dtype (bf16 weights, float32 gates): FSDP1 flattens each unit into
    one tensor of one dtype and would fail at wrap time with a message that does not say what to do."""
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if not fsdp or os.environ.get("FSDP_VERSION", "1") != "1":
        return
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
    if len(dtypes) > 1:
        raise ValueError(
            f"FSDP1 flattens each wrapped unit into one tensor of one dtype, but this model holds {', '.join(dtypes)} "
            "parameters (hf_tangent's gates are float32). Either load the model in float32 and train in bf16 "
            "through mixed precision (accelerate `mixed_precision: bf16`, or TrainingArguments(bf16=True)), or use "
            "FSDP2 (accelerate config `fsdp_version: 2`), which keeps each parameter's dtype."
        )


def resolve_checkpoint(args) -> str | None:
    """The checkpoint `args.resume_from_checkpoint` names: None, "last" (the newest complete one in
    args.output_dir; an error when there is none) or a checkpoint folder (checked)."""
    wanted = getattr(args, "resume_from_checkpoint", None)
    if not wanted:
        return None
    if wanted in ("last", "true", "True"):
        checkpoint = last_complete_checkpoint(args.output_dir)
        if checkpoint is None:
            raise ValueError(f"--resume_from_checkpoint last: no complete checkpoint (checkpoint-N/ with "
                             f"trainer_state.json) in {args.output_dir}; run without it to train from the start.")
        return checkpoint
    if not os.path.isfile(os.path.join(wanted, "trainer_state.json")):
        raise ValueError(f"--resume_from_checkpoint {wanted}: not a complete Trainer checkpoint (no trainer_state.json).")
    return wanted


def train(model, train_dataset, args, *, callbacks=None, trainer_class=None, **trainer_kwargs):
    """Run the HF Trainer (resuming where args.resume_from_checkpoint says, see resolve_checkpoint)."""
    from transformers import Trainer, default_data_collator

    check_sharding(model)
    checkpoint = resolve_checkpoint(args)
    if getattr(args, "gradient_checkpointing", False) and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()  # frozen embeddings + checkpointing (peft #742)
    trainer = with_trainable_checkpoints(trainer_class or Trainer)(
        model=model, args=args, train_dataset=train_dataset, data_collator=default_data_collator, callbacks=callbacks,
        **trainer_kwargs)
    trainer.train(resume_from_checkpoint=checkpoint)
    return trainer


TRAINABLE_WEIGHTS = "trainable.safetensors"


class TrainableCheckpoints:
    """Mixed into the Trainer by `train`: a checkpoint of a run that freezes part of the model (gate
    calibration: 30 scalars of a 135M model; LoRA) holds what trains, not the frozen base, next to the
    optimizer, scheduler, RNG and Trainer state the Trainer writes anyway. A PEFT model's checkpoint
    is PEFT's adapter folder (the Trainer's own save), plus `trainable.safetensors` only for trainable
    parameters outside the adapters (gates); any other model's weights are `trainable.safetensors`.
    Resuming loads them back into the model (the frozen base is the one the run started from), so
    an interrupted and resumed run equals an uninterrupted one. A run that trains every parameter,
    or one sharded by FSDP / DeepSpeed (which save through their own engines), keeps the Trainer's
    checkpoints, and `trainer.save_model()` called by a user still writes the whole model."""

    def _trainable_only(self) -> bool:
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return False
        flags = [p.requires_grad for p in self.model.parameters()]
        return any(flags) and not all(flags)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not (_internal_call and self._trainable_only()):
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        if getattr(self.model, "peft_config", None):
            super().save_model(output_dir, _internal_call)  # PEFT saves the adapters only
        tensors = outside_adapters(self.model)
        if tensors and self.args.should_save:
            from safetensors.torch import save_file

            os.makedirs(output_dir, exist_ok=True)
            save_file({name: p.detach().contiguous().cpu() for name, p in tensors.items()},
                      os.path.join(output_dir, TRAINABLE_WEIGHTS), metadata={"format": "pt"})
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        path = os.path.join(resume_from_checkpoint, TRAINABLE_WEIGHTS)
        if not os.path.isfile(path):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        model = model if model is not None else self.model
        if getattr(model, "peft_config", None):
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # the adapters
        load_trainable(model, path)

    def _load_best_model(self) -> None:
        path = os.path.join(self.state.best_model_checkpoint or "", TRAINABLE_WEIGHTS)
        if os.path.isfile(path) and not getattr(self.model, "peft_config", None):
            load_trainable(self.model, path)
        else:
            super()._load_best_model()
            if os.path.isfile(path):
                load_trainable(self.model, path)


def with_trainable_checkpoints(trainer_class):
    """`trainer_class` with TrainableCheckpoints mixed in (the class itself if it has it already)."""
    if issubclass(trainer_class, TrainableCheckpoints):
        return trainer_class
    return type(trainer_class.__name__, (TrainableCheckpoints, trainer_class), {"__module__": trainer_class.__module__})


def load_trainable(model, path: str) -> None:
    """Copy a checkpoint's `trainable.safetensors` into `model`, which must have exactly those trainable
    parameters with those shapes (otherwise the checkpoint belongs to another run: an error)."""
    from safetensors.torch import load_file

    saved = load_file(path)
    params = dict(model.named_parameters())
    expected = set(outside_adapters(model))
    unknown = sorted(set(saved) - set(params))
    missing = sorted(expected - set(saved))
    shapes = sorted(n for n in set(saved) & set(params) if tuple(saved[n].shape) != tuple(params[n].shape))
    if unknown or missing or shapes:
        raise ValueError(f"checkpoint {path} does not fit this model (another run's checkpoint?): "
                         + "; ".join(f"{what} {names[:5]}" for what, names in
                                     (("not in the model:", unknown), ("trainable but not saved:", missing),
                                      ("other shapes:", shapes)) if names) + ".")
    with torch.no_grad():
        for name, value in saved.items():
            params[name].copy_(value.to(params[name].device))


def outside_adapters(model) -> dict[str, torch.Tensor]:
    """The trainable parameters a checkpoint must hold besides what the Trainer's own save writes (PEFT's adapters)."""
    adapters = tuple(f".{name}." for name in getattr(model, "peft_config", None) or ())
    return {name: p for name, p in model.named_parameters()
            if p.requires_grad and not (adapters and any(a in name for a in adapters))}


def loss_curve(trainer) -> list[tuple[int, float]]:
    return [(row["step"], row["loss"]) for row in trainer.state.log_history if "loss" in row]


class ObserveCallback(TrainerCallback):
    """Calls `observe(model) -> dict` before the first step, every `every` steps and at the last
    step (on the main process); keeps the rows in `history`, and logs them through the trainer
    (so every `report_to` backend gets them) once attached with `callback.attach(trainer)`."""

    def __init__(self, observe, every: int, *, log_prefix: str | None = None):
        self.observe, self.every, self.log_prefix = observe, every, log_prefix
        self.history: list[dict] = []
        self.trainer = None

    def attach(self, trainer):
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    def _record(self, state, model):
        if not state.is_world_process_zero:
            return
        row = self.observe(model)
        self.history.append({"step": state.global_step, **row})
        if self.trainer is not None and self.log_prefix is not None:
            self.trainer.log({f"{self.log_prefix}{key}": value for key, value in row.items()})

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0 and self.log_prefix is None:
            self._record(state, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self._record(state, model)


def diagnostics_callback(windows: torch.Tensor, *, every_n_steps: int = 50, layers: list[int] | None = None,
                         quantities=("rho", "orthogonality_error", "norm_x", "ffn_angle", "diversity_after_ffn"),
                         batch_size: int = 1) -> ObserveCallback:
    """An ObserveCallback that runs the diagnostics on fixed `windows` every N steps and logs the
    per-layer means as diagnostics/layer_<i>/<quantity>. Attach with `callback.attach(trainer)`."""
    unknown = [q for q in quantities if q not in QUANTITIES]
    if unknown:
        raise ValueError(f"unknown diagnostics {unknown}; accepted: {', '.join(QUANTITIES)}.")

    def observe(model):
        records = diagnose(model, windows, layers=layers, batch_size=batch_size)
        return {f"layer_{r['layer']}/{q}": r[q]["mean"] for r in records for q in quantities}

    return ObserveCallback(observe, every_n_steps, log_prefix="diagnostics/")
