"""What the main job writes, with sizes: every file under a finished run's output folder.

    hf-tangent calibrate --recipe recipes/offline_default.yaml --output_dir RUN
    python benchmarks/main_job_files.py RUN --output docs/results/offline_default_files.json

The README's list of written files is rendered from the kept JSON (docs/figures.py, region
main-job-files). Paths are relative to the run folder; checkpoint folders are listed file by file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def files(run: Path) -> dict[str, int]:
    return {str(p.relative_to(run)): p.stat().st_size for p in sorted(run.rglob("*")) if p.is_file()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="the main job's output folder")
    parser.add_argument("--output", type=Path, required=True, help="the JSON to write")
    args = parser.parse_args(argv)
    report = json.loads((args.run / "report.json").read_text(encoding="utf-8"))
    listing = files(args.run)
    args.output.write_text(json.dumps({"command": "main-job-files", "model": report["model"], "seed": report["seed"],
                                       "training": report["training"], "files": listing,
                                       "total_bytes": sum(listing.values())}, indent=1) + "\n", encoding="utf-8")
    print(f"{len(listing)} files, {sum(listing.values()) / 1e6:.2f} MB -> {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
