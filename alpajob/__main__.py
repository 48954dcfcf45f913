"""``python -m alpajob`` runs the console script."""

from alpajob.cli.main import entry

# Guarded: the planner's worker processes (multiprocessing's forkserver) import the
# parent's main module again, under another name, and must not run the CLI.
if __name__ == "__main__":
    entry()
