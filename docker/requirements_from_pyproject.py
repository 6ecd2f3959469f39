"""Print zerotune's dependencies (core + the ``hf`` extra) except torch, one per line.

The Docker images install torch their own way (the NVIDIA image ships a CUDA build, the CPU image
takes the CPU wheel); everything else comes from ``pyproject.toml``, so the images cannot drift
from what ``pip install -e '.[hf]'`` installs.
"""

import sys
import tomllib

with open(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml", "rb") as handle:
    project = tomllib.load(handle)["project"]
for requirement in [*project["dependencies"], *project["optional-dependencies"]["hf"]]:
    if not requirement.replace(" ", "").lower().startswith("torch"):
        print(requirement)
