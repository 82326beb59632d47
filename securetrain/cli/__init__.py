"""The ``securetrain`` command line: a thin layer over the library."""
