"""The control plane: typed messages (never pickle), the messenger, authentication, rank collectives."""
