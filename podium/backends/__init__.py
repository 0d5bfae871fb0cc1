"""Backends shipped with podium. Each is a plugin in the ``podium.backends`` entry-point group."""
