"""Orchestration: the registry service and its stores, the effect runner, publisher,
reclaimer, sessions and the deployment that wires them. Imports the core and the
ports, never an adapter, the demo or the test aids."""
