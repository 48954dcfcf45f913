"""The ``alpajob`` command line (:mod:`.main`): flags in, typed options out, one module
per command; it sits on top of every other layer."""
