"""`hf-tangent export`: a patch repo as a complete folder (base weights, LoRA merged, gates, remote code)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..artifacts.models import OFFLINE_MODELS, offline_folder
from ..artifacts.patch_repo import export_full_folder, read_record
from ..core.destinations import DestinationError, check_destination
from .arguments import Checked, CommandError, add_command, dataclasses_of


@dataclass
class ExportArguments(Checked):
    patch: str | None = field(default=None, metadata={"help": "the patch repo: a folder written by save_patch, or a hub id"})
    output: str | None = field(default=None, metadata={"help": "the folder to write the complete model to"})
    base_model: str | None = field(default=None, metadata={
        "help": "load the base from here instead of the id the patch records (a local mirror)"})
    dtype: Literal["float32", "bfloat16", "float16"] = field(default="float32", metadata={"help": "weights dtype"})


def export_command_parser(subparsers):
    return add_command(subparsers, "export", (ExportArguments,),
                       "write a patch repo as a complete model folder that loads without hf_tangent "
                       "(trust_remote_code=True)", export_command, recipe=False)


def export_command(args) -> int:
    import torch
    from transformers import AutoTokenizer


    (options,) = dataclasses_of(args.parser, args)
    if not options.patch or not options.output:
        raise CommandError("--patch and --output are required.")
    record = read_record(options.patch)
    try:  # an artifact folder, not a run folder: new, empty, or a patched folder / patch repo of ours
        check_destination(options.output, protected=[options.patch, options.base_model or record["base"]["name_or_path"]],
                          writer="--output")
    except DestinationError as err:
        raise CommandError(str(err)) from None
    source = options.base_model or record["base"]["name_or_path"]
    try:
        tokenizer = AutoTokenizer.from_pretrained(offline_folder(source) if source in OFFLINE_MODELS else source)
    except (OSError, ValueError):
        tokenizer = None  # the base has no tokenizer files: the folder is written without one
    folder = export_full_folder(options.patch, options.output, base_model=options.base_model, tokenizer=tokenizer,
                                dtype=getattr(torch, options.dtype))
    print(f"wrote {folder}")
    return 0
