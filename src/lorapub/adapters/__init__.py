"""Thin bindings of the ports to the outside world: SGLang's HTTP API, the engine-side
staging protocol any engine adapter reuses, the Ray registry actor and torch.distributed."""

__all__: list[str] = []
