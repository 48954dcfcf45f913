"""``python -m alpajob`` runs the console script."""

from alpajob.cli.main import main

raise SystemExit(main())
