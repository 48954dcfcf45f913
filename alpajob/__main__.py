"""``python -m alpajob`` runs the console script."""

from alpajob.cli import main

raise SystemExit(main())
