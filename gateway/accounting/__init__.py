"""Who may ask and what they owe: keys, per-key limits (the pure rule and its memory or Redis
store), charges and refunds, usage records, idempotent answers and the state files behind them."""
