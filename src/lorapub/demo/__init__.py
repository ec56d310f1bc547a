"""``python -m lorapub demo``: the publish -> bind -> reclaim lifecycle on two engines, and its workload."""
