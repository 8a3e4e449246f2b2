"""The bill: the cost ledger fed by token events, and ``track_cost()`` across calls."""
