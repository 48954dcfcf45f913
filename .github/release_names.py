"""Print the release's version and names as ``key=value`` lines for ``$GITHUB_OUTPUT``
(.github/workflows/release.yml), read from alpajob/api/release.py, the one place they
are written. ``push`` is true for a tag push only: run by hand, nothing is pushed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from alpajob.api import release  # noqa: E402  (the repository's own, not an installed one)

print(f"version={release.VERSION}")
print(f"trainer={release.TRAINER_IMAGE}")
print(f"cpu_trainer={release.CPU_TRAINER_IMAGE}")
print(f"operator={release.OPERATOR_IMAGE}")
print(f"charts={release.CHART_REPOSITORY}")
print(f"push={'true' if os.environ.get('GITHUB_REF_TYPE') == 'tag' else 'false'}")
