"""Thin bindings of the ports to Ray, SGLang's HTTP admin API and torch.distributed."""
