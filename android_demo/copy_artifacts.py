"""Copy what the Android app loads from an export folder into app/src/main/assets/:

    python android_demo/copy_artifacts.py export/out

hrm.kv.pte (the int8 KV-cache ExecuTorch program), tokenizer.json and web_bundle.bin (the web parity bundle
for the Self-test; built from the export's parity bundle if the export did not write it). Each file is
checked against the manifest's sha256 first. Needs the .pte, so the export must include ExecuTorch
(the default `python -m hrm_edge.export` does; `--formats onnx` does not).
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere in a checkout

from hrm_edge.errors import UserError, run_cli  # noqa: E402
from hrm_edge.io import sha256_file  # noqa: E402
from hrm_edge.parity import load_bundle, read_manifest  # noqa: E402
from hrm_edge.web_bundle import WEB_BUNDLE, write_web_bundle  # noqa: E402

ASSETS = Path(__file__).resolve().parent / "app" / "src" / "main" / "assets"


def checked(out_dir: Path, entry: dict) -> Path:
    path = out_dir / entry["path"]
    if not path.is_file():
        raise UserError(f"{entry['path']} is missing from {out_dir}")
    if sha256_file(path) != entry["sha256"]:
        raise UserError(f"{entry['path']} does not match the sha256 in {out_dir}/manifest.json (modified); re-export")
    return path


def copy_artifacts(out_dir: Path, assets: Path = ASSETS, precision: str = "int8") -> list[Path]:
    manifest = read_manifest(out_dir)
    kv = [a for a in manifest["artifacts"] if a["format"] == "pte" and a["program"] == "kv_cache"
          and a["precision"] == precision and "cycles" not in a]
    if not kv:
        raise UserError(f"{out_dir} has no {precision} KV-cache .pte; run python -m hrm_edge.export (with ExecuTorch)")
    assets.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(checked(out_dir, kv[0]), assets / "hrm.kv.pte")
    shutil.copyfile(checked(out_dir, manifest["tokenizer"]), assets / "tokenizer.json")
    if manifest.get("web_bundle"):
        shutil.copyfile(checked(out_dir, manifest["web_bundle"]), assets / WEB_BUNDLE)
    else:
        write_web_bundle(assets, manifest, load_bundle(checked(out_dir, manifest["parity_bundle"])))
    return [assets / n for n in ("hrm.kv.pte", "tokenizer.json", WEB_BUNDLE)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, help="export folder (holds manifest.json)")
    p.add_argument("--assets", type=Path, default=ASSETS, help=f"where to copy to (default {ASSETS})")
    p.add_argument("--precision", choices=("int8", "fp32"), default="int8", help="which KV .pte (default int8)")
    a = p.parse_args(argv)
    for path in copy_artifacts(a.dir, a.assets, a.precision):
        print(f"{path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    run_cli(main)
