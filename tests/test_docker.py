"""The Docker images (docker/): built from the repository, never replacing the image's torch, with
NCCL's debug output on in the GPU image. No daemon runs here, so these are the static checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _instructions(name: str) -> list[str]:
    text = (ROOT / "docker" / name).read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_gpu_image_is_nvidia_pytorch_with_nccl_debug_and_keeps_its_torch() -> None:
    lines = _instructions("Dockerfile")
    assert lines[0].startswith("FROM nvcr.io/nvidia/pytorch:")
    assert any(line.startswith("ENV") and "NCCL_DEBUG=INFO" in line for line in lines)
    installs = [line for line in lines if "pip install" in line]
    assert not any("torch" in line.split("pip install", 1)[1] for line in installs)
    assert any("--no-deps ." in line for line in installs)


def test_cpu_image_takes_the_cpu_torch_wheel() -> None:
    lines = _instructions("Dockerfile.cpu")
    assert lines[0].startswith("FROM python:3.11")
    assert any("torch==2.13.0" in line and "whl/cpu" in line for line in lines)


def test_every_copied_path_exists_and_the_command_is_the_readme_main_job() -> None:
    for name in ("Dockerfile", "Dockerfile.cpu"):
        for line in _instructions(name):
            if line.startswith("COPY"):
                for source in line.split()[1:-1]:
                    assert (ROOT / source).exists(), (name, source)
        assert _instructions(name)[-1] == 'CMD ["zerotune", "finetune"]'


def test_requirements_are_pyprojects_without_torch() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "docker" / "requirements_from_pyproject.py"),
                           str(ROOT / "pyproject.toml")], capture_output=True, text=True, check=True)
    requirements = done.stdout.split()
    assert "pydantic>=2" in requirements and any(r.startswith("transformers") for r in requirements)
    assert not any(r.lower().startswith("torch") for r in requirements)
