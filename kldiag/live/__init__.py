"""Live: act on a run while it trains (the Guard) and follow it from a terminal (the watcher)."""
