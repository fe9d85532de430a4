#!/usr/bin/env python3
"""Fills the models volume from the Hugging Face Hub, once (the chart's download Job runs it;
deploy/compose.yaml's `fetch-models` service too).

Each model folder is fetched with huggingface_hub.snapshot_download into
$MODELS_DIR/<folder>, and a `.specd-complete` marker is written into the folder only after the
download finished and the folder holds config.json and at least one *.safetensors file. A folder
that already has the marker is left alone, so the Job is a no-op after the first run; an
interrupted download resumes (snapshot_download skips the files it already has). The specd pods
wait for their folder's marker before they start.

Environment:
  MODELS_DIR                  the volume's mount point
  SPECD_TARGET_MODEL, SPECD_TARGET_REPO, SPECD_TARGET_REVISION   folder, Hub repo, revision
  SPECD_DRAFT_MODEL, SPECD_DRAFT_REPO, SPECD_DRAFT_REVISION      (optional: no draft model)
  SPECD_ALLOW_PATTERNS        newline-separated fnmatch patterns of the files to fetch
  SPECD_PIP_PACKAGE           pip requirement installed into /tmp when huggingface_hub is absent
  HF_TOKEN                    token for gated or private repositories (optional)
"""

import os
import subprocess
import sys

MARKER = ".specd-complete"


def log(msg):
    print(f"fetch_models: {msg}", flush=True)


def hub_download():
    """huggingface_hub.snapshot_download, pip-installed into /tmp first when missing (the
    container's root filesystem is read-only)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        package = os.environ.get("SPECD_PIP_PACKAGE", "huggingface_hub")
        target = "/tmp/specd-pylib"
        log(f"installing {package} into {target}")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-cache-dir",
                        "--target", target, package], check=True)
        sys.path.insert(0, target)
        from huggingface_hub import snapshot_download
    return snapshot_download


def complete(folder):
    return os.path.isfile(os.path.join(folder, MARKER))


def check_model_folder(folder):
    """Why the folder is not a usable model folder, or None."""
    names = set(os.listdir(folder))
    if "config.json" not in names:
        return "no config.json"
    if not any(n.endswith(".safetensors") for n in names):
        return "no *.safetensors file"
    return None


def fetch(models_dir, name, repo, revision, patterns, download):
    """Fetches repo into models_dir/name unless it is complete; returns True if it fetched."""
    if not name or os.path.isabs(name) or ".." in name.split("/"):
        raise ValueError(f"model folder {name!r} must be a relative path inside {models_dir}")
    folder = os.path.join(models_dir, name)
    if complete(folder):
        log(f"{name}: complete ({MARKER} present), skipped")
        return False
    if not repo:
        raise ValueError(f"{name}: no Hub repository to fetch it from")
    os.makedirs(folder, exist_ok=True)
    log(f"{name}: fetching {repo}" + (f"@{revision}" if revision else "") +
        f" ({', '.join(patterns)})")
    download(repo_id=repo, revision=revision or None, local_dir=folder,
             allow_patterns=patterns or None)
    problem = check_model_folder(folder)
    if problem:
        raise RuntimeError(f"{name}: {repo} gave {problem}; not marking it complete")
    with open(os.path.join(folder, MARKER), "w", encoding="utf-8") as f:
        f.write(f"{repo} {revision or 'default branch'}\n")
    log(f"{name}: complete")
    return True


def main(env=os.environ, download=None):
    models_dir = env.get("MODELS_DIR", "")
    if not os.path.isdir(models_dir):
        log(f"MODELS_DIR={models_dir!r} is not a folder")
        return 2
    patterns = [p.strip() for p in env.get("SPECD_ALLOW_PATTERNS", "").splitlines()
                if p.strip()]
    jobs = [(env.get("SPECD_TARGET_MODEL", ""), env.get("SPECD_TARGET_REPO", ""),
             env.get("SPECD_TARGET_REVISION", ""))]
    if env.get("SPECD_DRAFT_MODEL"):
        jobs.append((env["SPECD_DRAFT_MODEL"], env.get("SPECD_DRAFT_REPO", ""),
                     env.get("SPECD_DRAFT_REVISION", "")))
    pending = [j for j in jobs if not complete(os.path.join(models_dir, j[0] or "."))]
    if pending and download is None:
        download = hub_download()
    try:
        for name, repo, revision in jobs:
            fetch(models_dir, name, repo, revision, patterns, download)
    except (ValueError, RuntimeError) as e:
        log(str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
