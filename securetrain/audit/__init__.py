"""Tamper-evident audit log."""
