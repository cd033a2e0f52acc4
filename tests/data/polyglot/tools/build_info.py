"""Print the build's name and version from web/package.json."""

import json
from pathlib import Path


def build_info(root: Path) -> str:
    package = json.loads((root / "web" / "package.json").read_text())
    return f"{package['name']} {package['version']}"


if __name__ == "__main__":
    print(build_info(Path(__file__).resolve().parent.parent))
