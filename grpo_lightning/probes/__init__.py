"""Diagnostic probes as Lightning callbacks; a probe never changes training."""
