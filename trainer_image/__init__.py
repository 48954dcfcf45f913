"""The trainer image's Python side (``alpajob.trainer``): the model zoo now; the
runtime that executes a Plan lands with the trainer issue."""
