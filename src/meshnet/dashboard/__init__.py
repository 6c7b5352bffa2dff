"""The tracker's web dashboard: the layer map, nodes, open sessions and routes, tokens/s and time to first
token, ledger balances (:mod:`meshnet.dashboard.server` serves it; :mod:`meshnet.dashboard.state` computes it)."""
