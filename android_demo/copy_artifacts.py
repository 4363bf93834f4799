"""Copy what the Android app loads from an export folder into app/src/main/assets/:

    python android_demo/copy_artifacts.py export/out

hrm.kv.pte (the int8 KV-cache ExecuTorch program), tokenizer.json, web_bundle.bin (the web parity bundle
for the Self-test; built from the export's parity bundle if the export did not write it) and program.json (which
program it is: the Self-test judges it by its precision's tolerances). Each file is checked against the manifest's
sha256 first, and a program that did not pass the export's parity gate is refused. Needs the .pte, so the export
must include ExecuTorch (the default `python -m hrm_edge.export` does; `--formats onnx` does not).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere in a checkout

from hrm_edge.errors import UserError, run_cli  # noqa: E402
from hrm_edge.runtime.manifest import manifest_json, read_manifest, verify_files  # noqa: E402
from hrm_edge.verify.parity import load_bundle  # noqa: E402
from hrm_edge.verify.web_bundle import WEB_BUNDLE, write_web_bundle  # noqa: E402

ASSETS = Path(__file__).resolve().parent / "app" / "src" / "main" / "assets"


def copy_artifacts(out_dir: Path, assets: Path = ASSETS, precision: str = "int8") -> list[Path]:
    manifest = read_manifest(out_dir)
    kv = [a for a in manifest["artifacts"] if a.format == "pte" and a.program == "kv_cache"
          and a.precision == precision and a.cycles is None]
    if not kv:
        raise UserError(f"{out_dir} has no {precision} KV-cache .pte; run python -m hrm_edge.export (with ExecuTorch)")
    kv = [a for a in kv if a.passed_gate()] or kv[:1]
    if not kv[0].passed_gate():  # the app ships what it copies: a program the gate refused stays out of it
        raise UserError(f"{kv[0].path} did not pass the export's parity gate; refusing to copy it into the app "
                        f"(python -m hrm_edge.parity {out_dir} re-checks it)")
    listed = manifest.get("web_bundle") or manifest["parity_bundle"]
    # every file checked against the manifest's sha256 before anything is copied
    pte, tokenizer, bundle = verify_files(out_dir, manifest, [kv[0].path, manifest["tokenizer"]["path"], listed["path"]],
                                          hint="re-export")
    assets.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(pte, assets / "hrm.kv.pte")
    shutil.copyfile(tokenizer, assets / "tokenizer.json")
    if manifest.get("web_bundle"):
        shutil.copyfile(bundle, assets / WEB_BUNDLE)
    else:  # an export from before the web bundle was listed: build it (hrm_edge.verify.web_bundle reads JSON)
        write_web_bundle(assets, json.loads(manifest_json(manifest)), load_bundle(bundle))
    program = {"artifact": kv[0].path, "precision": precision, "sha256": kv[0].sha256}
    (assets / "program.json").write_text(json.dumps(program, indent=2) + "\n")
    return [assets / n for n in ("hrm.kv.pte", "tokenizer.json", WEB_BUNDLE, "program.json")]


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
