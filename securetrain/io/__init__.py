"""Small I/O helpers shared by every capability."""

from securetrain.io.atomic import atomic_write_bytes, atomic_writer

__all__ = ["atomic_write_bytes", "atomic_writer"]
