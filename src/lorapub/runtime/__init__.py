"""Orchestration: the in-process registry and its stores, the effect runner, publisher,
reclaimer, sessions, the deployment that wires them and the old overwrite path. Imports
the core and the ports, never an adapter, the demo or the test aids."""

__all__: list[str] = []
